"""Triton's interpreter made fit to run the engines' kernels as oracles on the CPU.

Besides the casts (below), the interpreter runs BF16 arithmetic on the stored bit patterns
(``binary_op`` applies numpy's ``np.multiply`` to the uint16 data), which LMDeploy's kernels use
(RoPE in BF16: ``fma.rn.bf16`` / ``add.bf16`` on Hopper, one rounding each); within
:func:`hardware_casts` a BF16 sum, difference or product is the exact float64 result rounded
once to BF16, and a BF16 min / max / negation acts on the values.

The engines' kernels convert with Triton's casts (``x.to(tl.float8e4nv)``, ``x.to(tl.bfloat16)``),
which on Hopper are ``cvt.rn.satfinite.e4m3x2.f32`` and ``cvt.rn.bf16.f32``: round to nearest
even, E4M3 saturating at +-448. Triton's interpreter (3.8) converts float32 to BF16 by truncation
and to FP8 by rounding half up, unsaturated (``triton/runtime/interpreter.py`` ``_convert_float``),
so before any byte of an interpreted engine kernel is trusted :func:`interpreter_cast_errors`
measures that, and :func:`hardware_casts` replaces those conversions, for the duration of a
``with`` block, by torch's (which round as the hardware does; the E4M3 one clamped first, which
is ``satfinite``). Nothing else of the interpreter changes; the package's own kernel does not use
these casts (its encoders are integer code), so it is unaffected either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

_E4M3_MAX = 448.0


@triton.jit
def _cast_kernel(x_ptr, bf16_ptr, e4m3_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    tl.store(bf16_ptr + i, x.to(tl.bfloat16), mask=m)
    tl.store(e4m3_ptr + i, x.to(tl.float8e4nv), mask=m)


def cast_probe_values() -> torch.Tensor:
    """float32 values at the rounding edges: BF16 and E4M3 ties (even and odd), neighbours of
    ties, subnormal E4M3 ties, and magnitudes past 448 (saturation)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact in float32: E4M3 ties
    ulp = torch.nextafter(mids, torch.full_like(mids, float("inf"))) - mids
    bf = torch.arange(0x3F80, 0x3F90, dtype=torch.int32)
    bf_ties = ((bf << 16) | 0x8000).view(torch.float32)  # BF16 ties, both parities
    vals = torch.cat(
        (mids, mids + ulp, mids - ulp, bf_ties, torch.tensor([449.0, 460.0, 470.0, 1e6]))
    )
    return torch.cat((vals, -vals))


def _expected(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bf16 = x.to(torch.bfloat16)
    e4m3 = x.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return bf16, e4m3


def interpreter_cast_errors() -> dict[str, int]:
    """How many of :func:`cast_probe_values` the interpreter converts otherwise than the hardware
    (RNE; E4M3 saturating). Needs ``TRITON_INTERPRET=1``."""
    x = cast_probe_values()
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16)
    e4m3 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](x, bf16, e4m3, x.numel(), BLOCK=256)
    want_bf16, want_e4m3 = _expected(x)
    return {
        "values": x.numel(),
        "bf16": int((bf16.view(torch.int16) != want_bf16.view(torch.int16)).sum()),
        "e4m3": int((e4m3.view(torch.uint8) != want_e4m3.view(torch.uint8)).sum()),
    }


def _float32_of(data: np.ndarray, dtype: tl.dtype) -> np.ndarray | None:
    if dtype in (tl.float32, tl.float64, tl.float16):
        return data.astype(np.float32)
    if dtype == tl.bfloat16:  # stored as uint16 bits
        return (data.astype(np.uint32) << 16).view(np.float32)
    return None


def _round_bf16_once(x64: np.ndarray) -> np.ndarray:
    """float64 -> BF16 bits (uint16) with one rounding to nearest even: float32 rounded to odd
    first (exact enough: 24 >= 8 + 2 bits), then torch's RNE."""
    f32 = x64.astype(np.float32)
    inexact = f32.astype(np.float64) != x64
    bits = f32.view(np.uint32)
    toward = np.where((x64 > f32.astype(np.float64)) == (f32 > 0), 1, -1).astype(np.int64)
    bits = np.where(inexact & (bits & 1 == 0), (bits.astype(np.int64) + toward), bits)
    f32 = bits.astype(np.uint32).view(np.float32)
    return torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


_BF16_EXACT_OPS = (np.add, np.subtract, np.multiply)
_BF16_VALUE_OPS = (np.maximum, np.minimum, np.fmax, np.fmin)


def _bf16_binary(lhs, rhs, op):
    a, b = _float32_of(lhs.data, tl.bfloat16), _float32_of(rhs.data, tl.bfloat16)
    if op in _BF16_EXACT_OPS:  # exact in float64 for BF16 operands of this range
        out = _round_bf16_once(op(a.astype(np.float64), b.astype(np.float64)))
    else:
        out = _round_bf16_once(op(a, b).astype(np.float64))
    return interpreter.TensorHandle(out.reshape(np.broadcast(a, b).shape), tl.bfloat16)


def _hardware_convert(handle, dst: tl.dtype):
    """``handle`` converted as the GPU does, or ``None`` when it is not a narrowing cast to BF16
    or E4M3 (left to the interpreter)."""
    if dst not in (tl.bfloat16, tl.float8e4nv):
        return None
    f32 = _float32_of(handle.data, handle.dtype.scalar)
    if f32 is None or (dst == tl.bfloat16 and handle.dtype.scalar == tl.bfloat16):
        return None
    bf16, e4m3 = _expected(torch.from_numpy(np.ascontiguousarray(f32)))
    if dst == tl.bfloat16:
        bits = bf16.view(torch.int16).numpy().view(np.uint16)
    else:
        bits = e4m3.view(torch.uint8).numpy()
    return interpreter.TensorHandle(bits.reshape(handle.data.shape), dst)


@contextlib.contextmanager
def hardware_casts() -> Iterator[None]:
    """The interpreter's float -> BF16 / E4M3 conversions and its BF16 arithmetic as the
    hardware's, within the block."""
    builder = interpreter.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    binary_op, fneg = builder.binary_op, builder.create_fneg

    def patched_binary(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and op in _BF16_EXACT_OPS + _BF16_VALUE_OPS:
            return _bf16_binary(lhs, rhs, op)
        return binary_op(self, lhs, rhs, op)

    def patched_fneg(self, src):
        if src.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle(src.data ^ np.uint16(0x8000), tl.bfloat16)
        return fneg(self, src)

    def patched_cast(self, src, dst_type):
        out = _hardware_convert(src, dst_type.scalar)
        return out if out is not None else cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        out = _hardware_convert(src, dst_type.scalar)
        return out if out is not None else fp_to_fp(self, src, dst_type, rounding_mode)

    saved = (cast_impl, fp_to_fp, binary_op, fneg)
    builder.cast_impl, builder.create_fp_to_fp = patched_cast, patched_fp_to_fp
    builder.binary_op, builder.create_fneg = patched_binary, patched_fneg
    try:
        yield
    finally:
        builder.cast_impl, builder.create_fp_to_fp, builder.binary_op, builder.create_fneg = saved
