"""ScoringOperands and how they are built (CPU): prepare_scoring_operands against the rounding and
the quantizer it promises (BF16 casts; E4M3 per-128-vector under the engine's rules, the q descale
and sm_scale folded into float32 weights bit for bit), the fused Triton kernel (in Triton's CPU
interpreter) against the torch reference, prepare_indexer_operands against preprocessing then
preparing, and when the fused kernel applies."""

import dataclasses
import os

import pytest
import torch

from dsa_precision import (
    ENGINE_PROFILES,
    IndexerPrecisionConfig,
    indexer_scores,
    prepare_indexer_operands,
    prepare_scoring_operands,
    quantize_e4m3_ue8m0,
    quantize_fp8,
)
from dsa_precision.config import ScoringPrecision
from dsa_precision.engines import DEFAULT_ENGINE
from dsa_precision.prepare import _as_scoring_operands, _engine_lanes, _kernel_rope_tables
from dsa_precision.preprocess import _indexer_head_weights
from dsa_precision.rope import rope_tables

from .support.configs import BF16, CPU, FP8
from .support.fused_cases import make_case
from .support.helpers import assert_bitwise_equal, indexer_projections, scoring_carriers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ BF16


@pytest.mark.parametrize("carrier", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "w_dtype, kept", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float32)]
)  # fmt: skip
def test_bf16_operands_are_the_rounded_carriers(carrier, w_dtype, kept):
    q, k, w = scoring_carriers(dtype=carrier, w_dtype=w_dtype)
    ops = prepare_scoring_operands(q, k.unsqueeze(2), w, config=BF16, sm_scale=0.7)
    assert ops.precision is ScoringPrecision.BF16 and ops.sm_scale == 0.7
    assert_bitwise_equal(ops.q, q.to(torch.bfloat16), "q")
    assert_bitwise_equal(ops.k, k.to(torch.bfloat16), "k (the 4-D key squeezed)")
    assert ops.weights.dtype == kept
    assert_bitwise_equal(ops.weights, w.to(kept), "weights")
    assert ops.q_descale is None and ops.k_descale is None
    assert all(t.is_contiguous() for t in (ops.q, ops.k, ops.weights))


def test_bf16_non_finite_query_vector_gets_a_nan_weight():
    q, k, w = scoring_carriers()
    q[1, 3, 7, 100] = float("inf")
    ops = prepare_scoring_operands(q, k, w, config=BF16)
    nan = torch.isnan(ops.weights)
    assert nan[1, 3, 7] and nan.sum() == 1  # only that (row, head)


# ------------------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("carrier", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sm_scale", [1.0, 0.3, 2.0**-3])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fp8_operands_quantize_and_fold_bit_for_bit(carrier, sm_scale, w_dtype):
    q, k, w = scoring_carriers(dtype=carrier, w_dtype=w_dtype)
    ops = prepare_scoring_operands(q, k, w, config=FP8, sm_scale=sm_scale)
    q8, qs = quantize_e4m3_ue8m0(q)  # the default engine: exact UE8M0, floor 1e-4
    k8, ks = quantize_e4m3_ue8m0(k)
    assert ops.precision is ScoringPrecision.FP8 and ops.sm_scale == 1.0
    assert_bitwise_equal(ops.q, q8, "q")
    assert_bitwise_equal(ops.k, k8, "k")
    assert_bitwise_equal(ops.q_descale, qs, "q descale (B, S_q, H)")
    assert_bitwise_equal(ops.k_descale, ks, "k descale (B, S_k)")
    # ((fp32(w) * q_descale) * sm_scale), sm_scale as a float32 scalar.
    assert_bitwise_equal(ops.weights, (w.float() * qs) * sm_scale, "folded weights")
    assert all(t.is_contiguous() for t in (ops.q, ops.k, ops.weights, ops.q_descale, ops.k_descale))


def test_fp8_non_finite_vector_becomes_nan_not_a_saturated_value():
    q, k, w = scoring_carriers()
    q[0, 1, 2, 3] = float("inf")
    k[1, 4, 5] = float("-inf")
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    assert torch.isnan(ops.q_descale[0, 1, 2]) and torch.isnan(ops.weights[0, 1, 2])
    assert torch.isnan(ops.k_descale[1, 4]) and torch.isnan(ops.k[1, 4].float()).all()
    assert torch.isfinite(ops.weights).sum() == ops.weights.numel() - 1


@pytest.mark.parametrize("name", sorted(ENGINE_PROFILES))
def test_every_engine_profile_builds_valid_operands(name):
    q, k, w = scoring_carriers(dtype=torch.float32)
    ops = prepare_scoring_operands(
        q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8", engine=name)
    )
    again = prepare_scoring_operands(
        q,
        k,
        w,
        config=IndexerPrecisionConfig(scoring_precision="fp8", engine=ENGINE_PROFILES[name]),
    )
    assert_bitwise_equal(ops.q, again.q, f"{name}: name and profile")
    for x, x8, s in ((q, ops.q, ops.q_descale), (k, ops.k, ops.k_descale)):
        assert (s > 0).all()
        back = x8.float() * s.unsqueeze(-1)
        # E4M3 keeps 3 mantissa bits: each value within 2**-4 of its vector's amax (or 2**-9
        # of it near zero, the subnormal step).
        err = (back - x).abs() / x.abs().amax(-1, keepdim=True)
        assert float(err.max()) <= 2.0**-4 + 1e-6, f"{name}: {float(err.max())}"
    scores = indexer_scores(ops, backend="torch")
    assert torch.isfinite(scores[:, :, :5].diagonal(dim1=1, dim2=2)).all()


def test_engine_profiles_really_differ():
    q, k, w = scoring_carriers(dtype=torch.float32)
    built = {
        name: prepare_scoring_operands(
            q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8", engine=name)
        )
        for name in ENGINE_PROFILES
    }
    distinct = {bytes(o.k_descale.numpy().tobytes()) for o in built.values()}
    assert len(distinct) > 1, "every engine profile quantizes k identically"
    assert_bitwise_equal(built[DEFAULT_ENGINE.name].k, quantize_e4m3_ue8m0(k)[0], "default")


def test_precisions_really_differ():
    q, k, w = scoring_carriers()
    bf16 = prepare_scoring_operands(q, k, w, config=BF16)
    fp8 = prepare_scoring_operands(q, k, w, config=FP8)
    assert bf16.q.dtype == torch.bfloat16 and fp8.q.dtype == torch.float8_e4m3fn
    err = (fp8.q.float() * fp8.q_descale.unsqueeze(-1) - bf16.q.float()).abs().max()
    assert err > 0


# ------------------------------------------------------------------ the operands themselves


def test_as_scoring_operands_passes_operands_through_and_prepares_carriers():
    q, k, w = scoring_carriers()
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    assert _as_scoring_operands(ops) is ops
    assert _as_scoring_operands(ops, config=FP8) is ops
    again = _as_scoring_operands(q, k, w, config=FP8)
    assert_bitwise_equal(again.weights, ops.weights, "carriers prepared")


# ------------------------------------------------------------------------- implementations


# -------------------------------------------------------------- from the projections


@pytest.mark.parametrize("rope_fp32", [False, True])
def test_indexer_operands_bf16_are_preprocess_then_rounding(rope_fp32):
    pre, q, k, w, freqs = indexer_projections(rope_fp32=rope_fp32)
    config = IndexerPrecisionConfig(rope_fp32=rope_fp32, scoring_precision="bf16")
    got = prepare_indexer_operands(pre, q, k, w, freqs, config=config, sm_scale=0.5, impl="torch")
    qq, kk = pre(q, k, freqs)
    ww = _indexer_head_weights(w, n_heads=32, head_dim=128, fp32=False)
    want = prepare_scoring_operands(
        qq.transpose(0, 1), kk.transpose(0, 1), ww.transpose(0, 1), config=BF16,
        sm_scale=0.5,
    )  # fmt: skip
    for name in ("q", "k", "weights"):
        assert_bitwise_equal(getattr(got, name), getattr(want, name), name)
    assert got.q.shape == (2, 6, 32, 128) and got.sm_scale == 0.5


def test_indexer_operands_fp8_quantize_the_preprocessed_vectors():
    pre, q, k, w, freqs = indexer_projections()
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8")
    q.requires_grad_(True)
    got = prepare_indexer_operands(pre, q, k, w, freqs, config=config, impl="torch")
    assert not got.weights.requires_grad  # FP8 scores carry no gradient
    auto = prepare_indexer_operands(pre, q, k, w, freqs, config=config, impl="auto")
    assert_bitwise_equal(auto.weights, got.weights, "auto on CPU is the reference")
    with torch.no_grad():
        qq, kk = pre(q, k, freqs)
    q8, qs = quantize_e4m3_ue8m0(qq.transpose(0, 1))
    k8, ks = quantize_e4m3_ue8m0(kk.transpose(0, 1))
    assert_bitwise_equal(got.q, q8, "q")
    assert_bitwise_equal(got.k, k8, "k")
    assert_bitwise_equal(got.q_descale, qs, "q descale")
    assert_bitwise_equal(got.k_descale, ks, "k descale")


def test_preprocess_and_config_must_agree():
    pre, q, k, w, freqs = indexer_projections(rope_fp32=False)
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8")
    with pytest.raises(ValueError, match="build the IndexerPreprocess from the same config"):
        prepare_indexer_operands(pre, q, k, w, freqs, config=config)


# ------------------------------------------------------------------- RoPE lane order (FP8)


def _interleaved(rope_fp32, hadamard=False, engine="sglang-fused"):
    """An interleaved-RoPE case (:func:`tests.fused_cases.make_case`) and its FP8 config."""
    case = make_case(
        seq=6, batch=1, rope_fp32=rope_fp32, hadamard=hadamard, interleaved=True,
        engine=ENGINE_PROFILES[engine], seed=8,
    )  # fmt: skip
    config = IndexerPrecisionConfig(
        rope_fp32=rope_fp32, scoring_precision="fp8", engine=ENGINE_PROFILES[engine]
    )
    return case.pre, case.q, case.k, case.w, case.freqs, config


# Megatron's rotate-half position of each lane of the checkpoint (pairs in place) order.
_PAIRS = torch.cat((torch.stack((torch.arange(32), torch.arange(32, 64)), -1).flatten(),
                    torch.arange(64, 128)))  # fmt: skip


@pytest.mark.parametrize("rope_fp32", [False, True])
def test_fp8_operands_keep_interleaved_rope_pairs_in_place(rope_fp32):
    """Megatron de-interleaves the RoPE lanes; the engines rotate each pair in place. FP8
    operands take the engines' lane order (the same values: Megatron's lane ``_PAIRS[j]`` at
    position ``j``), which Hopper's FP8 accumulation needs for the engines' logits."""
    pre, q, k, w, freqs, config = _interleaved(rope_fp32)
    got = prepare_indexer_operands(pre, q, k, w, freqs, config=config, impl="torch")
    with torch.no_grad():
        qq, kk = pre(q, k, freqs)  # Megatron's (rotate-half) lane order
    q8, _ = quantize_fp8(qq.transpose(0, 1), config.engine.q_quant)
    k8, _ = quantize_fp8(kk.transpose(0, 1), config.engine.k_quant)
    assert not torch.equal(q8.view(torch.uint8), got.q.view(torch.uint8))
    assert_bitwise_equal(got.q, q8[..., _PAIRS], "q in pair order")
    assert_bitwise_equal(got.k, k8[..., _PAIRS], "k in pair order")
    bf16 = prepare_indexer_operands(
        pre, q, k, w, freqs, config=dataclasses.replace(config, scoring_precision="bf16")
    )
    assert_bitwise_equal(bf16.q, qq.transpose(0, 1).to(torch.bfloat16), "bf16: Megatron's order")


def test_fp8_operands_are_the_demo_engine_models_lane_by_lane():
    """The demo's independent engine model (``cli/engine_model.py``) rotates pairs in place; with
    ``rope_fp32`` the package's FP8 operands are its operands bit for bit, lane by lane."""
    from dsa_precision.cli.demo_operands import IndexerFields, training_operands
    from dsa_precision.cli.engine_model import engine_operands
    from dsa_precision.cli.synthetic import synthetic_indexer_inputs

    # The model's arithmetic: float64 LayerNorm, no contraction (sglang-fused's lane order and
    # scales; its compiled LayerNorm and RoPE rules are checked against SGLang's own kernels).
    engine = dataclasses.replace(
        ENGINE_PROFILES["sglang-fused"], name="sglang-fused-uncontracted", layernorm="float64",
        fma=False,
    )  # fmt: skip
    inputs = synthetic_indexer_inputs(64, n_heads=32, head_dim=128, rope_dim=64, seed=3)
    ref = engine_operands(inputs, engine, hadamard=False, interleaved=True)
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine=engine)
    got = training_operands(inputs, config, IndexerFields(rope_interleaved=True))
    assert_bitwise_equal(got.q[0], ref.q, "q")
    assert_bitwise_equal(got.k[0], ref.k, "k")
    assert_bitwise_equal(got.k_descale[0], ref.k_descale, "k descale")
    assert_bitwise_equal(got.weights[0], ref.weights, "weights")


def test_with_the_hadamard_rotation_lanes_stay_in_megatrons_order():
    """After the rotation every lane mixes all of them: there are no pairs to put back."""
    pre, q, k, w, freqs, config = _interleaved(True, hadamard=True, engine="vllm-exact")
    got = prepare_indexer_operands(pre, q, k, w, freqs, config=config, impl="torch")
    with torch.no_grad():
        qq, _ = pre(q, k, freqs)
    q8, _ = quantize_fp8(qq.transpose(0, 1), config.engine.q_quant)
    assert_bitwise_equal(got.q, q8, "q")


def test_kernel_rope_tables_follow_their_angles():
    freqs = torch.rand(6, 1, 1, 64, generator=torch.Generator().manual_seed(1)) * 10

    def want(f, s, mscale, table, math):
        cos, sin = rope_tables(f[:s], mscale, table)
        return cos.to(math).reshape(s, -1), sin.to(math).reshape(s, -1)

    def same(got, expected):
        return all(torch.equal(a, e) for a, e in zip(got, expected, strict=True))

    args = (6, 1.1, torch.bfloat16, torch.float32)
    first = _kernel_rope_tables(freqs, *args)
    assert same(first, want(freqs, *args)) and first[0].is_contiguous()
    assert _kernel_rope_tables(freqs, *args) is first  # the same angles: remembered
    other = (4, 1.0, torch.float32, torch.float32)
    assert same(_kernel_rope_tables(freqs, *other), want(freqs, *other))  # other arguments
    freqs.add_(0.5)  # in place: recomputed
    assert same(_kernel_rope_tables(freqs, *args), want(freqs, *args))
    fresh = freqs.clone().mul_(0.3)  # another tensor
    assert same(_kernel_rope_tables(fresh, *args), want(fresh, *args))


@pytest.mark.parametrize("half, d", [(32, 128), (8, 16)])
def test_engine_lane_order_is_the_interleaved_pairs(half, d):
    pairs = [i for j in range(half) for i in (j, half + j)]
    assert _engine_lanes(half, d, CPU).tolist() == pairs + list(range(2 * half, d))
