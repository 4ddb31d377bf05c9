"""The fused preprocess+quantize kernel compiled for sm_90a by Triton's CUDA backend, on a machine
without a GPU, for every engine profile's launches (queries and keys, each model layout the
profile serves, and Megatron's BF16 path).

Triton's interpreter (``tests/interpreter``) runs the kernel's arithmetic but not its compiler:
a branch on a value the compiler does not see as a compile-time constant, say, runs there and
fails to compile on the GPU. This test is that compiler's front end and code generation (PTX,
``ptxas``), launching nothing (``tools/engine_kernels_aot.py``'s compile-only driver).
"""

import importlib.util
import os

import pytest
import torch

from dsa_precision import ENGINE_PROFILES
from dsa_precision.kernels.preprocess_quantize import preprocess_quantize
from dsa_precision.kernels.rules import PreprocessRules
from dsa_precision.preprocess import IndexerPreprocess

from ..support.configs import load_tool

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="Triton is not installed"
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing"
    ),
]

S = 8


def _layouts(name: str) -> list[tuple[bool, bool]]:
    """``(rope_interleaved, hadamard)`` pairs the profile serves (its Hadamard setting, its RoPE
    layout where it names one, else both)."""
    engine = ENGINE_PROFILES[name]
    layouts = (False, True) if engine.rope_interleaved is None else (engine.rope_interleaved,)
    return [(interleaved, bool(engine.hadamard)) for interleaved in layouts]


CASES = [
    pytest.param(name, interleaved, hadamard, rope_fp32, id=f"{name}-{i}{h}-{r}")
    for name in sorted(ENGINE_PROFILES)
    for interleaved, hadamard in _layouts(name)
    for rope_fp32 in (True, False)
    for i, h, r in [
        ("interleaved" if interleaved else "neox", "-hadamard" if hadamard else "",
         "rope_fp32" if rope_fp32 else "bf16")
    ]
]  # fmt: skip


@pytest.mark.parametrize("name, interleaved, hadamard, rope_fp32", CASES)
def test_the_fused_kernel_compiles_for_sm90a(name, interleaved, hadamard, rope_fp32):
    engine = ENGINE_PROFILES[name]
    pre = IndexerPreprocess(
        128, 64, k_norm=torch.nn.LayerNorm(128, eps=1e-6, dtype=torch.bfloat16),
        rope_interleaved=interleaved, rotate_activation=hadamard, rope_fp32=rope_fp32,
        engine=engine,
    )  # fmt: skip
    rules = PreprocessRules.indexer(pre, engine, torch.bfloat16)
    cos = torch.zeros(S, 64, dtype=rules.table_dtype)
    norm = (pre.k_norm.weight, pre.k_norm.bias, 1e-6)
    q, k, w = torch.zeros(S, 1, 4, 128), torch.zeros(S, 1, 128), torch.zeros(S, 1, 4)
    captured: list = []
    with load_tool("engine_kernels_aot").compile_only(captured):
        preprocess_quantize(q.bfloat16(), rules, cos=cos, sin=cos, weights=w, fold_scales=(0.5,))
        preprocess_quantize(k.bfloat16(), rules, cos=cos, sin=cos, layer_norm=norm)
    assert [n for n, _ in captured] == ["_preprocess_quantize_kernel"] * 2
    for _, kernel in captured:
        ptx = kernel.asm["ptx"]
        assert ".target sm_90a" in ptx and ".entry _preprocess_quantize_kernel" in ptx
