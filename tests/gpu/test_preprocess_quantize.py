"""The compiled fused preprocess+quantize kernel on an SM90 GPU against the torch reference on the
same GPU: bit-identical operands (the cases of ``tests/interpreter``, plus production shapes),
the hardware paths the interpreter cannot check (code generation without FMA contraction or
flush-to-zero, float64 division and square root, the BF16 / E4M3 bit arithmetic), and replays."""

import dataclasses

import pytest
import torch

from dsa_precision import ENGINE_PROFILES, IndexerPrecisionConfig
from dsa_precision.exact_math import _pairwise_sum
from dsa_precision.hadamard import HAVE_FAST_HADAMARD, hadamard_transform
from dsa_precision.kernels.rules import PreprocessRules
from dsa_precision.preprocess_kernel import _fused_unsupported_reason

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
from ..support.helpers import no_host_sync

pytestmark = pytest.mark.gpu

DEV = "cuda"
_FAST_HADAMARD = pytest.mark.skipif(
    HAVE_FAST_HADAMARD,
    reason="fast_hadamard_transform is installed: BF16 Hadamard cases use the reference path",
)


def _check(case, record=None, name="", **kw):
    config = IndexerPrecisionConfig(
        rope_fp32=case.pre.rope_fp32, scoring_precision="fp8", engine=case.pre.engine
    )
    reason = _fused_unsupported_reason(case.pre, case.q, case.k, case.w, config=config)
    assert reason is None, reason
    got, want = operands(case, "triton", **kw), operands(case, "torch", **kw)
    assert got.q.is_cuda
    assert_bit_identical(got, want)
    if record is not None:
        record("fused_bit_identical", case=name, q=tuple(case.q.shape), identical=True)
    return got


def _bf16_hadamard_ok(rope_fp32, hadamard):
    if hadamard and not rope_fp32 and HAVE_FAST_HADAMARD:
        pytest.skip("fast_hadamard_transform is installed: the BF16 Hadamard uses the reference")


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
@pytest.mark.parametrize(
    "rope_fp32,k_norm_fp32",
    [(True, False), (False, False), (False, True)],
    ids=["rope_fp32", "bf16", "bf16_k_norm_fp32"],
)
@pytest.mark.parametrize("heads", [32, 64])
def test_config_matrix(record, heads, rope_fp32, k_norm_fp32, hadamard, interleaved):
    _bf16_hadamard_ok(rope_fp32, hadamard)
    case = make_case(
        seq=257,
        batch=2,
        heads=heads,
        rope_fp32=rope_fp32,
        k_norm_fp32=k_norm_fp32,
        hadamard=hadamard,
        interleaved=interleaved,
        device=DEV,
    )
    _check(case, sm_scale=0.37, mscale=1.13)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
def test_packed_thd(rope_fp32):
    _bf16_hadamard_ok(rope_fp32, True)
    case = make_case(
        packed=[700, 1, 333, 1000], heads=64, rope_fp32=rope_fp32, hadamard=True, device=DEV
    )
    _check(case, sm_scale=2.0)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "fp32_math"])
def test_float32_projections_and_weights(rope_fp32):
    case = make_case(
        seq=300, rope_fp32=rope_fp32, dtype=torch.float32, w_dtype=torch.float32, device=DEV
    )
    _check(case)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
@pytest.mark.parametrize("heads", [32, 64])
def test_quantization_edge_cases(heads, hadamard, interleaved):
    case = hard_case(heads=heads, hadamard=hadamard, interleaved=interleaved, device=DEV)
    _check(case)
    low = hard_case(
        heads=heads, hadamard=hadamard, interleaved=interleaved, device=DEV,
        engine=with_floor(case.pre.engine, 1e-10),
    )  # fmt: skip
    _check(low, sm_scale=0.3)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16"])
@pytest.mark.parametrize("name", PROFILES)
def test_every_engine_profile(name, rope_fp32):
    """Each profile's rules compiled for the GPU: production-like shapes and the edges."""
    engine = ENGINE_PROFILES[name]
    fields = model_fields(engine)
    _bf16_hadamard_ok(rope_fp32, fields["hadamard"])
    _check(
        make_case(
            seq=513, batch=1, heads=64, rope_fp32=rope_fp32, engine=engine, device=DEV, **fields
        )
    )
    _check(hard_case(engine=engine, device=DEV, **fields))


@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
def test_order_sensitive_sums(hadamard):
    _check(cancelling_case(hadamard=hadamard, device=DEV))


@pytest.mark.parametrize(
    "rope_fp32,hadamard,interleaved",
    [
        (True, True, False),
        (True, False, False),
        (True, False, True),  # FP8 lanes back in the engines' (pairs in place) order
        pytest.param(False, True, False, marks=_FAST_HADAMARD),
        (False, False, False),
        (False, False, True),
    ],
    ids=["rope_fp32_hadamard", "rope_fp32", "rope_fp32_interleaved", "bf16_hadamard", "bf16",
         "bf16_interleaved"],
)  # fmt: skip
def test_production_shape_and_replays(record, rope_fp32, hadamard, interleaved):
    """S = 16384, H = 64: bit-identical to the reference, and three launches give the same bits."""
    case = make_case(
        seq=16384, batch=1, heads=64, rope_fp32=rope_fp32, hadamard=hadamard,
        interleaved=interleaved, device=DEV,
    )  # fmt: skip
    first = _check(case, sm_scale=128**-0.5)
    replays = [operands(case, "triton", sm_scale=128**-0.5) for _ in range(3)]
    for again in replays:
        assert_bit_identical(again, first)
    record(
        "fused_production",
        rope_fp32=rope_fp32,
        hadamard=hadamard,
        interleaved=interleaved,
        seq=16384,
        heads=64,
        bit_identical=True,
        replays_identical=True,
    )


@pytest.mark.parametrize(
    "shape", [(4, 1), (8, 2), (16, 2), (32, 4)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_launch_shapes_give_the_same_bits(shape):
    """The launch shape (vectors per program, warps) is a tuning knob, never a numerics one."""
    from dsa_precision.kernels.preprocess_quantize import preprocess_quantize
    from dsa_precision.kernels.rules import PreprocessRules

    case = make_case(seq=1000, batch=2, heads=64, rope_fp32=True, hadamard=True, device=DEV)
    rules = PreprocessRules.carriers(case.pre.engine)
    want = preprocess_quantize(case.q, rules, weights=case.w)
    got = preprocess_quantize(
        case.q, rules, weights=case.w, block_rows=shape[0], num_warps=shape[1]
    )
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    _check(case, sm_scale=128**-0.5)


def test_layer_norm_eps_changes_are_honoured():
    """The kernel's float64 constants are cached per (eps, device): a changed epsilon must not
    reuse another's."""
    case = make_case(seq=256, batch=1, heads=32, rope_fp32=True, device=DEV)
    for eps in (1e-6, 1e-5, 1e-6, 0.25):
        case.pre.k_norm.eps = eps
        _check(case, sm_scale=1.0)


@pytest.mark.parametrize(
    "params", [torch.float32, torch.float64, torch.float16], ids=["float32", "float64", "float16"]
)
@pytest.mark.parametrize("name", ["vllm-exact", "vllm"], ids=["float64_ln", "fp32_ops_ln"])
def test_layer_norm_parameters_of_every_dtype(name, params):
    """The kernel widens float32 and BF16 LayerNorm parameters itself (no float64 copy per call),
    reads float64 ones as they are and other dtypes through a float64 copy: the reference's bits
    for each (BF16 parameters: every other rope_fp32 case)."""
    engine = ENGINE_PROFILES[name]
    case = make_case(seq=257, rope_fp32=True, engine=engine, device=DEV, **model_fields(engine))
    case.pre.k_norm.to(params)
    _check(case, mscale=1.07)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16_path"])
def test_cached_rope_tables_follow_the_angles(rope_fp32):
    """The fused path remembers its RoPE tables per angle tensor and version: the same angles
    again reuse them; angles changed in place, or new angles at the old address, do not."""
    from dsa_precision import prepare

    case = make_case(seq=300, batch=1, heads=64, rope_fp32=rope_fp32, device=DEV)
    first = _check(case, mscale=1.1)
    assert case.pre.rope_tables is None  # Megatron's angles (the engine tables: test_rope_tables)
    tables = prepare._kernel_rope_tables(case.freqs, 300, 1.1, *_table_dtypes(case))
    assert tables is prepare._kernel_rope_tables(case.freqs, 300, 1.1, *_table_dtypes(case))
    case.freqs.mul_(1.5)  # in place: the cache must miss
    second = _check(case, mscale=1.1)
    assert not torch.equal(first.q.view(torch.uint8), second.q.view(torch.uint8))
    for _ in range(3):  # new tensors, possibly at a freed address, with other angles each time
        case.freqs = case.freqs.clone() * 0.75
        _check(case, mscale=1.1)


def _table_dtypes(case) -> tuple[torch.dtype, torch.dtype]:
    rules = PreprocessRules.indexer(case.pre, case.pre.engine, case.q.dtype)
    return rules.table_dtype, rules.math_dtype


@pytest.mark.parametrize("hw_cast", [True, False], ids=["hardware_casts", "integer_emulation"])
def test_helpers_on_hardware(hw_cast):
    """The building blocks compiled for the GPU: the E4M3 / BF16 rounding the kernel uses there
    (hardware conversions) and the integer emulation the interpreter uses, both against torch's
    CUDA casts; the butterfly and the pairwise sum against the reference order."""
    from ..support import kernel_probes

    x = e4m3_inputs(DEV)
    want_e4m3 = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(kernel_probes.e4m3_bits(x, hw_cast=hw_cast), want_e4m3)
    x = bf16_rounding_inputs(DEV)
    got, want = kernel_probes.round_bf16(x, hw_cast=hw_cast), x.to(torch.bfloat16).float()
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isnan(got), ~finite)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    rows = order_sensitive_rows(DEV)
    got = kernel_probes.hadamard_unscaled(rows) * 128**-0.5
    assert torch.equal(
        got.view(torch.int64), hadamard_transform(rows, torch.float64).view(torch.int64)
    )
    sums = kernel_probes.pairwise_sum(rows)
    assert torch.equal(sums.view(torch.int64), _pairwise_sum(rows)[:, 0].view(torch.int64))


@pytest.mark.parametrize("xblock", [1, 8])
def test_inductor_sums_on_hardware(xblock):
    """The kernel's sums of squares in the order of Inductor's persistent reduction, compiled for
    the GPU (fma.rn), equal exact_math's on rows where the two configurations differ."""
    from dsa_precision.exact_math import inductor_block_sum

    from ..support import kernel_probes

    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 128, generator=g) * 2.0 ** torch.randint(-8, 8, (64, 128), generator=g)
    x = x.to(DEV)
    want = inductor_block_sum(x, xblock=xblock, squares_of=x, fma=True)[:, 0]
    assert not torch.equal(
        want, inductor_block_sum(x, xblock=9 - xblock, squares_of=x, fma=True)[:, 0]
    )
    got = kernel_probes.inductor_square_sums(x, xblock)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope_fp32", "bf16_path"])
def test_interleaved_operands_never_wait_for_the_host(rope_fp32):
    """Putting interleaved RoPE pairs back in place (the engines' lane order) stays on the device:
    no host copy, no synchronisation."""
    case = make_case(seq=512, batch=1, heads=64, rope_fp32=rope_fp32, interleaved=True, device=DEV)
    warm = operands(case, "triton")  # compiles the kernel (which may synchronise)
    with no_host_sync():
        again = operands(case, "triton")
    assert_bit_identical(again, warm)


def test_freqs_must_cover_the_tokens_on_both_paths():
    """One row of angles for many tokens is refused by the kernel path and by the reference with
    the same error (the reference used to broadcast it to every token)."""
    from dsa_precision import prepare_indexer_operands

    case = make_case(seq=64, batch=1, heads=32, rope_fp32=True, device=DEV)
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine=case.pre.engine)
    for impl in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"freqs has 1 rows of angles for 64 tokens"):
            prepare_indexer_operands(
                case.pre, case.q, case.k, case.w, case.freqs[:1], config=config, impl=impl
            )


# ------------------------------------------- against the engines' own kernels (DSA_ENGINE_KERNELS)


def _engine_kernels_reason(engine: str) -> str | None:
    from conformance import engine_kernels

    return engine_kernels.missing_reason(engine)


@pytest.mark.parametrize("heads, interleaved", [(32, True), (64, False)])
@pytest.mark.parametrize("name", ["vllm", "vllm-eager", "lmdeploy"])
def test_the_engines_kernels_build_the_profiles_operands(record, name, heads, interleaved):
    """vLLM 0.33.0's fused_norm_rope / fused_q and LMDeploy 0.18.0's preprocess kernels, compiled
    by this host's Triton, against the package's fused kernel and torch reference with the
    profile: every q / k byte, k descale and folded weight (tools/engine_conformance.py adds the
    top-k rows at S=8192)."""
    from conformance import engine_kernels as ek
    from conformance.inference import inference_operands
    from dsa_precision.cli.synthetic import synthetic_indexer_inputs

    profile = ENGINE_PROFILES[name]
    reason = _engine_kernels_reason(ek.oracle_for(profile))
    if reason is not None:
        pytest.skip(reason)
    inputs = synthetic_indexer_inputs(1024, n_heads=heads, seed=2).to(DEV)
    run = ek.engine_kernel_operands(inputs, profile, interleaved=interleaved)
    for impl in ("triton", "torch"):
        ours = ek.package_operands(inputs, profile, interleaved=interleaved, impl=impl)
        diff = ek.operand_diff(ours, run.operands)
        assert all(v == 0 for k, v in diff.items() if k.endswith("_differ")), (impl, diff)
    _, source = inference_operands(inputs, profile, hadamard=False, interleaved=interleaved)
    assert source.startswith("the engine's own kernels"), source
    record("engine_kernel_bitwise", profile=name, heads=heads, source=run.source, **diff)


# Per SGLang profile: its layout (interleaved RoPE), the synthetic seed, and the profile with one
# rule changed each, recorded for a failure's diagnosis (not asserted). sglang-fused's earlier
# rules moved weights and q bytes on the H200; sglang-unfused's RoPE rules moved q bytes on an
# H100 at S = 1024, its LayerNorm ones no k byte.
SGLANG_CASES = {
    "sglang-fused": (True, 2, {
        "rope_fma=cos": dict(rope_fma="cos"),
        "layernorm=fp32-ops": dict(layernorm="fp32-ops"),
        "layernorm=float64": dict(layernorm="float64"),
        "fma=False": dict(fma=False),
    }),
    "sglang-unfused": (False, 4, {
        "rope_fma=cos-sin": dict(rope_fma="cos-sin"),
        "fma=False": dict(fma=False),
        "layernorm=fp32-warp": dict(layernorm="fp32-warp"),
        "layernorm=float64": dict(layernorm="float64"),
        "hadamard_scale=float64": dict(hadamard_scale="float64"),
    }),
}  # fmt: skip


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("name", sorted(SGLANG_CASES))
def test_sglangs_kernels_build_the_profiles_operands(record, name, heads):
    """SGLang 0.5.23's own indexer code against the package's fused kernel and torch reference
    with the profile: every q / k byte, k descale and folded weight.

    sglang-fused: the fused path (GLM-5, interleaved RoPE), SGLang's JIT kernels compiled by this
    host's nvcc through SGLang's build code and loaded by tvm-ffi (engine_kernels), with the rules
    its SASS shows (docs/numerics.md 8.5). sglang-unfused: the unfused path (DeepSeek-V3.2, NeoX
    RoPE, Hadamard) run from the wheels (``Indexer._get_q_k_bf16``, ``act_quant``,
    ``_store_index_k_cache``, ``_get_logits_head_gate``: FlashInfer 0.7.2's CuTe DSL LayerNorm,
    SGLang's JIT RoPE, Hadamard and index-K store, its Triton act_quant, its compiled head gate;
    conformance.sglang_unfused; numerics 8.6)."""
    from conformance import engine_kernels as ek
    from dsa_precision.cli.synthetic import synthetic_indexer_inputs

    interleaved, seed, variants = SGLANG_CASES[name]
    profile = ENGINE_PROFILES[name]
    reason = _engine_kernels_reason(ek.JIT_ORACLE_ENGINES[name])
    if reason is not None:
        pytest.skip(reason)
    inputs = synthetic_indexer_inputs(1024, n_heads=heads, seed=seed).to(DEV)
    run = ek.engine_kernel_operands(inputs, profile, interleaved=interleaved)
    diffs = {}
    for impl in ("triton", "torch"):
        ours = ek.package_operands(inputs, profile, interleaved=interleaved, impl=impl)
        diffs[impl] = ek.operand_diff(ours, run.operands)
    record("engine_kernel_bitwise", profile=name, heads=heads, source=run.source, **diffs)
    for label, change in variants.items():
        variant = dataclasses.replace(profile, name=f"{name} ({label})", **change)
        ours = ek.package_operands(inputs, variant, interleaved=interleaved, impl="torch")
        record("engine_kernel_variant", profile=name, heads=heads, variant=label,
               **ek.operand_diff(ours, run.operands))  # fmt: skip
    for impl, diff in diffs.items():
        assert all(v == 0 for k, v in diff.items() if k.endswith("_differ")), (impl, diff)


@pytest.mark.parametrize(
    "heads, interleaved, norm_scale", [(32, True, 1.0), (64, False, 1.0), (32, False, 2.0**-20)]
)
def test_vllm_028s_own_key_kernel_builds_the_legacy_profiles_k(
    record, heads, interleaved, norm_scale
):
    """vLLM 0.28.0's CUDA indexer_k_quant_and_cache (built by tools/vllm_legacy_kernel.sh, at
    $DSA_VLLM_LEGACY) on the package's vllm-legacy BF16 key, against the package's fused kernel
    and torch reference: every k byte and k scale. ``norm_scale`` shrinks the key LayerNorm's
    affine so every key is under the 1e-4 amax floor."""
    from conformance import engine_kernels as ek
    from conformance import legacy_kernel as lk
    from dsa_precision.cli.synthetic import synthetic_indexer_inputs

    reason = lk.missing_reason()
    if reason is not None:
        pytest.skip(reason)
    profile = ENGINE_PROFILES["vllm-legacy"]
    inputs = synthetic_indexer_inputs(1024, n_heads=heads, seed=3).to(DEV)
    with torch.no_grad():
        inputs.k_norm.weight.mul_(norm_scale)
        inputs.k_norm.bias.mul_(norm_scale)
    run = lk.legacy_kernel_key(inputs, profile, interleaved=interleaved)
    assert run.source.startswith("vllm 0.28.0 "), run.source
    if norm_scale != 1.0:
        assert bool((run.k_descale == 2.0**-22).all())  # the floor's scale: 1e-4f / 448 -> 2^-22
    for impl in ("triton", "torch"):
        ours = ek.package_operands(inputs, profile, interleaved=interleaved, impl=impl)
        k_differ = int((ours.k.view(torch.uint8) != run.k.view(torch.uint8)).sum())
        scales_differ = int(
            (ours.k_descale.view(torch.int32) != run.k_descale.view(torch.int32)).sum()
        )
        assert k_differ == 0 and scales_differ == 0, (impl, k_differ, scales_differ)
    record(
        "vllm_legacy_key_kernel_bitwise", heads=heads, interleaved=interleaved,
        norm_scale=norm_scale, source=run.source, k_total=run.k.numel(),
    )  # fmt: skip


@pytest.mark.parametrize("heads, interleaved", [(32, True), (64, False)])
def test_vllm_028s_own_query_kernel_builds_the_legacy_profiles_q(record, heads, interleaved):
    """vLLM 0.28.0's Triton fused_indexer_q_rope_quant (from its wheel, DSA_ENGINE_KERNELS), as
    vLLM launches it (Triton's default contraction), against the package's vllm-legacy fused
    kernel and torch reference: every q byte and folded weight; the uncontracted profile beside
    it, recorded."""
    from conformance import engine_kernels as ek
    from conformance import legacy_q
    from dsa_precision.cli.synthetic import synthetic_indexer_inputs

    reason = ek.missing_reason("vllm-legacy-q")
    if reason is not None:
        pytest.skip(reason)
    profile = ENGINE_PROFILES["vllm-legacy"]
    inputs = synthetic_indexer_inputs(1024, n_heads=heads, seed=3).to(DEV)
    diffs = {}
    for impl in ("triton", "torch"):
        ours = ek.package_operands(inputs, profile, interleaved=interleaved, impl=impl)
        theirs, source = legacy_q.legacy_q_operands(inputs, profile, ours, interleaved=interleaved)
        diffs[impl] = ek.operand_diff(ours, theirs)
    assert source.startswith("vllm 0.28.0 "), source
    uncontracted = dataclasses.replace(profile, fma=False)
    ours = ek.package_operands(inputs, uncontracted, interleaved=interleaved, impl="torch")
    record(
        "vllm_legacy_query_kernel",
        heads=heads,
        source=source,
        fma_false=ek.operand_diff(ours, theirs),
        **diffs,
    )
    for impl, diff in diffs.items():
        assert diff["q_differ"] == diff["weights_differ"] == 0, (impl, diff)


def test_packed_angles_from_device_lengths_never_wait_for_the_host():
    """cu_seqlens on the device: the per-token angles are gathered without reading it."""
    from dsa_precision.preprocess import _thd_token_freqs

    freqs = torch.randn(16, 1, 1, 64, device=DEV)
    cu = torch.tensor([0, 5, 5, 16, 20], dtype=torch.int32, device=DEV)
    want = freqs[[0, 1, 2, 3, 4, *range(11), 0, 1, 2, 3]]
    _thd_token_freqs(freqs, cu, 20)  # warm-up (first launches)
    with no_host_sync():
        got = _thd_token_freqs(freqs, cu, 20)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="packs 20 tokens but the input has 21"):
        _thd_token_freqs(freqs, cu, 21, validate=True)
