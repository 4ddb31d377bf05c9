"""DSAPrecisionTransformerConfig and its flags: defaults keep Megatron's behaviour, and every bad value names the field, the value and the fix."""

import argparse
import dataclasses

import pytest
import torch

import dsa_precision.megatron as dsap
from dsa_precision import IndexerPrecisionConfig

from ..support.megatron import (
    CONFIGS,
    HEADS,
    HIDDEN,
    attention_inputs,
    make_attention,
    make_config,
    run_attention,
)


def test_field_defaults_keep_megatron_behaviour():
    """Built from the same fields, the drop-in config is the stock config: every Megatron field
    of a plain value (dsa_kernel_backend among them) is the stock one, and the precision is what
    the stock config reads as."""
    import enum

    ours = make_config()
    stock = make_config(type(ours).__mro__[1])
    plain = (int, float, str, bool, type(None), enum.Enum, tuple, list, torch.dtype)
    fields = [
        f.name for f in dataclasses.fields(stock) if isinstance(getattr(stock, f.name), plain)
    ]
    assert "dsa_kernel_backend" in fields and len(fields) > 100
    changed = [n for n in fields if getattr(ours, n) != getattr(stock, n)]
    assert not changed, changed
    assert ours.dsa_indexer_precision == IndexerPrecisionConfig.from_megatron_config(stock)


def test_fp8_leaves_megatron_fields_alone():
    config = make_config(dsa_indexer_scoring_precision="fp8")
    assert config.dsa_kernel_backend == "none" and config.dsa_indexer_precision.fp8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dsa_indexer_loss_coeff=0.1), r"dsa_indexer_loss_coeff=0\.1: .*Set it to 0"),
        (dict(dsa_indexer_scoring_relu=False), r"dsa_indexer_scoring_relu=False: .*=True"),
        (dict(dsa_indexer_n_heads=16), r"dsa_indexer_n_heads=16: .*\(32, 64\)"),
        (dict(dsa_indexer_head_dim=64), r"dsa_indexer_head_dim=64: .*set it to 128"),
    ],
)
def test_fp8_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(dsa_indexer_scoring_precision="fp8", **overrides)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as err:
        make_config(
            dsa_indexer_scoring_precision="fp8", dsa_indexer_loss_coeff=0.5, dsa_indexer_n_heads=8
        )
    assert "dsa_indexer_loss_coeff=0.5" in str(err.value) and "dsa_indexer_n_heads=8" in str(
        err.value
    )


@pytest.mark.parametrize("name", ["rope_fp32", "fp8"])
def test_directly_built_dsa_modules_take_the_fields_whatever_the_variant_says(name):
    """Megatron's own tests build DSA modules from configs with experimental_attention_variant=None:
    the config accepts the fields, and the module computes exactly as with the variant 'dsa'."""
    inputs = attention_inputs()
    outputs = []
    for variant in (None, "dsa"):
        config = make_config(experimental_attention_variant=variant, **CONFIGS[name])
        assert config.dsa_indexer_precision == IndexerPrecisionConfig(**_precision_of(name))
        outputs.append(run_attention(make_attention(config), inputs).detach())
    assert torch.equal(outputs[0], outputs[1])


def _precision_of(name: str) -> dict:
    return {"rope_fp32": dict(rope_fp32=True), "fp8": dict(scoring_precision="fp8")}[name]


def test_engine_field_is_validated():
    with pytest.raises(ValueError, match=r"dsa_indexer_engine='tgi' is not an engine profile"):
        make_config(dsa_indexer_engine="tgi")


def test_engine_field_takes_a_profile_object():
    """A profile built for one engine (vLLM 0.28 compiled for 8,192 tokens, XBLOCK 32 kept)
    reaches the layer's precision as given, not by name."""
    from dsa_precision import vllm_legacy_profile

    profile = vllm_legacy_profile(compiled_tokens=8192, sm_count=132, xblock=32)
    config = make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine=profile)
    assert config.dsa_indexer_precision.engine is profile
    assert config.dsa_indexer_precision.engine.layernorm == "fp32-inductor-x8"


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_precision='int8'.*'bf16', 'fp8'"):
        make_config(dsa_indexer_scoring_precision="int8")
    with pytest.raises(TypeError, match="dsa_indexer_rope_fp32 must be a bool"):
        make_config(dsa_indexer_rope_fp32="yes")


def test_cli_flags_round_trip_into_the_config(monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(
        "sys.argv",
        ["train.py", "--num-layers", "1", "--hidden-size", str(HIDDEN), "--num-attention-heads",
         str(HEADS), "--seq-length", "64", "--max-position-embeddings", "64",
         "--dsa-indexer-rope-fp32", "--dsa-indexer-scoring-precision", "fp8",
         "--dsa-indexer-engine", "vllm"],
    )  # fmt: skip
    args = parse_args(extra_args_provider=dsap.add_dsa_precision_args)
    assert args.dsa_indexer_rope_fp32 is True and args.dsa_indexer_scoring_precision == "fp8"
    assert args.dsa_indexer_engine == "vllm"
    parser = dsap.add_dsa_precision_args(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    assert defaults.dsa_indexer_scoring_precision == "bf16" and not defaults.dsa_indexer_rope_fp32
    for bad in (["--dsa-indexer-scoring-precision", "int8"], ["--dsa-indexer-engine", "tgi"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    base = make_config()
    monkeypatch.setattr(
        "megatron.training.argument_utils.core_transformer_config_from_args", lambda a: base
    )
    config = dsap.config_from_args(args)
    assert isinstance(config, dsap.DSAPrecisionTransformerConfig)
    assert config.dsa_indexer_precision == IndexerPrecisionConfig(True, "fp8", "vllm")
    assert config.hidden_size == HIDDEN


def test_the_engines_k_norm_epsilon_is_checked_where_the_config_is_built():
    """vLLM hard-codes the indexer k_norm eps 1e-6; with rope_fp32 a model of Megatron's default
    1e-5 is refused by the config itself (naming both values), and so is a later assignment."""
    with pytest.raises(ValueError, match=r"epsilon 1e-06.*eps=1e-05"):
        make_config(dsa_indexer_rope_fp32=True, layernorm_epsilon=1e-5)
    config = make_config(dsa_indexer_rope_fp32=True)  # megatron_utils: 1e-6
    with pytest.raises(ValueError, match=r"layernorm_epsilon=1e-05 rejected"):
        config.layernorm_epsilon = 1e-5
    assert config.layernorm_epsilon == 1e-6
    make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-exact", layernorm_epsilon=1e-5)
    make_config(layernorm_epsilon=1e-5)  # Megatron's behaviour: nothing of ours runs


def test_the_scoring_backend_is_decided_once_per_layer_and_reported(monkeypatch):
    """``dsa_indexer_scoring_backend``: "auto" resolves at the layer's first owned top-k and is
    passed explicitly afterwards (the layer never changes kernels); a pinned one that cannot run
    raises; DeepGEMM with BF16 scoring is refused at the config."""
    from ..support import fake_deepgemm
    from ..support.megatron import attention_inputs, make_attention, run_attention

    fp8 = dict(dsa_indexer_scoring_precision="fp8")
    attn = make_attention(make_config(**fp8))
    assert attn.scoring_backend is None
    run_attention(attn, attention_inputs())
    assert attn.scoring_backend == "torch"  # the CPU: neither DeepGEMM nor cuDNN serves it
    fake_deepgemm.install(monkeypatch, fake_deepgemm.FakeMqaLogits())
    run_attention(attn, attention_inputs())
    assert attn.scoring_backend == "torch"  # decided once: a later install changes nothing
    fresh = make_attention(make_config(**fp8))
    run_attention(fresh, attention_inputs())
    assert fresh.scoring_backend == "deepgemm"  # auto takes the engines' kernel where it serves
    pinned_config = make_config(**fp8, dsa_indexer_scoring_backend="cudnn")
    assert pinned_config.dsa_indexer_precision.scoring_backend == "cudnn"  # the precision's
    pinned = make_attention(pinned_config)
    with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot score this call"):
        run_attention(pinned, attention_inputs())
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_backend='deepgemm': DeepGEMM's MQA"):
        make_config(dsa_indexer_scoring_backend="deepgemm")
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_backend='tpu' is not a scoring"):
        make_config(dsa_indexer_scoring_backend="tpu")


def test_the_k_norm_epsilon_is_the_one_megatron_builds_the_k_norm_with():
    """megatron-core 0.19.2 builds the indexer's k_norm with dsa_indexer_k_norm_epsilon when it
    is set (layernorm_epsilon otherwise): Megatron's own DSA test pattern (1e-5 model-wide, 1e-6
    for the indexer) is accepted, the reverse refused where the config is built, naming the
    field the epsilon came from and the one to set."""
    rope = dict(dsa_indexer_rope_fp32=True)
    config = make_config(**rope, layernorm_epsilon=1e-5, dsa_indexer_k_norm_epsilon=1e-6)
    assert make_attention(config).indexer.k_norm.eps == 1e-6  # and the layer builds
    with pytest.raises(ValueError) as info:
        make_config(**rope, layernorm_epsilon=1e-6, dsa_indexer_k_norm_epsilon=1e-5)
    msg = str(info.value)
    assert "eps=1e-05 (from dsa_indexer_k_norm_epsilon)" in msg
    assert "set dsa_indexer_k_norm_epsilon=1e-06" in msg and "layernorm_epsilon" not in msg
    with pytest.raises(ValueError, match=r"eps=1e-05 \(from layernorm_epsilon\); set "
                       r"dsa_indexer_k_norm_epsilon=1e-06"):  # fmt: skip
        make_config(**rope, layernorm_epsilon=1e-5)
    with pytest.raises(ValueError, match=r"dsa_indexer_k_norm_epsilon=1e-05 rejected"):
        config.dsa_indexer_k_norm_epsilon = 1e-5
    assert config.dsa_indexer_k_norm_epsilon == 1e-6


def test_params_dtype_must_be_the_engines_checkpoint_dtype():
    """The engines serve BF16 checkpoints (BF16 projection GEMMs, the k_norm's BF16 parameters):
    another params_dtype is refused by name with either switch; vllm-exact takes any."""
    for fields in (dict(dsa_indexer_rope_fp32=True), dict(dsa_indexer_scoring_precision="fp8")):
        with pytest.raises(ValueError, match=r"params_dtype=torch.float32: .*set "
                           r"params_dtype=torch.bfloat16"):  # fmt: skip
            make_config(**fields, params_dtype=torch.float32, bf16=False)
    make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-exact",
                params_dtype=torch.float32, bf16=False)  # fmt: skip
    make_config(params_dtype=torch.float32, bf16=False)  # Megatron's behaviour


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rotary_percent=0.5), r"rotary_percent=0.5: with dsa_indexer_rope_fp32 the engines "
         r"rotate all qk_pos_emb_head_dim lanes"),
        (dict(rotary_base=0), r"rotary_base=0: .*set rotary_base to a positive finite number"),
        (dict(rope_type="yarn", mscale=None), r"mscale=None: .*set mscale to a finite number"),
        (dict(rope_type="yarn", rotary_scaling_factor=-1.0),
         r"rotary_scaling_factor=-1.0: .*positive finite number"),
        (dict(rope_type="yarn", original_max_position_embeddings=0),
         r"original_max_position_embeddings=0: .*a positive integer"),
        # each value is one, but together they give no table (Megatron's YaRN fails on them)
        (dict(rope_type="yarn", beta_fast=0.0), r"beta_fast=0.0: .*a positive finite number"),
        (dict(rope_type="yarn", rotary_base=1.0),
         r"rotary_base=1.0, .*the engine's yarn tables are built from them, and they give none: "
         r"YaRN's correction range"),
        (dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale_all_dim=-10 / 3.6888794541139363),
         r"mscale_all_dim=.*give the magnitude scale"),
        (dict(rotary_base=1e-300), r"rotary_base=1e-300, .*gives float32 inverse frequencies"),
    ],
)  # fmt: skip
def test_rope_fields_the_engine_tables_cannot_honour_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        make_config(dsa_indexer_rope_fp32=True, **fields)
    make_config(**fields)  # Megatron's behaviour: nothing of ours runs


def test_every_problem_of_a_config_is_listed_at_once():
    with pytest.raises(ValueError) as info:
        make_config(
            dsa_indexer_rope_fp32=True, layernorm_epsilon=1e-5, params_dtype=torch.float32,
            bf16=False, rotary_percent=0.5,
        )  # fmt: skip
    msg = str(info.value)
    for field in ("layernorm_epsilon", "params_dtype=torch.float32", "rotary_percent=0.5"):
        assert field in msg, (field, msg)
    config = make_config(dsa_indexer_rope_fp32=True)
    with pytest.raises(ValueError, match=r"rotary_percent=0\.5 rejected"):
        config.rotary_percent = 0.5  # re-validated: a later layer would read it


def test_vllm_eager_describes_yarn_models_only():
    """vLLM's eager run keeps a float32 cache for YaRN models alone (flashinfer's); a plain-RoPE
    model's eager run (GLM-5's) is the 'vllm' profile: with rope_fp32, refused by name."""
    with pytest.raises(ValueError, match=r"dsa_indexer_engine='vllm-eager' is the engine's path "
                       r"for rope_type='yarn' models .* the model has rope_type='rope'"):  # fmt: skip
        make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-eager")
    make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-eager", rope_type="yarn")
    make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_engine="vllm-eager")
