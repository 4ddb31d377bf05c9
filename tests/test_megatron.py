"""The Megatron integration on the CPU (megatron-core 0.19, local non-TE specs, torch backend).

What is checked against what:
- defaults: outputs and gradients of the drop-ins against stock Megatron modules, bit for bit;
- nothing of megatron-core is replaced: every attribute of its DSA modules before and after;
- the owned FP8 top-k: against :func:`dsa_precision.indexer_select` on the layer's own operands,
  and the attention that consumes it against a stock Megatron layer handed the same indices;
- config validation and flags: the error names the field, the value and the fix.
The cuDNN kernels run in the ``gpu`` tests (tests/gpu/test_megatron_gpu.py).
"""

import argparse
import dataclasses
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

import dsa_precision.megatron as dsap
from dsa_precision import IndexerPrecisionConfig, indexer_select, reset_scoring_calls, scoring_calls
from dsa_precision.audit import PrecisionMismatchError
from dsa_precision.megatron import compat

from .megatron_utils import (
    CONFIGS,
    HEADS,
    HIDDEN,
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)

pytestmark = pytest.mark.usefixtures("megatron_parallel", "cpu_rotary")


# ------------------------------------------------------------------------------------ config


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


# ------------------------------------------------------------------- megatron stays untouched


def _snapshot() -> dict[str, object]:
    """Every attribute of megatron-core's DSA modules and classes, by identity."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.experimental_attention_variant import (
        dsa,
        dsa_cudnn_kernels,
        dsa_kernels,
        dsa_layout,
        dsa_masking,
    )

    out = {}
    for module in (dsa, dsa_cudnn_kernels, dsa_kernels, dsa_layout, dsa_masking, rope_utils):
        for name, value in vars(module).items():
            out[f"{module.__name__}.{name}"] = value
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attr, member in vars(value).items():
                    out[f"{module.__name__}.{name}.{attr}"] = member
    return out


def test_building_and_running_the_drop_ins_changes_no_megatron_attribute():
    before = _snapshot()
    for name, fields in CONFIGS.items():
        config = make_config(**fields, dsa_indexer_topk_freq=2, num_layers=2)
        first, second = make_attention(config), make_attention(config, layer_number=2)
        inputs = attention_inputs()
        first_out = run_attention(first, inputs)
        first_out.float().sum().backward()
        run_attention(second, attention_inputs())
        assert torch.isfinite(first_out.float()).all(), name
    after = _snapshot()
    changed = [k for k in before if after.get(k) is not before[k]]
    assert not changed and set(after) == set(before), changed


# ----------------------------------------------------------------------------------- indexer


def test_indexer_keeps_parameter_names():
    ours, stock = make_attention(make_config()), make_attention(make_config(), stock=True)
    assert list(ours.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_before_topk_per_configuration(name):
    config = make_config(**CONFIGS[name])
    ours = make_attention(config).indexer
    stock = make_attention(make_config(), stock=True).indexer
    stock.load_state_dict(ours.state_dict())
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    with torch.no_grad():
        q, k, w = ours.forward_before_topk(x, qr)
        q0, k0, w0 = stock.forward_before_topk(x, qr)
    precision = config.dsa_indexer_precision
    if not precision.rope_fp32:  # Megatron's own preprocessing, whatever the scoring
        assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(w, w0)
        return
    carrier = torch.float32 if precision.fp8 else torch.bfloat16
    assert q.dtype == k.dtype == carrier
    pre = ours.preprocess()
    qp, _ = ours.linear_wq_b(qr)
    kp, _ = ours.linear_wk(x)
    freqs = ours.rotary_pos_emb(x.size(0))
    q32, k32 = pre(qp.view(*q.shape), kp, freqs)
    assert torch.equal(q, q32.to(carrier)) and torch.equal(k, k32.to(carrier))
    assert not torch.equal(q.to(torch.bfloat16), q0)  # FP32 preprocessing changes the bits
    raw, _ = ours.linear_weights_proj(x)
    if precision.fp8:  # the engine's FP32 order
        assert w.dtype == torch.float32 and torch.equal(w, (raw.float() * 128**-0.5) * 32**-0.5)
    else:
        assert torch.equal(w, w0)


def test_fp32_weights_engine_folds_the_float32_weights_projection():
    """sglang-unfused's weights GEMM outputs FP32: the folded FP8 weights come from the float32
    product of linear_weights_proj, not from its BF16 output."""
    from dsa_precision.prepare import fold_head_weights

    config = make_config(
        dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine="sglang-unfused", dsa_indexer_rotate_activation=True,
    )  # fmt: skip
    indexer = make_attention(config).indexer
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    ops = indexer.scoring_operands(x, qr)
    engine = config.dsa_indexer_precision.engine
    assert engine.weights_dtype == "fp32"
    w32 = torch.nn.functional.linear(x.float(), indexer.linear_weights_proj.weight.float())
    bf16, _ = indexer.linear_weights_proj(x)
    fold = dict(n_heads=32, head_dim=128)
    want = fold_head_weights(w32.transpose(0, 1), ops.q_descale, engine.weights_fold, **fold)
    assert torch.equal(ops.weights, want)
    from_bf16 = fold_head_weights(bf16.transpose(0, 1), ops.q_descale, engine.weights_fold, **fold)
    assert not torch.equal(ops.weights, from_bf16)


def test_indexer_follows_megatrons_preprocessing_fields_per_call():
    """Megatron reads dsa_indexer_rotate_activation per forward (Megatron's own test
    test_dsa_indexer_rotate_activation_follows_config); so does the drop-in, on its one
    preprocessing module, rebuilt only when such a field changed (vllm-exact: the profile that
    serves either rotation setting)."""
    config = make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-exact")
    indexer = make_attention(config).indexer
    built = indexer.preprocess()
    assert indexer.preprocess() is built  # decided once: the forward builds nothing
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    with torch.no_grad():
        plain = indexer.forward_before_topk(x, qr)
        config.dsa_indexer_rotate_activation = True
        rotated = indexer.forward_before_topk(x, qr)
    assert indexer.preprocess() is not built and indexer.preprocess().rotate_activation
    assert not torch.equal(plain[0], rotated[0])


def test_fp8_forward_with_scores_is_fp8_whoever_calls_it():
    config = make_config(dsa_indexer_scoring_precision="fp8")
    indexer = make_attention(config).indexer
    inp = attention_inputs()
    mask = torch.triu(torch.full((16, 16), float("-inf")), diagonal=1)
    reset_scoring_calls()
    scores, topk = indexer.forward_with_scores(inp["x"], inp["qr"], mask)
    assert scoring_calls("fp8") == 1 and scoring_calls() == 1
    ops = indexer.scoring_operands(inp["x"], inp["qr"])
    assert torch.equal(topk, indexer_select(ops, topk=8))  # the mask is Megatron's causal one
    assert torch.equal(torch.isinf(scores[0]), torch.isinf(mask))


# ---------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("share", [False, True], ids=["own", "index_share"])
def test_default_configuration_is_bit_identical_to_stock(packed, share):
    extra = dict(dsa_indexer_topk_freq=2, num_layers=2) if share else {}
    ours_cfg = make_config(**extra)
    stock_cfg = make_config(**extra)
    ours = [make_attention(ours_cfg, layer_number=n) for n in (1, 2)]
    stock = [make_attention(stock_cfg, stock=True, layer_number=n) for n in (1, 2)]
    for a, b in zip(ours, stock, strict=True):
        b.load_state_dict(a.state_dict())
    kw = {}
    if packed:
        kw_a, kw_b = dict(packed_seq_params=packed_params([0, 5, 16])), {}
        kw_b["packed_seq_params"] = packed_params([0, 5, 16])
    else:
        kw_a = kw_b = kw
    a_in = [attention_inputs(b=1 if packed else 2, packed=packed) for _ in range(2)]
    b_in = [attention_inputs(b=1 if packed else 2, packed=packed) for _ in range(2)]
    for layers, inputs, kwargs in ((ours, a_in, kw_a), (stock, b_in, kw_b)):
        outs = [
            run_attention(layer, inp, **kwargs) for layer, inp in zip(layers, inputs, strict=True)
        ]
        sum(o.float().sum() for o in outs).backward()
        inputs.append(outs)
    for a, b in zip(a_in[2], b_in[2], strict=True):
        assert torch.equal(a, b)
    for i in range(2):
        assert torch.equal(a_in[i]["query"].grad, b_in[i]["query"].grad)
        assert torch.equal(a_in[i]["key"].grad, b_in[i]["key"].grad)


@pytest.mark.parametrize("rope_fp32", [False, True], ids=["fp8", "rope_fp32+fp8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fp8_top_k_is_the_package_selection_of_the_layer_operands(rope_fp32, batch):
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_rope_fp32=rope_fp32)
    attn = make_attention(config)
    inp = attention_inputs(b=batch)
    reset_scoring_calls()
    topk = attn.compute_topk(inp["query"], inp["x"], inp["qr"], None)
    assert scoring_calls("fp8") >= 1 and scoring_calls("bf16") == 0
    ops = attn.indexer.scoring_operands(inp["x"], inp["qr"])
    assert ops.q.dtype == torch.float8_e4m3fn
    assert torch.equal(topk, indexer_select(ops, topk=8))


def test_fp8_packed_top_k_has_global_packed_key_rows():
    from dsa_precision import indexer_select_varlen

    config = make_config(dsa_indexer_scoring_precision="fp8")
    attn = make_attention(config)
    inp = attention_inputs(b=1, packed=True)
    cu = [0, 3, 9, 16]
    topk = attn.compute_topk(inp["query"], inp["x"], inp["qr"], packed_params(cu))
    ops = attn.indexer.scoring_operands(inp["x"], inp["qr"], packed_params(cu))
    t = torch.tensor(cu, dtype=torch.int32)
    local = indexer_select_varlen(
        ops, topk=8, cu_seqlens_q=t, cu_seqlens_k=t, max_seqlen_q=7, max_seqlen_k=7
    )
    starts = torch.repeat_interleave(t[:-1], t[1:] - t[:-1])
    want = torch.where(local >= 0, local + starts[:, None], local)
    assert topk.shape == (1, 16, 8) and torch.equal(topk[0], want)


def test_fp8_attention_is_megatrons_attention_on_the_owned_indices():
    """A stock Megatron skip layer handed the owned indices through its index-share holder
    produces the same output and gradients as the FP8 layer."""
    config = make_config(dsa_indexer_scoring_precision="fp8")
    ours = make_attention(config)
    stock_cfg = make_config(make_config().__class__.__mro__[1], dsa_indexer_topk_freq=2)
    reader = make_attention(stock_cfg, stock=True, layer_number=2)
    a, b = attention_inputs(), attention_inputs()
    topk = ours.compute_topk(a["query"], a["x"], a["qr"], None)
    reader._get_index_share_topk_holder(None, None)[1] = topk
    out_a, out_b = run_attention(ours, a), run_attention(reader, b)
    assert torch.equal(out_a, out_b)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    assert torch.equal(a["query"].grad, b["query"].grad)


def test_fp8_index_sharing_hands_the_owned_indices_to_the_next_layer():
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_freq=2, num_layers=2)
    first, second = make_attention(config), make_attention(config, layer_number=2)
    assert first.owns_topk() and not second.owns_topk() and second.indexer is None
    inp = attention_inputs()
    run_attention(first, inp)
    holder = second._get_index_share_topk_holder(None, None)
    assert torch.equal(holder[1], first.compute_topk(inp["query"], inp["x"], inp["qr"], None))
    assert torch.isfinite(run_attention(second, attention_inputs()).float()).all()
    assert not first.skip_topk and first.index_share  # the reader state is restored


def test_attention_needs_the_precision_indexer():
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    config = make_config()
    spec = get_dsa_module_spec_for_backend(config, backend=dsap.LocalDSASpecProvider())
    core = dataclasses.replace(spec.submodules.core_attention, module=dsap.PrecisionDSAttention)
    with pytest.raises(TypeError, match="needs a PrecisionDSAIndexer, got DSAIndexer"):
        build_module(
            core, config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
            attention_type="self",
        )  # fmt: skip


def test_strict_mode_catches_a_scoring_call_in_another_precision(monkeypatch):
    monkeypatch.setenv("DSA_PRECISION_STRICT", "1")
    config = make_config(dsa_indexer_scoring_precision="fp8")
    attn = make_attention(config)
    run_attention(attn, attention_inputs())  # the configured path passes
    bf16 = IndexerPrecisionConfig()
    # A defect that prepares BF16 operands for an FP8 layer is caught at its scoring call.
    monkeypatch.setattr(attn.indexer, "_precision", bf16)
    with pytest.raises(PrecisionMismatchError, match=r"ran in bf16 .* but fp8 is configured"):
        run_attention(attn, attention_inputs())


# ------------------------------------------------------------------------------------- specs


def test_spec_swap_replaces_only_the_dsa_modules():
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention

    config = make_config()
    upstream = get_dsa_module_spec_for_backend(config, dsap.LocalDSASpecProvider())
    swapped = dsap.get_dsa_precision_module_spec(config, dsap.LocalDSASpecProvider())
    core = swapped.submodules.core_attention
    assert core.module is dsap.PrecisionDSAttention
    assert core.submodules.indexer.module is dsap.PrecisionDSAIndexer
    assert upstream.submodules.core_attention.module is DSAttention  # input untouched

    def count(spec, cls) -> int:
        if isinstance(spec, type):
            return int(spec is cls)
        if dataclasses.is_dataclass(spec):
            return sum(count(getattr(spec, f.name), cls) for f in dataclasses.fields(spec))
        if isinstance(spec, list | tuple):
            return sum(count(s, cls) for s in spec)
        return 0

    hybrid = dsap.with_dsa_precision(hybrid_stack_spec)
    assert count(hybrid_stack_spec, DSAttention) > 0 and count(hybrid, DSAttention) == 0
    assert count(hybrid, dsap.PrecisionDSAttention) == count(hybrid_stack_spec, DSAttention)
    assert count(hybrid, dsap.PrecisionDSAIndexer) == count(hybrid_stack_spec, DSAIndexer)


_SWITCHED_ON = {
    "dsa_indexer_rope_fp32=True": dict(dsa_indexer_rope_fp32=True),
    "dsa_indexer_scoring_precision='fp8'": dict(dsa_indexer_scoring_precision="fp8"),
    "dsa_indexer_topk_source='verify'": dict(dsa_indexer_topk_source="verify"),
    "dsa_indexer_topk_source='replay'": dict(dsa_indexer_topk_source="replay"),
}


@pytest.mark.parametrize("field", list(_SWITCHED_ON))
def test_block_spec_without_dsa_layers_refuses_a_switched_on_field(field):
    """Megatron's block builder makes no DSA layer unless experimental_attention_variant='dsa':
    a switched-on field would act on nothing, and the spec builder says so."""
    config = make_config(num_layers=2, experimental_attention_variant=None, **_SWITCHED_ON[field])
    with pytest.raises(
        ValueError,
        match=rf"get_gpt_dsa_precision_block_spec: {field} acts on DSA layers.*"
        r"experimental_attention_variant=None\); set experimental_attention_variant='dsa'",
    ):
        dsap.get_gpt_dsa_precision_block_spec(config)


def test_swap_of_a_spec_without_dsa_refuses_a_switched_on_field():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    plain = get_gpt_layer_local_spec()
    rope = make_config(dsa_indexer_rope_fp32=True)
    with pytest.raises(ValueError, match=r"with_dsa_precision: dsa_indexer_rope_fp32=True acts"):
        dsap.with_dsa_precision(plain, rope)
    # Default fields, or no config: nothing to refuse; a spec with DSA modules: swapped.
    kept = dsap.with_dsa_precision(plain, make_config())
    assert kept.submodules.self_attention.module is plain.submodules.self_attention.module
    dsa = eav_module_spec(make_config())
    swapped = dsap.with_dsa_precision(dsa, rope).submodules.core_attention
    assert swapped.module is dsap.PrecisionDSAttention


def eav_module_spec(config):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    return get_dsa_module_spec_for_backend(config, dsap.LocalDSASpecProvider())


def test_gpt_block_spec_without_te():
    block = dsap.get_gpt_dsa_precision_block_spec(make_config(num_layers=2))
    assert len(block.layer_specs) == 2
    attn = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert attn.module is dsap.PrecisionDSAttention


def test_import_fails_loudly_without_the_surface(monkeypatch):
    """A megatron-core without the DSA modules: one ImportError naming what to install."""
    from megatron.core.transformer import experimental_attention_variant as package

    monkeypatch.delattr(package, "dsa")
    monkeypatch.setitem(sys.modules, package.__name__ + ".dsa", None)
    with pytest.raises(ImportError, match=r"(?s)dsa.DSAIndexer is missing.*megatron-core==0\.19"):
        compat.check_megatron_core()


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
