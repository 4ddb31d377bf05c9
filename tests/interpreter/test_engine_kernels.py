"""The engines' own Triton kernels (vLLM 0.33.0, LMDeploy 0.18.0), run unmodified by Triton's
interpreter on the CPU, against the package's operands of the same profile: q / k E4M3 bytes, k
descales and folded head weights, bitwise.

The interpreter's float -> BF16 / E4M3 casts and its BF16 arithmetic are not the hardware's
(``engine_oracles``); they are replaced within each run, after a check that the replacement
rounds as the hardware does. The interpreter does not contract multiply-adds, so the package side
is the profile with ``fma=False`` (the GPU run, ``tools/engine_conformance.py``, checks the
contracted profiles themselves). The engine sources come from ``DSA_ENGINE_KERNELS``
(docs/gpu-validation.md); without them these tests skip, except the stand-in kernel below, which
checks the loader and the comparison on a kernel of this file.
"""

import dataclasses

import pytest
import torch

from conformance import engine_kernels as ek
from dsa_precision import ENGINE_PROFILES, quantize_fp8
from dsa_precision.cli.engine_model import EngineOperands
from dsa_precision.cli.synthetic import synthetic_indexer_inputs

from ..support.engine_oracles import cast_probe_values, hardware_casts, interpreter_cast_errors


def test_the_replaced_casts_round_as_the_hardware():
    with hardware_casts():
        errors = interpreter_cast_errors()
    assert errors == {"values": cast_probe_values().numel(), "bf16": 0, "e4m3": 0}


def test_the_replacement_is_scoped():
    from triton.runtime import interpreter

    before = interpreter.InterpreterBuilder.cast_impl
    with hardware_casts():
        assert interpreter.InterpreterBuilder.cast_impl is not before
    assert interpreter.InterpreterBuilder.cast_impl is before


# A stand-in "engine kernel" (written here, in the engines' import style): UE8M0 quantization of
# 128-vectors, vLLM's rule, through the loader's stand-ins for vllm.platforms / triton_utils.
STAND_IN = """
import torch
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

FP8 = current_platform.fp8_dtype()


@triton.jit
def _quantize(x_ptr, out_ptr, scale_ptr):
    row = tl.program_id(0)
    lanes = tl.arange(0, 128)
    x = tl.load(x_ptr + row * 128 + lanes)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x)), 1e-4), 448.0)
    s = tl.math.exp2(tl.math.ceil(tl.math.log2(s)))
    tl.store(out_ptr + row * 128 + lanes, tl.div_rn(x, s).to(tl.float8e4nv))
    tl.store(scale_ptr + row, s)


def quantize(x):
    out = torch.empty(x.shape, dtype=FP8)
    scale = torch.empty(x.shape[0], dtype=torch.float32)
    _quantize[(x.shape[0],)](x, out, scale)
    return out, scale
"""


def test_a_stand_in_engine_kernel_through_the_loader(tmp_path, monkeypatch):
    path = tmp_path / ek.ENGINE_FILES["vllm"][0]
    path.parent.mkdir(parents=True)
    path.write_text(STAND_IN)
    monkeypatch.setenv(ek.ENV_VAR, str(tmp_path))
    module, source = ek.load_engine_kernels("vllm")
    assert source.startswith("unknown release (sha256 ")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128, generator=g) * 2.0 ** torch.randint(-8, 8, (16, 1), generator=g)
    x[3] = x[3] * 448.0 / x[3].abs().max()  # a descale on the log2 rule's band
    with hardware_casts():
        q8, scale = module.quantize(x)
    ref8, ref_scale = quantize_fp8(x, ENGINE_PROFILES["vllm"].q_quant)
    ours = EngineOperands(ref8[None], ref8, ref_scale, ref_scale[None])
    theirs = EngineOperands(q8[None], q8, scale, scale[None])
    diff = ek.operand_diff(ours, theirs)
    assert diff["q_differ"] == diff["k_descale_differ"] == 0, diff
    # The comparison sees a flipped byte.
    q8.view(torch.uint8)[5, 7] ^= 1
    assert ek.operand_diff(ours, EngineOperands(q8[None], q8, scale, scale[None]))["k_differ"] == 1


needs = {e: pytest.mark.skipif(ek.missing_reason(e) is not None, reason=str(ek.missing_reason(e)))
         for e in ek.ENGINE_FILES}  # fmt: skip


@pytest.mark.parametrize("heads, interleaved", [(32, True), (64, False)])
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("vllm", marks=needs["vllm"]),
        pytest.param("vllm-eager", marks=needs["vllm"]),
        pytest.param("lmdeploy", marks=needs["lmdeploy"]),
    ],
)
def test_the_engine_kernel_builds_the_profiles_operands(name, heads, interleaved):
    inputs = synthetic_indexer_inputs(16, n_heads=heads, seed=1)
    profile = ENGINE_PROFILES[name]
    with hardware_casts():
        run = ek.engine_kernel_operands(inputs, profile, interleaved=interleaved)
    assert run.source.startswith(("vllm 0.33.0", "lmdeploy 0.18.0")), run.source
    uncontracted = dataclasses.replace(profile, fma=False)  # the interpreter does not contract
    for impl in ("torch", "triton"):
        ours = ek.package_operands(inputs, uncontracted, interleaved=interleaved, impl=impl)
        diff = ek.operand_diff(ours, run.operands)
        assert all(v == 0 for k, v in diff.items() if k.endswith("_differ")), (impl, diff)


@needs["vllm-legacy-q"]
@pytest.mark.parametrize("heads, interleaved", [(32, True), (64, False)])
def test_vllm_028s_own_query_kernel_builds_the_legacy_profiles_q(heads, interleaved):
    """vLLM 0.28.0's fused_indexer_q_rope_quant (the query of vllm-legacy) against the package's
    operands of that profile uncontracted (the interpreter does not contract): every q byte and
    folded weight, the key side handed through."""
    from conformance import legacy_q

    inputs = synthetic_indexer_inputs(64, n_heads=heads, seed=2)
    profile = ENGINE_PROFILES["vllm-legacy"]
    uncontracted = dataclasses.replace(profile, fma=False)
    for impl in ("torch", "triton"):
        ours = ek.package_operands(inputs, uncontracted, interleaved=interleaved, impl=impl)
        with hardware_casts():
            theirs, source = legacy_q.legacy_q_operands(
                inputs, profile, ours, interleaved=interleaved
            )
        assert source.startswith("vllm 0.28.0 (sha256 22d1d98bd475)"), source
        diff = ek.operand_diff(ours, theirs)
        assert diff["q_differ"] == diff["weights_differ"] == 0, (impl, diff)
    # The comparison sees a moved weight.
    theirs.weights[0, 0] = theirs.weights[0, 0].nextafter(theirs.weights.new_tensor(1e9))
    assert ek.operand_diff(ours, theirs)["weights_differ"] == 1
