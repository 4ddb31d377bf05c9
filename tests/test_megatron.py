"""Megatron integration on the CPU (megatron-core 0.19, local non-TE specs).

cuDNN's kernels and an SM90 GPU are unavailable here: a recording fake of ``cudnn.DSA`` stands in
for the kernels (``tests/fake_cudnn.py``) and checks what reaches them; the real kernels are
covered by the ``gpu`` tests.
"""

import argparse
import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

import dsa_precision.megatron as dsap
from dsa_precision import IndexerPrecisionConfig, reset_scoring_calls, scoring_calls
from dsa_precision.megatron import seams
from dsa_precision.megatron.specs import LocalDSASpecProvider

from . import fake_cudnn

HIDDEN, Q_LORA, KV_LORA, ROPE, V_DIM, HEADS = 256, 64, 32, 64, 64, 4
CONFIGS = {
    "baseline": dict(),
    "rope_fp32": dict(dsa_indexer_rope_fp32=True),
    "fp8": dict(dsa_indexer_scoring_precision="fp8"),
    "rope_fp32+fp8": dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8"),
}


@contextlib.contextmanager
def fake_sm90():
    """Pretend an SM90 GPU exists while a config validates its kernel backend."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        yield


def make_config(**overrides):
    fields = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_head_dim=64,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=V_DIM,
        add_bias_linear=False,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=32,
        dsa_indexer_head_dim=128,
        dsa_indexer_topk=8,
        dsa_indexer_loss_coeff=0.0,
        dsa_indexer_rotate_activation=False,
        rope_type="rope",
        dsa_kernel_backend="cudnn",
    )
    fields.update(overrides)
    with fake_sm90():
        return dsap.DSAPrecisionTransformerConfig(**fields)


@pytest.fixture
def seams_installed(megatron_parallel):
    dsap.install()
    yield
    dsap.uninstall()


@pytest.fixture
def fake(monkeypatch, seams_installed, cpu_rotary):
    return fake_cudnn.install(monkeypatch)


# ------------------------------------------------------------------------------------ config


def test_field_defaults_keep_megatron_behaviour(megatron_parallel):
    config = make_config()
    assert config.dsa_indexer_rope_fp32 is False and config.dsa_indexer_scoring_precision == "bf16"
    assert config.dsa_indexer_precision == IndexerPrecisionConfig()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(dsa_kernel_backend="none"),
            r"dsa_kernel_backend='none'.*set dsa_kernel_backend='cudnn'",
        ),
        (dict(dsa_indexer_loss_coeff=0.1), r"dsa_indexer_loss_coeff=0\.1"),
        (dict(dsa_indexer_scoring_relu=False), r"dsa_indexer_scoring_relu=False"),
        (
            dict(attention_backend="unfused"),
            r"attention_backend=.*unfused.*fused attention backend",
        ),
        (dict(dsa_indexer_n_heads=16), r"dsa_indexer_n_heads=16"),
        (dict(dsa_indexer_head_dim=64), r"dsa_indexer_head_dim=64"),
    ],
)
def test_fp8_validation_names_the_field(megatron_parallel, overrides, message):
    from megatron.core.transformer.enums import AttnBackend

    if overrides.get("attention_backend") == "unfused":
        overrides = dict(attention_backend=AttnBackend.unfused)
    with pytest.raises(ValueError, match=message):
        make_config(dsa_indexer_scoring_precision="fp8", **overrides)


def test_fp8_needs_the_dsa_variant(megatron_parallel):
    with pytest.raises(
        ValueError,
        match=r"experimental_attention_variant=None.*set experimental_attention_variant='dsa'",
    ):
        make_config(dsa_indexer_scoring_precision="fp8", experimental_attention_variant=None)


def test_bad_values_name_the_field(megatron_parallel):
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_precision='int8'.*'bf16', 'fp8'"):
        make_config(dsa_indexer_scoring_precision="int8")
    with pytest.raises(TypeError, match="dsa_indexer_rope_fp32 must be a bool"):
        make_config(dsa_indexer_rope_fp32="yes")


def test_cudnn_backend_without_cuda_is_a_clear_error(megatron_parallel):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="dsa_kernel_backend='cudnn' requires a CUDA device"):
        dsap.DSAPrecisionTransformerConfig(
            **{
                f.name: getattr(make_config(), f.name)
                for f in dataclasses.fields(make_config())
                if f.init
            }
        )


def test_cli_flags_round_trip_into_the_config(megatron_parallel, monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(
        "sys.argv",
        ["train.py", "--num-layers", "1", "--hidden-size", str(HIDDEN), "--num-attention-heads",
         str(HEADS), "--seq-length", "64", "--max-position-embeddings", "64",
         "--dsa-indexer-rope-fp32", "--dsa-indexer-scoring-precision", "fp8"],
    )  # fmt: skip
    args = parse_args(extra_args_provider=dsap.add_dsa_precision_args)
    assert args.dsa_indexer_rope_fp32 is True and args.dsa_indexer_scoring_precision == "fp8"
    parser = dsap.add_dsa_precision_args(argparse.ArgumentParser())
    assert parser.parse_args([]).dsa_indexer_scoring_precision == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dsa-indexer-scoring-precision", "int8"])
    base = make_config()
    monkeypatch.setattr(
        "megatron.training.argument_utils.core_transformer_config_from_args", lambda a: base
    )
    with fake_sm90():
        config = dsap.config_from_args(args)
    assert isinstance(config, dsap.DSAPrecisionTransformerConfig)
    assert config.dsa_indexer_precision == IndexerPrecisionConfig(True, "fp8")
    assert config.hidden_size == HIDDEN


# ------------------------------------------------------------------------------------- specs


def test_spec_swap_replaces_only_the_dsa_modules(megatron_parallel):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention

    config = make_config()
    upstream = get_dsa_module_spec_for_backend(config, LocalDSASpecProvider())
    swapped = dsap.get_dsa_precision_module_spec(config, LocalDSASpecProvider())
    core = swapped.submodules.core_attention
    assert core.module is dsap.PrecisionDSAttention
    assert core.submodules.indexer.module is dsap.PrecisionDSAIndexer
    assert upstream.submodules.core_attention.module is DSAttention  # input untouched
    assert swapped.module is upstream.module
    assert (
        core.submodules.indexer.submodules
        == upstream.submodules.core_attention.submodules.indexer.submodules
    )

    def count(spec, cls) -> int:
        if isinstance(spec, type):
            return int(spec is cls)
        if dataclasses.is_dataclass(spec):
            return sum(count(getattr(spec, f.name), cls) for f in dataclasses.fields(spec))
        if isinstance(spec, list | tuple):
            return sum(count(s, cls) for s in spec)
        return 0

    hybrid = dsap.with_dsa_precision(hybrid_stack_spec)
    assert count(hybrid_stack_spec, DSAttention) > 0 and count(hybrid_stack_spec, DSAIndexer) > 0
    assert count(hybrid, DSAttention) == 0 and count(hybrid, DSAIndexer) == 0
    assert count(hybrid, dsap.PrecisionDSAttention) == count(hybrid_stack_spec, DSAttention)
    assert count(hybrid, dsap.PrecisionDSAIndexer) == count(hybrid_stack_spec, DSAIndexer)


def test_gpt_block_spec_without_te(megatron_parallel):
    block = dsap.get_gpt_dsa_precision_block_spec(make_config(num_layers=2))
    assert len(block.layer_specs) == 2
    attn = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert attn.module is dsap.PrecisionDSAttention


# ----------------------------------------------------------------------------------- modules


def _attention(config, cls=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    spec = dsap.get_dsa_precision_module_spec(
        config, LocalDSASpecProvider()
    ).submodules.core_attention
    if cls is not None:  # stock Megatron: the upstream spec
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_dsa_module_spec_for_backend,
        )

        spec = get_dsa_module_spec_for_backend(
            config, LocalDSASpecProvider()
        ).submodules.core_attention
    torch.manual_seed(1)
    attn = build_module(
        spec,
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
    )
    with torch.no_grad():
        attn.indexer.k_norm.weight.normal_(1.0, 0.2)
        attn.indexer.k_norm.bias.normal_(0.0, 0.2)
    return attn


def _inputs(sq=16, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = KV_LORA + ROPE
    return dict(
        query=torch.randn(sq, b, HEADS, d, generator=g).to(torch.bfloat16).requires_grad_(),
        key=torch.randn(sq, b, 1, d, generator=g).to(torch.bfloat16).requires_grad_(),
        x=torch.randn(sq, b, HIDDEN, generator=g).to(torch.bfloat16),
        qr=torch.randn(sq, b, Q_LORA, generator=g).to(torch.bfloat16),
        up_v_weight=torch.randn(HEADS, V_DIM, KV_LORA, generator=g).to(torch.bfloat16),
    )


def _run(attn, inputs, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    return attn(
        inputs["query"], inputs["key"], None, None, inputs["x"], inputs["qr"],
        attn_mask_type=AttnMaskType.causal, up_v_weight=inputs["up_v_weight"], **kw,
    )  # fmt: skip


def test_indexer_keeps_parameter_names(seams_installed, cpu_rotary):
    attn = _attention(make_config())
    stock = _attention(make_config(), cls=True)
    assert list(attn.state_dict()) == list(stock.state_dict())
    assert list(attn.indexer.state_dict()) == list(stock.indexer.state_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_indexer_outputs_per_configuration(seams_installed, cpu_rotary, name):
    config = make_config(**CONFIGS[name])
    attn = _attention(config)
    stock = _attention(make_config(), cls=True)
    stock.load_state_dict(attn.state_dict())
    inp = _inputs()
    with torch.no_grad():
        q, k, w = attn.indexer.forward_before_topk(inp["x"], inp["qr"])
        q0, k0, w0 = stock.indexer.forward_before_topk(inp["x"], inp["qr"])
    want = torch.float32 if config.dsa_indexer_rope_fp32 else torch.bfloat16
    assert q.dtype == k.dtype == want
    assert w.dtype == (
        torch.float32 if config.dsa_indexer_scoring_precision == "fp8" else torch.bfloat16
    )
    if name == "baseline":
        assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(w, w0)
    else:
        assert (q.float() - q0.float()).abs().max() < 0.1 * q0.float().abs().max()
    if config.dsa_indexer_scoring_precision == "fp8":
        raw, _ = attn.indexer.linear_weights_proj(inp["x"])
        assert torch.equal(w, (raw.float() * 128**-0.5) * 32**-0.5)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("path", ["fused", "split", "chunked", "thd"])
def test_every_scoring_call_reaches_the_configured_precision(fake, monkeypatch, name, path):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels

    overrides = dict(CONFIGS[name])
    if path != "fused":
        overrides["dsa_indexer_topk_freq"] = 2  # top-k sharing: Megatron takes its split path
    if path == "chunked":
        monkeypatch.setattr(dsa_cudnn_kernels, "_INDEXER_SCORE_CHUNK_MAX_BYTES", 2 * 16 * 4 * 5)
        monkeypatch.setattr(dsa_cudnn_kernels, "_INDEXER_SCORE_CHUNK_ROW_ALIGNMENT", 1)
    config = make_config(**overrides)
    attn = _attention(config)
    kw = {}
    inp = _inputs()
    if path == "thd":
        inp = _inputs(sq=16, b=1)
        inp = {k: v.view(16, *v.shape[2:]) if k in ("query", "key") else v for k, v in inp.items()}
        inp["query"] = inp["query"].detach().requires_grad_()
        inp["key"] = inp["key"].detach().requires_grad_()
        cu = torch.tensor([0, 6, 16], dtype=torch.int32)
        kw["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10
        )
    reset_scoring_calls()
    fake.forward_calls.clear()
    out = _run(attn, inp, **kw)
    out.float().sum().backward()
    precision = config.dsa_indexer_scoring_precision
    if name == "baseline":
        # Default configuration: Megatron's own code runs, counted but not re-rounded.
        assert scoring_calls() >= 1 and scoring_calls("bf16") == scoring_calls()
        assert all(c["precision"] == "bf16" for c in fake.forward_calls)
        return
    calls = scoring_calls()
    assert calls >= 1 and scoring_calls(precision) == calls, (path, calls)
    assert scoring_calls(site="fused" if path == "fused" else "split") == calls
    if path == "chunked":
        assert calls >= 2
    want_dtype = torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16
    for call in fake.forward_calls:
        assert call["precision"] == precision and call["q_dtype"] == want_dtype
    assert inp["query"].grad is not None and torch.isfinite(inp["query"].grad.float()).all()


def test_default_configuration_is_bit_identical_to_stock(seams_installed, cpu_rotary):
    """Backend 'none' (the only one stock Megatron runs here): same outputs and gradients."""
    config = make_config(dsa_kernel_backend="none")
    ours = _attention(config)
    stock = _attention(config, cls=True)
    stock.load_state_dict(ours.state_dict())
    assert type(stock).__name__ == "DSAttention"
    a, b = _inputs(), _inputs()
    out_a, out_b = _run(ours, a), _run(stock, b)
    assert torch.equal(out_a, out_b)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    assert torch.equal(a["query"].grad, b["query"].grad) and torch.equal(
        a["key"].grad, b["key"].grad
    )


@pytest.mark.parametrize("path", ["fused", "split"])
def test_strict_mode_raises_on_a_mismatch_and_on_a_bypass(fake, monkeypatch, path):
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels

    from dsa_precision.audit import PrecisionMismatchError

    monkeypatch.setenv("DSA_PRECISION_STRICT", "1")
    overrides = dict(CONFIGS["fp8"])
    if path == "split":
        overrides["dsa_indexer_topk_freq"] = 2
    attn = _attention(make_config(**overrides))
    _run(attn, _inputs())  # the configured path passes
    # A seam that scores in the wrong precision is caught at its first call.
    with monkeypatch.context() as mp:
        mp.setattr(seams, "_routing", lambda: IndexerPrecisionConfig(rope_fp32=True))
        with pytest.raises(PrecisionMismatchError, match=r"ran in bf16 .* but fp8 is configured"):
            _run(attn, _inputs())
    if path == "split":
        # A Megatron path outside the seams (here: the global-rows scorer restored) is caught
        # because the layer selected top-k without a counted scoring call.
        monkeypatch.setattr(
            dsa_cudnn_kernels,
            "_compute_indexer_scores_chunk_with_global_rows",
            seams._ORIGINALS["global_rows"],
        )
        with pytest.raises(PrecisionMismatchError, match="without a scoring call"):
            _run(attn, _inputs())


def test_rope_fp32_on_the_pytorch_backend_scores_bf16_operands(seams_installed, cpu_rotary):
    """Backend 'none': Megatron's naive scoring sees BF16-rounded carriers, never FP32."""
    config = make_config(dsa_kernel_backend="none", dsa_indexer_rope_fp32=True)
    attn = _attention(config)
    reset_scoring_calls()
    _run(attn, _inputs())
    assert scoring_calls("bf16", "megatron") == 1 and scoring_calls() == 1


def test_precision_attention_needs_install(megatron_parallel, cpu_rotary):
    dsap.uninstall()
    with pytest.raises(RuntimeError, match=r"dsa_precision.megatron.install\(\)"):
        _attention(make_config())


def test_seams_check_version_and_signatures(megatron_parallel, monkeypatch):
    import megatron.core
    from megatron.core.transformer.experimental_attention_variant import dsa

    dsap.uninstall()
    monkeypatch.setattr(megatron.core, "__version__", "0.21.0")
    with pytest.raises(RuntimeError, match=r"supports megatron-core 0\.19\.x; found 0\.21\.0"):
        dsap.install()
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2")
    monkeypatch.setattr(dsa, "_compute_index_scores", lambda q, k: None)
    with pytest.raises(RuntimeError, match="seam naive_scores"):
        dsap.install()
    assert not dsap.installed()


def test_proxy_routes_indexer_forward_wrapper(fake):
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels

    q, k = torch.randn(1, 8, 32, 128), torch.randn(1, 8, 1, 128)
    w = torch.randn(1, 8, 32).to(torch.bfloat16)
    proxy = dsa_cudnn_kernels._cudnn_dsa
    with seams.precision_scope(IndexerPrecisionConfig(scoring_precision="fp8")):
        proxy.indexer_forward_wrapper(q, k, w, ratio=1, sm_scale=1.0)
        with pytest.raises(NotImplementedError, match="stream"):
            proxy.indexer_forward_wrapper(q, k, w, ratio=1, stream=None)
    assert fake.forward_calls[-1]["precision"] == "fp8"
    proxy.indexer_forward_wrapper(q.to(torch.bfloat16), k.to(torch.bfloat16), w, ratio=1)
    assert fake.forward_calls[-1]["precision"] == "bf16"  # outside a scope: pass-through
