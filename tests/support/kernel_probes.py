"""Test-only Triton kernels that expose the fused kernel's building blocks one at a time, so the
interpreter and GPU tests can compare each against torch on large or adversarial inputs.
Imports Triton: import it only from ``tests/interpreter`` and ``tests/gpu``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_precision.kernels import interpreting
from dsa_precision.kernels.preprocess_quantize import (
    _e4m3_codes,
    _hadamard,
    _inductor_block_sum,
    _pairwise_sum,
    _round_bf16,
)

_BLOCK = 1024


@triton.jit
def _elementwise_kernel(
    x_ptr, out_ptr, n, OP: tl.constexpr, HW_CAST: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if OP == 0:
        tl.store(out_ptr + offs, _e4m3_codes(x, HW_CAST).to(tl.uint8), mask=mask)
    else:
        tl.store(out_ptr + offs, _round_bf16(x, HW_CAST), mask=mask)


@triton.jit
def _rows_kernel(
    x_ptr, out_ptr, OP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, HW: tl.constexpr
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    lanes = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + lanes[None, :])
    if OP == 0:
        tl.store(out_ptr + rows[:, None] * D + lanes[None, :], _hadamard(x, R, D, 7))
    elif OP == 1:
        tl.store(out_ptr + rows, _pairwise_sum(x, R, D, 7))
    else:  # 2 / 3: Inductor's persistent sums of x * x (XBLOCK 1 / 8), contracted
        tl.store(out_ptr + rows, _inductor_block_sum(x, R, OP == 3, True, True, HW))


def e4m3_bits(x: torch.Tensor, hw_cast: bool | None = None) -> torch.Tensor:
    """uint8 E4M3 patterns of float32 ``x`` (``|x| <= 448``) by the kernel's encoder: the
    hardware conversion (default on a GPU) or the integer emulation (``hw_cast=False``, and
    always in the interpreter)."""
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    hw = not interpreting() if hw_cast is None else hw_cast
    _elementwise_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, OP=0, HW_CAST=hw, BLOCK=_BLOCK)
    return out


def round_bf16(x: torch.Tensor, hw_cast: bool | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to BF16 values by the kernel's rounding (float32 out): hardware
    (default on a GPU) or the integer emulation (``hw_cast=False``, and in the interpreter)."""
    out = torch.empty_like(x)
    n = x.numel()
    hw = not interpreting() if hw_cast is None else hw_cast
    _elementwise_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, OP=1, HW_CAST=hw, BLOCK=_BLOCK)
    return out


def hadamard_unscaled(x: torch.Tensor, rows_per_program: int = 16) -> torch.Tensor:
    """The kernel's float64 butterfly of ``[n, 128]`` float64 rows (no scale)."""
    out = torch.empty_like(x)
    _rows_kernel[(x.shape[0] // rows_per_program,)](
        x, out, OP=0, R=rows_per_program, D=128, HW=False, enable_fp_fusion=False
    )
    return out


def pairwise_sum(x: torch.Tensor, rows_per_program: int = 16) -> torch.Tensor:
    """The kernel's fixed-order float64 sum of ``[n, 128]`` rows."""
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    _rows_kernel[(x.shape[0] // rows_per_program,)](
        x, out, OP=1, R=rows_per_program, D=128, HW=False, enable_fp_fusion=False
    )
    return out


def inductor_square_sums(x: torch.Tensor, xblock: int, rows_per_program: int = 16) -> torch.Tensor:
    """The kernel's float32 sums of ``x * x`` over ``[n, 128]`` float32 rows in the order of
    Inductor's persistent reduction (``xblock`` 1 or 8), the multiplies fused as the engine's."""
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    _rows_kernel[(x.shape[0] // rows_per_program,)](
        x,
        out,
        OP=2 if xblock == 1 else 3,
        R=rows_per_program,
        D=128,
        HW=not interpreting(),
        enable_fp_fusion=False,
    )
    return out
