"""The fused preprocess+quantize kernel, run by Triton's interpreter on the CPU, against the torch
reference: bit-identical E4M3 bytes, descales and folded weights, for every engine profile.

The interpreter evaluates float32/float64 arithmetic, float32/float64 division and square root
with IEEE rounding and no FMA contraction (numpy), integer bit manipulation exactly, and reshape /
split / join / reductions in program order, so it checks the kernel's arithmetic end to end. It
cannot check the compiled code generation (FMA contraction, flush-to-zero, the hardware float64
ops): ``tests/gpu/test_preprocess_quantize.py`` repeats these cases on the H200.
"""

import dataclasses

import pytest
import torch

from dsa_precision import ENGINE_PROFILES, IndexerPrecisionConfig
from dsa_precision.exact_math import _pairwise_sum
from dsa_precision.hadamard import hadamard_transform
from dsa_precision.prepare import prepare_scoring_operands
from dsa_precision.preprocess_kernel import _fused_unsupported_reason

from ..support import kernel_probes
from ..support.fused_cases import (
    PROFILES,
    assert_bit_identical,
    cancelling_case,
    hard_case,
    make_case,
    model_fields,
    operands,
    with_floor,
)
from ..support.helper_cases import bf16_rounding_inputs, e4m3_inputs, order_sensitive_rows


def _check(case, **kw):
    config = IndexerPrecisionConfig(
        rope_fp32=case.pre.rope_fp32, scoring_precision="fp8", engine=case.pre.engine
    )
    reason = _fused_unsupported_reason(case.pre, case.q, case.k, case.w, config=config)
    assert reason is None, reason
    assert_bit_identical(operands(case, "triton", **kw), operands(case, "torch", **kw))


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
@pytest.mark.parametrize(
    "rope_fp32,k_norm_fp32",
    [(True, False), (False, False), (False, True)],
    ids=["rope_fp32", "bf16", "bf16_k_norm_fp32"],
)
def test_config_matrix(rope_fp32, k_norm_fp32, hadamard, interleaved):
    case = make_case(
        rope_fp32=rope_fp32, k_norm_fp32=k_norm_fp32, hadamard=hadamard, interleaved=interleaved
    )
    _check(case, sm_scale=0.37, mscale=1.13)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
@pytest.mark.parametrize("name", PROFILES)
def test_every_engine_profile(name, rope_fp32):
    """Each profile's preprocessing (rope_fp32) and quantization / weight fold (both paths)."""
    engine = ENGINE_PROFILES[name]
    case = make_case(rope_fp32=rope_fp32, engine=engine, seq=5, **model_fields(engine))
    _check(case, mscale=1.07)


def test_custom_profile_with_bf16_rope_and_float32_outputs():
    """BF16 RoPE arithmetic with float32 q / k: the Hadamard output stays float32 (the
    profile's q_dtype / k_dtype), not rounded to the RoPE's dtype."""
    engine = dataclasses.replace(
        ENGINE_PROFILES["lmdeploy"], name="custom", q_dtype=torch.float32, k_dtype=torch.float32,
        hadamard=True,
    )  # fmt: skip
    _check(make_case(rope_fp32=True, engine=engine, seq=5, hadamard=True))


@pytest.mark.parametrize("layernorm", ["fp32-warp", "fp32-warp-up"])
@pytest.mark.parametrize("fma", [False, True])
def test_both_warp_layer_norm_orders(layernorm, fma):
    """The key LayerNorm of a CUDA warp, its butterfly down (SGLang's fused kernel) or up
    (FlashInfer's CuTe DSL kernel), with and without contraction, on the NeoX Hadamard model."""
    engine = dataclasses.replace(
        ENGINE_PROFILES["sglang-unfused"], name="custom", layernorm=layernorm, fma=fma
    )
    _check(make_case(rope_fp32=True, engine=engine, seq=5, **model_fields(engine)), mscale=1.07)


@pytest.mark.parametrize("fma", [False, True])
def test_welford_layer_norm_with_and_without_contraction(fma):
    """Inductor's Welford key LayerNorm (vllm-legacy's ``fp32-welford``): the kernel's lane
    butterfly and per-lane statistics against the reference, contracted or not."""
    engine = dataclasses.replace(ENGINE_PROFILES["vllm-legacy"], name="custom", fma=fma)
    _check(make_case(rope_fp32=True, engine=engine, seq=5, **model_fields(engine)), mscale=1.07)


@pytest.mark.parametrize("layernorm", ["fp32-inductor-x1", "fp32-inductor-x8"])
@pytest.mark.parametrize("fma", [False, True])
def test_inductor_persistent_layer_norm_orders(layernorm, fma):
    """Inductor's persistent key LayerNorm, XBLOCK 1 (pairs, lanes, warps) and XBLOCK 8 / 32
    (eight elements in turn, then 16 lanes): the kernel's sums against the reference."""
    engine = dataclasses.replace(
        ENGINE_PROFILES["vllm-legacy"], name="custom", layernorm=layernorm, fma=fma
    )
    _check(make_case(rope_fp32=True, engine=engine, seq=5, **model_fields(engine)), mscale=1.07)


@pytest.mark.parametrize("name", PROFILES)
def test_every_engine_profile_at_the_quantization_edges(name):
    engine = ENGINE_PROFILES[name]
    case = hard_case(engine=engine, **model_fields(engine))
    _check(case)


@pytest.mark.parametrize("name", PROFILES)
def test_carriers_quantize_like_the_reference(name):
    """prepare_scoring_operands' quantize-only launch (no RoPE) for every profile's rules."""
    engine = ENGINE_PROFILES[name]
    case = hard_case(engine=engine, **model_fields(engine))
    q, k = case.q.transpose(0, 1), case.q[:, :, 0].transpose(0, 1)
    w = case.w.transpose(0, 1)
    kw = dict(config=IndexerPrecisionConfig(scoring_precision="fp8", engine=engine), sm_scale=0.3)
    assert_bit_identical(
        prepare_scoring_operands(q, k, w, impl="triton", **kw),
        prepare_scoring_operands(q, k, w, impl="torch", **kw),
    )


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
@pytest.mark.parametrize("heads", [32, 64])
def test_heads_and_batch(heads, rope_fp32):
    _check(make_case(seq=5, batch=2, heads=heads, rope_fp32=rope_fp32, hadamard=True))


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
def test_packed_thd(rope_fp32):
    case = make_case(packed=[3, 1, 6], heads=32, rope_fp32=rope_fp32, hadamard=True)
    _check(case, sm_scale=2.0)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "fp32_math"])
def test_float32_projections_and_weights(rope_fp32):
    case = make_case(rope_fp32=rope_fp32, dtype=torch.float32, w_dtype=torch.float32)
    _check(case)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
@pytest.mark.parametrize("heads", [32, 64])
def test_quantization_edge_cases(heads, hadamard, interleaved):
    case = hard_case(heads=heads, hadamard=hadamard, interleaved=interleaved)
    ref = operands(case, "torch")
    # The cases are real: boundary amaxes, NaN descales and the floor all occur.
    scales = ref.q_descale.flatten()
    assert torch.isnan(scales).any() and (scales == 2.0**-22).any()  # 2**-22: the 1e-4 floor
    _check(case)
    low = hard_case(
        heads=heads, hadamard=hadamard, interleaved=interleaved,
        engine=with_floor(case.pre.engine, 1e-10),
    )  # fmt: skip
    _check(low, sm_scale=0.3)


def test_amax_floor_and_sm_scale():
    for floor in (1e-4, 1e-10, 2.0**-100, 0.5):
        case = make_case(rope_fp32=True, hadamard=True, seq=4, engine=with_floor(
            ENGINE_PROFILES["vllm-exact"], floor
        ))  # fmt: skip
        _check(case, sm_scale=0.088388)


@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
def test_order_sensitive_sums(hadamard):
    """Inexact float64 sums: a kernel summing in another order than the reference fails here."""
    _check(cancelling_case(hadamard=hadamard))


@pytest.mark.parametrize("params", [torch.float64, torch.float16], ids=["float64", "float16"])
@pytest.mark.parametrize("name", ["vllm-exact", "vllm"], ids=["float64_ln", "fp32_ops_ln"])
def test_layer_norm_parameters_of_every_dtype(name, params):
    """The kernel reads the key LayerNorm's float32 and BF16 parameters as they are (the other
    cases) and widens them itself; float64 ones as they are too; any other dtype through a float64
    copy: the same bits as the reference, which widens them in torch."""
    engine = ENGINE_PROFILES[name]
    case = make_case(rope_fp32=True, engine=engine, seq=5, **model_fields(engine))
    case.pre.k_norm.to(params)
    _check(case, mscale=1.07)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
def test_cached_rope_tables_follow_the_angles(rope_fp32):
    """The fused path's RoPE tables are remembered per angle tensor and version: angles changed in
    place, or new angles, give the reference's operands, not the old tables' (nor the same bytes
    as before)."""
    case = make_case(seq=6, batch=1, rope_fp32=rope_fp32)
    _check(case, mscale=1.1)
    first = operands(case, "triton", mscale=1.1)
    case.freqs.mul_(1.5)  # in place: a version bump, the cache misses
    _check(case, mscale=1.1)
    assert not torch.equal(
        first.q.view(torch.uint8), operands(case, "triton", mscale=1.1).q.view(torch.uint8)
    )
    for _ in range(3):  # new tensors (perhaps at a freed address) with other angles
        case.freqs = case.freqs.clone() * 0.75
        _check(case, mscale=1.1)


def test_e4m3_encoder_is_torch_round_to_nearest_even():
    x = e4m3_inputs()
    assert torch.equal(kernel_probes.e4m3_bits(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_bf16_rounding_is_torch_round_to_nearest_even():
    x = bf16_rounding_inputs()
    got, want = kernel_probes.round_bf16(x), x.to(torch.bfloat16).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))


def test_butterfly_matches_the_reference_stage_order():
    x = order_sensitive_rows()
    got = kernel_probes.hadamard_unscaled(x) * 128**-0.5  # the reference's scaling, in float64
    want = hadamard_transform(x, torch.float64)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@pytest.mark.parametrize("xblock", [1, 8])
def test_inductor_sums_match_the_reference_order(xblock):
    """The kernel's sums of squares in the order of Inductor's persistent reduction (vllm-legacy
    compiled for few tokens) equal exact_math's, on rows where the order shows."""
    from dsa_precision.exact_math import inductor_block_sum

    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 128, generator=g) * 2.0 ** torch.randint(-8, 8, (64, 128), generator=g)
    want = inductor_block_sum(x, xblock=xblock, squares_of=x, fma=True)[:, 0]
    other = inductor_block_sum(x, xblock=9 - xblock, squares_of=x, fma=True)[:, 0]
    assert not torch.equal(want, other)  # the two configurations add differently here
    got = kernel_probes.inductor_square_sums(x, xblock)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_pairwise_sum_matches_the_reference_order():
    x = order_sensitive_rows()
    want = _pairwise_sum(x)[:, 0]
    assert not torch.equal(want, x.sum(-1))  # the rows are order-sensitive
    assert torch.equal(kernel_probes.pairwise_sum(x).view(torch.int64), want.view(torch.int64))


@pytest.mark.parametrize("packed", [None, [0, 3, 8]], ids=["bshd", "thd"])
@pytest.mark.parametrize("name", ["vllm", "vllm-eager", "lmdeploy", "sglang-fused"])
def test_the_kernel_reads_the_engine_tables_the_reference_reads(name, packed):
    """rope_fp32 with the engine's own RoPE tables (the Megatron integration's): the fused kernel
    and the reference read the same rows of them, at the positions given (a context-parallel
    rank's, here 100 ..) or per packed sequence."""
    from dsa_precision.rope import EngineRopeTables, RopePositions, RopeSpec, YarnScaling

    engine = ENGINE_PROFILES[name]
    yarn = YarnScaling(40, 4096, 32, 1, 1.0, 1.0) if name == "vllm-eager" else None
    case = make_case(engine=engine, packed=packed, batch=1 if packed else 2, **model_fields(engine))
    tables = EngineRopeTables(RopeSpec(64, 1e6 if yarn is None else 1e4, yarn), engine)
    tabled = dataclasses.replace(case, pre=type(case.pre)(
        128, 64, k_norm=case.pre.k_norm, rope_fp32=True, engine=engine,
        rope_interleaved=case.pre.rope_interleaved, rotate_activation=case.pre.rotate_activation,
        rope_tables=tables,
    ))  # fmt: skip
    s = case.q.shape[0]
    positions = None if packed else RopePositions(s, 200, torch.arange(100, 100 + s))
    got = operands(tabled, "triton", positions=positions)
    assert_bit_identical(got, operands(tabled, "torch", positions=positions))
