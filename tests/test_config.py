import dataclasses

import pytest

from dsa_precision import IndexerPrecisionConfig, ScoringPrecision

GOOD = dict(indexer_loss_coeff=0.0, n_heads=64, head_dim=128, device="cpu")


def test_defaults_are_megatron_behaviour():
    """A config read from a Megatron config without the package's fields builds Megatron's
    operands: BF16 preprocessing (no FP32 carriers), rounded to BF16, no descales."""
    import torch

    from dsa_precision import IndexerPreprocess, prepare_indexer_operands

    cfg = IndexerPrecisionConfig.from_megatron_config(object())
    assert cfg == IndexerPrecisionConfig()
    g = torch.Generator().manual_seed(0)
    pre = IndexerPreprocess(128, 64, rope_fp32=cfg.rope_fp32)
    q = torch.randn(5, 1, 32, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(5, 1, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(5, 1, 32, generator=g).to(torch.bfloat16)
    freqs = torch.rand(5, 1, 1, 64, generator=g) * 10
    ops = prepare_indexer_operands(pre, q, k, w, freqs, config=cfg)
    megatron = IndexerPreprocess(128, 64, k_norm=pre.k_norm)  # Megatron's BF16 path
    qq, kk = megatron(q, k, freqs)
    assert ops.precision is ScoringPrecision.BF16 and ops.q_descale is None
    assert torch.equal(ops.q, qq.transpose(0, 1)) and torch.equal(ops.k, kk.transpose(0, 1))


@pytest.mark.parametrize(
    "rope_fp32, precision, label",
    [
        (False, "bf16", "baseline"),
        (True, "bf16", "rope_fp32"),
        (False, "fp8", "fp8"),
        (True, "FP8", "rope_fp32+fp8"),
    ],
)
def test_matrix_and_labels(rope_fp32, precision, label):
    cfg = IndexerPrecisionConfig(rope_fp32=rope_fp32, scoring_precision=precision)
    assert cfg.scoring_precision is ScoringPrecision(precision.lower())
    assert cfg.short_str() == label
    # String and enum forms build equal configs.
    assert cfg == IndexerPrecisionConfig(rope_fp32, ScoringPrecision(precision.lower()))


def test_frozen():
    cfg = IndexerPrecisionConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope_fp32 = True


@pytest.mark.parametrize("bad", ["fp16", "e4m3", "", None, 8])
def test_unknown_precision_lists_allowed_values(bad):
    with pytest.raises(ValueError, match=r"scoring_precision=.*'bf16', 'fp8'"):
        IndexerPrecisionConfig(scoring_precision=bad)


@pytest.mark.parametrize("bad", [1, 0, "true", None, 1.0])
def test_rope_fp32_must_be_bool(bad):
    with pytest.raises(TypeError, match="rope_fp32 must be a bool"):
        IndexerPrecisionConfig(rope_fp32=bad)


def test_bf16_accepts_any_model():
    IndexerPrecisionConfig().validate_for_model(indexer_loss_coeff=1.0, n_heads=16, head_dim=64)


def test_fp8_accepts_supported_model():
    for heads in (32, 64):
        IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
            **{**GOOD, "n_heads": heads}
        )
    IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
        **{**GOOD, "indexer_loss_coeff": None}
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("indexer_loss_coeff", 0.1, r"dsa_indexer_loss_coeff=0.1.*Set it to 0"),
        ("n_heads", 16, r"dsa_indexer_n_heads=16.*\(32, 64\)"),
        ("n_heads", 128, r"dsa_indexer_n_heads=128"),
        ("head_dim", 64, r"dsa_indexer_head_dim=64.*set it to 128"),
    ],
)
def test_fp8_rejects_each_violation(field, value, message):
    with pytest.raises(ValueError, match=message):
        IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(**{**GOOD, field: value})


def test_fp8_lists_all_violations_at_once():
    with pytest.raises(ValueError) as info:
        IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
            indexer_loss_coeff=1.0, n_heads=16, head_dim=64, device="cpu"
        )
    text = str(info.value)
    for field in (
        "dsa_indexer_loss_coeff",
        "dsa_indexer_n_heads",
        "dsa_indexer_head_dim",
    ):
        assert field in text


def test_fp8_checks_compute_capability(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.0.*SM90"):
        IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
            **{**GOOD, "device": "cuda:0"}
        )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
        **{**GOOD, "device": "cuda:0"}
    )


def test_from_megatron_config():
    class Cfg:
        dsa_indexer_rope_fp32 = True
        dsa_indexer_scoring_precision = "fp8"

    assert IndexerPrecisionConfig.from_megatron_config(Cfg()) == IndexerPrecisionConfig(True, "fp8")
    assert IndexerPrecisionConfig.from_megatron_config(object()) == IndexerPrecisionConfig()
    Cfg.dsa_indexer_engine = "lmdeploy"
    assert IndexerPrecisionConfig.from_megatron_config(Cfg()).engine.name == "lmdeploy"
    Cfg.dsa_indexer_scoring_backend = "deepgemm"
    assert IndexerPrecisionConfig.from_megatron_config(Cfg()).scoring_backend == "deepgemm"


def test_the_scoring_kernel_is_a_field_checked_at_construction():
    assert IndexerPrecisionConfig().scoring_backend == "auto"
    pinned = IndexerPrecisionConfig(scoring_precision="fp8", scoring_backend="deepgemm")
    assert pinned != IndexerPrecisionConfig(scoring_precision="fp8")  # part of the precision
    with pytest.raises(ValueError, match=r"scoring_backend='tpu' is not a scoring backend"):
        IndexerPrecisionConfig(scoring_backend="tpu")
    with pytest.raises(ValueError, match=r"scoring_backend='deepgemm': .* FP8 operands only"):
        IndexerPrecisionConfig(scoring_backend="deepgemm")  # BF16 scoring
    with pytest.raises(dataclasses.FrozenInstanceError):
        pinned.scoring_backend = "torch"  # type: ignore[misc]


def test_prepared_operands_carry_the_configs_kernel_to_every_call():
    """On the CPU only the torch reference scores: a config pinning cuDNN is honoured (its
    operands' scoring and selection refuse to run anything else), and a call naming a backend
    overrides it for that call alone."""
    import torch

    from dsa_precision import (
        indexer_scores,
        indexer_select,
        prepare_scoring_operands,
        scoring_calls,
    )

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 32, 128, generator=g)
    k = torch.randn(1, 6, 128, generator=g)
    w = torch.randn(1, 6, 32, generator=g)
    for precision in ("bf16", "fp8"):
        config = IndexerPrecisionConfig(scoring_precision=precision, scoring_backend="cudnn")
        ops = prepare_scoring_operands(q, k, w, config=config)
        assert ops.backend == "cudnn" and ops.rows(0, 3).backend == "cudnn"
        with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot score this call"):
            indexer_scores(ops)
        with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot score this call"):
            indexer_select(ops, topk=2)
        with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot score this call"):
            indexer_scores(q, k, w, config=config)  # carriers prepared under the config
        before = scoring_calls(precision, "torch")
        auto = prepare_scoring_operands(
            q, k, w, config=dataclasses.replace(config, scoring_backend="auto")
        )
        assert auto.backend == "auto"
        assert torch.equal(indexer_scores(ops, backend="torch"), indexer_scores(auto))
        assert scoring_calls(precision, "torch") == before + 2


def test_fp8_on_a_blackwell_gpu_is_refused(monkeypatch):
    """The per-128-vector FP8 indexer kernels are SM90-only (SM100 scores MXFP8)."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(ValueError, match=r"compute capability 10\.0.*SM90"):
        IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(
            **{**GOOD, "device": "cuda:0"}
        )


def test_model_problems_are_the_lines_validate_for_model_raises():
    config = IndexerPrecisionConfig(scoring_precision="fp8")
    kw = dict(indexer_loss_coeff=0.1, n_heads=48, head_dim=96, device="cpu")
    problems = config.model_problems(**kw)
    assert len(problems) == 3 and all(isinstance(p, str) for p in problems)
    assert any(p.startswith("dsa_indexer_n_heads=48") for p in problems)
    with pytest.raises(ValueError) as err:
        config.validate_for_model(**kw)
    assert str(err.value).splitlines()[1:] == [f"  - {p}" for p in problems]
    assert (
        config.model_problems(indexer_loss_coeff=0.0, n_heads=32, head_dim=128, device="cpu") == []
    )
