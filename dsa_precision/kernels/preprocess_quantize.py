"""Fused indexer preprocessing and E4M3 quantization under an engine's rules (Triton).

One kernel, launched once for the queries and once for the keys, reads the projections in
Megatron's ``[s, b, (h,) 128]`` layout and writes what the FP8 scorer reads, in BSHD: E4M3 bytes,
one float32 descale per 128-vector and, for the queries, the head weights with the q descale
folded in. Per 128-vector (one row of a ``[BLOCK_R, 128]`` tile)::

    (key, rope_fp32) LayerNorm   float64 statistics in the fixed pairwise order, affine in
                                 float64, one rounding to float32; or (layer_norm
                                 "fp32-ops" / "fp32-warp") float32 operation by operation in
                                 Triton's tl.sum tree or a CUDA warp's, tl.rsqrt, the
                                 engine's fused multiply-adds (then to BF16 if the engine
                                 rounds its LayerNorm output)
    RoPE                         float32 products and sum (fma: x*cos fused into the sum, or
                                 on the second half rotate_half(x)*sin, by rope_fma);
                                 with BF16 math each of
                                 x*cos, rotate_half(x)*sin and their sum rounded to BF16;
                                 then rounded to BF16 if the engine rounds q / k
    Hadamard (optional)          float64 butterfly in the reference's stage order, float64
                                 scale (or the sums in float32 times fl32(128**-0.5)),
                                 float64 -> float32 (-> BF16 with BF16 math or rounding)
    quantize                     descale from the float32 bits of max(amax, floor) under the
                                 rule (exact UE8M0; or the float32 ratio, its UE8M0 ceiling by
                                 bits or by log2; or the ratio itself), the value scaled by the
                                 exact power-of-two reciprocal, by IEEE division or by the IEEE
                                 reciprocal, clamped to +-448, E4M3 round-to-nearest-even, NaN
                                 for a non-finite vector

Exactness: this reproduces :class:`dsa_precision.preprocess.IndexerPreprocess` followed by
:func:`dsa_precision.quantize.quantize_fp8` bit for bit: every operation is one the reference
performs, on the same values, in the same order, with the same rounding (the argument, step by
step: docs/numerics.md, section 11).
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from ..devices import _device_constant
from ..devices import f32 as _f32
from ..engines import Fp8Rule
from ..exact_math import _DIV_FULL_ONE_THIRD
from . import interpreting
from .rules import PreprocessRules

__all__ = ["BLOCK_ROWS", "NUM_WARPS", "preprocess_quantize"]

_HEAD_DIM = 128
# Smallest float32 amax floor the kernel accepts: above it every descale 2**e and its reciprocal
# are normal float32 numbers (e >= -109 and e <= 120), so scaling by the reciprocal is exact.
_MIN_AMAX_FLOOR = 2.0**-100
_LOG2_HEAD_DIM = 7
_FLOAT32_NAN_BITS = tl.constexpr(0x7FC00000)  # what torch.full_like(x, nan) stores
_E4M3_NAN_BITS = tl.constexpr(0x7F)
_ONE_THIRD = tl.constexpr(_DIV_FULL_ONE_THIRD)  # Inductor's Welford ratio div.full(1, 3)


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """Exact float32 values of float32 data, or of BF16 data passed as its int16 bit view
    (widened by a shift: exact for every value, subnormals included)."""
    if IS_BF16:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _round_bf16(x, HW_CAST: tl.constexpr):
    """Round float32 ``x`` to the nearest-even BF16 value (kept in float32), as c10 does: the
    hardware conversion (``cvt.rn.bf16.f32``), or the same rounding in integer arithmetic for
    Triton's interpreter, whose casts round half up."""
    if HW_CAST:
        return x.to(tl.bfloat16).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    # The bias could carry a NaN's mantissa into the sign bit; NaN stays NaN.
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _e4m3_codes(v, HW_CAST: tl.constexpr):
    """E4M3 bit patterns (int32) of float32 ``v``, ``|v| <= 448``, round to nearest even: the
    hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``) or the integer emulation below."""
    if HW_CAST:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return _e4m3_bits(v)


@triton.jit
def _e4m3_bits(v):
    """float8_e4m3fn bit pattern (int32 in [0, 255]) of float32 ``v``, ``|v| <= 448``:
    round to nearest, ties to even; c10's ``fp8e4m3fn_from_fp32_value`` below its overflow
    branch, which the descale rule never reaches."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = (bits >> 24) & 0x80
    # |v| >= 2**-6 (E4M3 normal): rebias the exponent (127 -> 7) and round the 23-bit mantissa
    # to 3 bits, ties to even, in one integer add; a mantissa carry bumps the exponent.
    normal = (mag + (((7 - 127) << 23) + 0x7FFFF) + ((mag >> 20) & 1)) >> 20
    # |v| < 2**-6 (E4M3 subnormal or zero): adding 2**14 in float32 rounds |v| to a multiple of
    # 2**-9 (nearest even) and leaves that multiple, 0..8, in the low mantissa bits.
    small = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    return tl.where(mag < (121 << 23), small, normal) | sign


@triton.jit
def _pairwise_sum(x, R: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``[R, D] -> [R]``: ``dsa_precision.exact_math._pairwise_sum`` (adjacent pairs, then pairs
    of those, ...), the same additions in the same order."""
    # A sum over a size-2 axis is exactly x[2i] + x[2i+1] (Triton's reductions start from the
    # first element, not from 0), and compiles to the same code as one tl.sum over D.
    for i in tl.static_range(LOG2_D):
        x = tl.sum(tl.reshape(x, (R, D >> (i + 1), 2)), axis=2)
    return tl.reshape(x, (R,))


@triton.jit
def _fma(a, b, c, HW: tl.constexpr):
    """float32 ``a * b + c`` rounded once: ``fma.rn.f32`` on the GPU; in the interpreter (whose
    fma rounds twice) ``dsa_precision.exact_math.fma_fp32``'s float64 sum rounded to odd."""
    if HW:
        return tl.fma(a, b, c)
    p = a.to(tl.float64) * b.to(tl.float64)
    c64 = c.to(tl.float64)
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)
    bits = s.to(tl.int64, bitcast=True)
    step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
    odd = tl.where((err != 0) & ((bits & 1) == 0), bits + step, bits)
    return odd.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _pair_sum(lo, hi, SQUARES: tl.constexpr, FMA: tl.constexpr, HW):
    """A tree's first step: ``lo + hi``, or with ``SQUARES`` ``lo * lo + hi * hi`` (under ``FMA``
    the lower element's multiply fused, ``fma(lo, lo, fl(hi * hi))``, as ptxas receives it)."""
    if SQUARES:
        if FMA:
            return _fma(lo, lo, hi * hi, HW)
        return lo * lo + hi * hi
    return lo + hi


@triton.jit
def _engine_block_sum(x, R: tl.constexpr, SQUARES: tl.constexpr, FMA: tl.constexpr, HW):
    """``[R, 128] -> [R]`` float32 sums (of ``x * x`` when ``SQUARES``) in the order of
    ``dsa_precision.exact_math._triton_block_sum``: pairs 16 apart (the squares' first step
    contracted under ``FMA``, the lower lane's multiply fused), then 8, 4, 2, 1 apart, then the
    four 32-lane partials 64 and 32 apart. A sum over a size-2 axis is one addition."""
    lo, hi = tl.split(tl.permute(tl.reshape(x, (R, 4, 2, 16)), (0, 1, 3, 2)))  # [R, 4, 16]
    v = _pair_sum(lo, hi, SQUARES, FMA, HW)
    for i in tl.static_range(4):  # 8, 4, 2, 1 apart within each 16-lane half
        v = tl.sum(tl.reshape(v, (R, 4, 2, 8 >> i)), axis=2)
    v = tl.reshape(v, (R, 4))
    v = tl.sum(tl.reshape(v, (R, 2, 2)), axis=1)  # warps 2 apart: (w0 + w2), (w1 + w3)
    return tl.sum(v, axis=1)


@triton.jit
def _inductor_block_sum(x, R: tl.constexpr, X8: tl.constexpr, SQUARES: tl.constexpr, FMA, HW):
    """``[R, 128] -> [R]`` float32 sums (of ``x * x`` when ``SQUARES``) in the order of
    ``dsa_precision.exact_math.inductor_block_sum``. ``X8 == False`` (XBLOCK 1): adjacent pairs
    (the squares' pair contracted under ``FMA``), then the 32 lane partials 16 ... 1 lanes apart,
    then the two warps. ``X8``: each 8 consecutive elements in turn (the squares ``fma(x0, x0,
    fl(x1 * x1))``, then ``fma(xi, xi, acc)``), then the 16 partials 8, 4, 2, 1 apart."""
    if X8:
        lo, hi = tl.split(tl.reshape(x, (R, 16, 2, 2, 2)))  # [R, 16, 2, 2]: index 4a + 2b + c
        e04, e26 = tl.split(lo)
        e15, e37 = tl.split(hi)
        x0, x4 = tl.split(e04)
        x2, x6 = tl.split(e26)
        x1, x5 = tl.split(e15)
        x3, x7 = tl.split(e37)
        if SQUARES:
            if FMA:
                v = _fma(x0, x0, x1 * x1, HW)
                v = _fma(x2, x2, v, HW)
                v = _fma(x3, x3, v, HW)
                v = _fma(x4, x4, v, HW)
                v = _fma(x5, x5, v, HW)
                v = _fma(x6, x6, v, HW)
                v = _fma(x7, x7, v, HW)
            else:
                v = x0 * x0 + x1 * x1
                v = ((((v + x2 * x2) + x3 * x3) + x4 * x4) + x5 * x5) + x6 * x6
                v = v + x7 * x7
        else:
            v = ((((((x0 + x1) + x2) + x3) + x4) + x5) + x6) + x7
        for i in tl.static_range(4):  # [R, 16]: partials 8, 4, 2, 1 apart
            v = tl.sum(tl.reshape(v, (R, 2, 8 >> i)), axis=1)
        return tl.reshape(v, (R,))
    lo, hi = tl.split(tl.reshape(x, (R, 64, 2)))  # [R, 64]: thread t holds 2t, 2t + 1
    v = _pair_sum(lo, hi, SQUARES, FMA, HW)
    for i in tl.static_range(5):  # [R, 2 warps, 32 lanes]: lanes 16, 8, 4, 2, 1 apart
        v = tl.sum(tl.reshape(v, (R, 2, 2, 16 >> i)), axis=2)
    return tl.sum(tl.reshape(v, (R, 2)), axis=1)


@triton.jit
def _warp_block_sum(
    x, R: tl.constexpr, SQUARES: tl.constexpr, FMA: tl.constexpr, HW, UP: tl.constexpr
):
    """``[R, 128] -> [R]`` float32 sums (of ``x * x`` when ``SQUARES``) in the order of
    ``dsa_precision.exact_math._warp_block_sum``: lane ``l`` holds elements ``4l .. 4l + 3`` and
    adds them in order (the squares from zero, a chain of fused multiply-adds under ``FMA``), then
    the 32 lane partials add 16, 8, 4, 2, 1 lanes apart (``UP``: 1, 2, 4, 8, 16 apart). A sum
    over a size-2 axis is one addition."""
    even, odd = tl.split(tl.reshape(x, (R, 32, 2, 2)))  # [R, 32, 2]: (x0, x2), (x1, x3)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    if SQUARES:
        v = x0 * x0
        if FMA:
            v = _fma(x1, x1, v, HW)
            v = _fma(x2, x2, v, HW)
            v = _fma(x3, x3, v, HW)
        else:
            v = ((v + x1 * x1) + x2 * x2) + x3 * x3
    else:
        v = ((x0 + x1) + x2) + x3
    for i in tl.static_range(5):
        if UP:  # lanes 1, 2, 4, 8, 16 apart
            v = tl.sum(tl.reshape(v, (R, 16 >> i, 2)), axis=2)
        else:  # lanes 16, 8, 4, 2, 1 apart
            v = tl.sum(tl.reshape(v, (R, 2, 16 >> i)), axis=1)
    return tl.reshape(v, (R,))


@triton.jit
def _hadamard(x, R: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unscaled Sylvester butterfly of ``[R, D]`` rows, stage by stage as
    ``dsa_precision.hadamard.hadamard_transform``: stage ``h = 1, 2, ..., D/2`` maps each block
    ``(a, b)`` of two ``h``-wide halves to ``(a + b, a - b)``."""
    for i in tl.static_range(LOG2_D):
        y = tl.permute(tl.reshape(x, (R, D >> (i + 1), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return x


@triton.jit
def _load_param(ptrs, KIND: tl.constexpr, F64: tl.constexpr):
    """A LayerNorm weight or bias as float64 (``F64``) or float32 values: stored as float64
    (``KIND == 1``), float32 (2) or BF16 as its int16 bit view (3), widened exactly (only a
    float64 parameter read as float32 rounds, as ``Tensor.to(torch.float32)`` does)."""
    if KIND == 3:
        v = (tl.load(ptrs).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptrs)
    if F64:  # one return: Triton 3.6 refuses returns of different types, even constexpr ones
        v = v.to(tl.float64)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _welford_step(mean, m2, mean_o, m2_o, weight, ratio, FMA, HW: tl.constexpr):
    """``exact_math._welford_step``: Inductor's ``welford_combine`` of ``(mean, m2)`` (count
    ``weight``) with ``(mean_o, m2_o)``, ``ratio`` the other's share of the count."""
    delta = mean_o - mean
    spread = (delta * delta) * weight
    if FMA:
        return _fma(ratio, delta, mean, HW), _fma(ratio, spread, m2 + m2_o, HW)
    return mean + ratio * delta, (m2 + m2_o) + ratio * spread


@triton.jit
def _welford_butterfly(mean, m2, BLOCK_R: tl.constexpr, S: tl.constexpr, COUNT, FMA, HW):
    """One butterfly step over the 32 lanes' ``[BLOCK_R, 32]`` states: lane ``l`` combines its
    own state with lane ``l ^ S``'s (its own first: the combine is not symmetric)."""
    G: tl.constexpr = 32 // (2 * S)
    m_lo, m_hi = tl.split(tl.permute(tl.reshape(mean, (BLOCK_R, G, 2, S)), (0, 1, 3, 2)))
    v_lo, v_hi = tl.split(tl.permute(tl.reshape(m2, (BLOCK_R, G, 2, S)), (0, 1, 3, 2)))
    half = tl.zeros_like(m_lo) + 0.5
    lo_m, lo_v = _welford_step(m_lo, v_lo, m_hi, v_hi, COUNT, half, FMA, HW)
    hi_m, hi_v = _welford_step(m_hi, v_hi, m_lo, v_lo, COUNT, half, FMA, HW)
    mean = tl.reshape(tl.permute(tl.join(lo_m, hi_m), (0, 1, 3, 2)), (BLOCK_R, 32))
    m2 = tl.reshape(tl.permute(tl.join(lo_v, hi_v), (0, 1, 3, 2)), (BLOCK_R, 32))
    return mean, m2


@triton.jit
def _welford_lane_stats(x, eps32, BLOCK_R: tl.constexpr, FMA, HW: tl.constexpr):
    """``exact_math.layer_norm_fp32_welford``'s statistics of ``x`` ``[BLOCK_R, 128]``: the
    mean and rstd of the lane holding each element, ``[BLOCK_R, 128]`` each."""
    e02, e13 = tl.split(tl.reshape(x, (BLOCK_R, 32, 2, 2)))  # lane l: x[4l .. 4l + 3]
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    zero = tl.zeros_like(e0)
    mean, m2 = _welford_step(e0, zero, e1, zero, 1.0, zero + 0.5, FMA, HW)
    mean, m2 = _welford_step(mean, m2, e2, zero, 2.0, zero + _ONE_THIRD, FMA, HW)
    mean, m2 = _welford_step(mean, m2, e3, zero, 3.0, zero + 0.25, FMA, HW)
    mean, m2 = _welford_butterfly(mean, m2, BLOCK_R, 16, 4.0, FMA, HW)
    mean, m2 = _welford_butterfly(mean, m2, BLOCK_R, 8, 8.0, FMA, HW)
    mean, m2 = _welford_butterfly(mean, m2, BLOCK_R, 4, 16.0, FMA, HW)
    mean, m2 = _welford_butterfly(mean, m2, BLOCK_R, 2, 32.0, FMA, HW)
    mean, m2 = _welford_butterfly(mean, m2, BLOCK_R, 1, 64.0, FMA, HW)
    rstd = tl.rsqrt(m2 * 0.0078125 + eps32)  # m2 / 128: exact; rsqrt.approx on the GPU
    mean = tl.reshape(tl.broadcast_to(mean[:, :, None], (BLOCK_R, 32, 4)), (BLOCK_R, 128))
    rstd = tl.reshape(tl.broadcast_to(rstd[:, :, None], (BLOCK_R, 32, 4)), (BLOCK_R, 128))
    return mean, rstd


@triton.jit
def _layer_norm_lanes(x, mean, denom, w_ptr, b_ptr, lanes, W: tl.constexpr, B: tl.constexpr):
    """``layer_norm_fp32`` at the given lanes: float64 ``(x - mean) / denom * w + b``, one
    rounding to float32 (``W`` / ``B``: the parameters' kinds, 0 for none)."""
    y = (x.to(tl.float64) - mean) / denom
    if W > 0:
        y = y * _load_param(w_ptr + lanes, W, True)
    if B > 0:
        y = y + _load_param(b_ptr + lanes, B, True)
    return y.to(tl.float32)


@triton.jit
def _layer_norm_ops_lanes(
    x, mean, rstd, w_ptr, b_ptr, lanes, W: tl.constexpr, B: tl.constexpr, FMA, HW
):
    """``layer_norm_fp32_ops`` at the given lanes: float32 ``((x - mean) * rstd) * w + b``, the
    last multiply-add fused under ``FMA`` (weights and bias read as float32)."""
    y = (x - mean) * rstd
    if W > 0 and B > 0 and FMA:
        return _fma(
            y, _load_param(w_ptr + lanes, W, False), _load_param(b_ptr + lanes, B, False), HW
        )
    if W > 0:
        y = y * _load_param(w_ptr + lanes, W, False)
    if B > 0:
        y = y + _load_param(b_ptr + lanes, B, False)
    return y


@triton.jit
def _preprocess_quantize_kernel(
    x_ptr,  # [S, B, H, D] (keys: H = 1), float32 or BF16 as int16; last dim contiguous
    x_stride_s,
    x_stride_b,
    x_stride_h,
    cos_ptr,  # [S, ROPE_DIM] contiguous, float32 or BF16 as int16 (the math dtype)
    sin_ptr,
    ln_w_ptr,  # [D] LayerNorm weight / bias (LAYER_NORM): float64, float32 or BF16 as int16
    ln_b_ptr,
    f64_ptr,  # float64 [LayerNorm eps, Hadamard scale]
    w_ptr,  # [S, B, H] head weights, float32 or BF16 as int16; last dim contiguous (FOLD_W)
    w_stride_s,
    w_stride_b,
    out_ptr,  # [B, S, H, D] uint8 (E4M3 bytes)
    scale_ptr,  # [B, S, H] float32 descales
    w_out_ptr,  # [B, S, H] float32 folded weights (FOLD_W)
    n_rows,  # S * B * H vectors
    batch,
    seq,
    n_heads,
    floor_bits,  # int32 bits of the float32 amax floor
    rcp_448,  # float32 1 / 448 (RATIO == 2)
    fold_c1,  # float32 scalars multiplied into the folded weights after the q descale
    fold_c2,
    fold_c3,
    eps32,  # float32 LayerNorm epsilon (LN_OPS)
    had32,  # float32 Hadamard scale (HAD_SCALE_F32)
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HADAMARD: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    LN_W: tl.constexpr,  # how ln_w_ptr holds the weight: 0 none, 1 float64, 2 float32, 3 BF16
    LN_B: tl.constexpr,  # the same for the bias
    X_BF16: tl.constexpr,
    BF16_MATH: tl.constexpr,
    LN_OUT_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    RATIO: tl.constexpr,  # 0 exact UE8M0, 1 fp32(a / 448), 2 fp32(a * fp32(1 / 448))
    LOG2_CEIL: tl.constexpr,
    FP32_SCALE: tl.constexpr,
    APPLY_RECIPROCAL: tl.constexpr,
    FOLD_W: tl.constexpr,
    W_BF16: tl.constexpr,
    LN_OPS: tl.constexpr,  # the LayerNorm float32 operation by operation: 1 Triton's tree
    # (layernorm="fp32-ops"), 2 a CUDA warp's ("fp32-warp"), 3 with its butterfly up
    # ("fp32-warp-up"), 4 Inductor's Welford reduction ("fp32-welford"), 5 / 6 its persistent
    # reduction, XBLOCK 1 / 8 ("fp32-inductor-x1" / "-x8"); 0 float64 once
    FMA: tl.constexpr,  # the engine's contracted multiply-adds
    FMA_SIN2: tl.constexpr,  # FMA fuses rotate_half(x) * sin on the second half (rope_fma)
    HAD_SCALE_F32: tl.constexpr,
    LANE_ORDER_IN: tl.constexpr,  # store the interleaved RoPE pairs back in their input lanes
    HW_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program: BLOCK_R vectors (rows), row r = (s * batch + b) * n_heads + h.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    h = (r % n_heads).to(tl.int64)
    token = r // n_heads
    s = (token // batch).to(tl.int64)
    b = (token % batch).to(tl.int64)

    # RoPE lane map (output order: the RoPE slice in rotate-half order, then the pass-through
    # lanes): out[j] = x[a(j)] * cos[j] + sign(j) * x[b(j)] * sin[j] on the slice, where b(j) is
    # the lane of the other half; the interleaved layout (MLA style) reads its (even, odd) pairs
    # de-interleaved. The non-interleaved offsets are lane + constant-per-32-lanes, which keeps
    # the loads vectorized.
    HALF: tl.constexpr = ROPE_DIM // 2
    lanes = tl.arange(0, D)[None, :]
    first = lanes < HALF
    rope_lane = lanes < ROPE_DIM
    if INTERLEAVED:
        lane_a = tl.where(first, 2 * lanes, tl.where(rope_lane, 2 * (lanes - HALF) + 1, lanes))
        lane_b = tl.where(first, 2 * lanes + 1, tl.where(rope_lane, 2 * (lanes - HALF), lanes))
    else:
        lane_a = lanes
        lane_b = lanes + tl.where(first, HALF, tl.where(rope_lane, -HALF, 0))
    sign = tl.where(first, -1.0, 1.0)  # rotate_half negates the first half

    row = x_ptr + (s * x_stride_s + b * x_stride_b + h * x_stride_h)[:, None]
    mask = r_ok[:, None]
    xa = _load_f32(row + lane_a, mask, X_BF16)  # [BLOCK_R, D]
    if ROPE_DIM > 0:
        xb = _load_f32(row + lane_b, mask, X_BF16)

    if LAYER_NORM and LN_OPS == 4:  # Inductor's Welford LayerNorm: statistics of each lane
        x32 = _load_f32(row + lanes, mask, X_BF16)
        mean, rstd = _welford_lane_stats(x32, eps32, BLOCK_R, FMA, HW_CAST)
        at_a = tl.broadcast_to(lane_a, (BLOCK_R, D))
        xa = _layer_norm_ops_lanes(
            xa, tl.gather(mean, at_a, 1), tl.gather(rstd, at_a, 1), ln_w_ptr, ln_b_ptr, lane_a,
            LN_W, LN_B, FMA, HW_CAST,
        )  # fmt: skip
        if ROPE_DIM > 0:
            at_b = tl.broadcast_to(lane_b, (BLOCK_R, D))
            xb = _layer_norm_ops_lanes(
                xb, tl.gather(mean, at_b, 1), tl.gather(rstd, at_b, 1), ln_w_ptr, ln_b_ptr,
                lane_b, LN_W, LN_B, FMA, HW_CAST,
            )  # fmt: skip
    elif LAYER_NORM and LN_OPS:  # the engines' float32 LayerNorm, operation by operation
        x32 = _load_f32(row + lanes, mask, X_BF16)
        if LN_OPS == 2 or LN_OPS == 3:  # a CUDA warp's sums (3: up); var / 128 + eps fused
            up: tl.constexpr = LN_OPS == 3
            mean = _warp_block_sum(x32, BLOCK_R, False, FMA, HW_CAST, up) * 0.0078125  # exact
            centered = x32 - mean[:, None]
            var = _warp_block_sum(centered, BLOCK_R, True, FMA, HW_CAST, up)
            if FMA:
                zero = tl.zeros_like(var)  # the scalars as [R] tensors (exact: 0 + v)
                var_eps = _fma(var, zero + 0.0078125, zero + eps32, HW_CAST)
            else:
                var_eps = var * 0.0078125 + eps32
        elif LN_OPS >= 5:  # Inductor's persistent reduction (6: XBLOCK 8 or 32)
            x8: tl.constexpr = LN_OPS == 6
            mean = _inductor_block_sum(x32, BLOCK_R, x8, False, FMA, HW_CAST) / 128.0  # exact
            centered = x32 - mean[:, None]
            var = _inductor_block_sum(centered, BLOCK_R, x8, True, FMA, HW_CAST) / 128.0
            var_eps = var + eps32
        else:  # Triton's tl.sum tree
            mean = _engine_block_sum(x32, BLOCK_R, False, FMA, HW_CAST) / 128.0  # exact: 2**-7
            centered = x32 - mean[:, None]
            var = _engine_block_sum(centered, BLOCK_R, True, FMA, HW_CAST) / 128.0
            var_eps = var + eps32
        rstd = tl.rsqrt(var_eps)[:, None]  # rsqrt.approx on the GPU, as the engines
        mean = mean[:, None]
        xa = _layer_norm_ops_lanes(
            xa, mean, rstd, ln_w_ptr, ln_b_ptr, lane_a, LN_W, LN_B, FMA, HW_CAST
        )
        if ROPE_DIM > 0:
            xb = _layer_norm_ops_lanes(
                xb, mean, rstd, ln_w_ptr, ln_b_ptr, lane_b, LN_W, LN_B, FMA, HW_CAST
            )
    elif LAYER_NORM:  # the rope_fp32 key LayerNorm (float32 out), at both lane maps
        x64 = _load_f32(row + lanes, mask, X_BF16).to(tl.float64)
        mean = _pairwise_sum(x64, BLOCK_R, D, LOG2_D) / D
        centered = x64 - mean[:, None]
        var = _pairwise_sum(centered * centered, BLOCK_R, D, LOG2_D) / D
        denom = tl.sqrt(var + tl.load(f64_ptr))[:, None]  # float64: IEEE square root
        mean = mean[:, None]
        xa = _layer_norm_lanes(xa, mean, denom, ln_w_ptr, ln_b_ptr, lane_a, LN_W, LN_B)
        if ROPE_DIM > 0:
            xb = _layer_norm_lanes(xb, mean, denom, ln_w_ptr, ln_b_ptr, lane_b, LN_W, LN_B)
    if LAYER_NORM:
        if LN_OUT_BF16:  # an engine that rounds the LayerNorm output to BF16
            xa = _round_bf16(xa, HW_CAST)
            if ROPE_DIM > 0:
                xb = _round_bf16(xb, HW_CAST)

    if ROPE_DIM > 0:
        table = s[:, None] * ROPE_DIM + lanes  # [S, ROPE_DIM] rows; lanes past it are masked
        table_mask = mask & rope_lane
        cos = _load_f32(cos_ptr + table, table_mask, BF16_MATH)
        sin = _load_f32(sin_ptr + table, table_mask, BF16_MATH)
        rot = xb * sign  # rotate_half: an exact negation
        if BF16_MATH:  # each product and the sum rounded to BF16, as torch's BF16 ops do
            y = _round_bf16(
                _round_bf16(xa * cos, HW_CAST) + _round_bf16(rot * sin, HW_CAST), HW_CAST
            )
        elif FMA and FMA_SIN2:  # the first half fma(x, cos, fl(rot * sin)), the second
            # fma(rot, sin, fl(x * cos)) (nvcc's contraction of a complex product)
            y = tl.where(
                first, _fma(xa, cos, rot * sin, HW_CAST), _fma(rot, sin, xa * cos, HW_CAST)
            )
        elif FMA:  # float32, the engine's contraction: fma(x, cos, fl(rot * sin))
            y = _fma(xa, cos, rot * sin, HW_CAST)
        else:  # float32; the launch disables FMA contraction
            y = xa * cos + rot * sin
        y = tl.where(rope_lane, y, xa)
    else:  # quantization only (preprocessed carriers)
        y = xa
    if OUT_BF16:  # an engine that rounds q or k to BF16 after RoPE
        y = _round_bf16(y, HW_CAST)

    if HADAMARD:
        y64 = _hadamard(y.to(tl.float64), BLOCK_R, D, LOG2_D)
        if HAD_SCALE_F32:  # the sums rounded to float32, times fl32(D**-0.5) in float32
            y = y64.to(tl.float32) * had32
        else:  # float64 -> float32 (-> BF16): torch converts float64 to BF16 through float32 too
            y = (y64 * tl.load(f64_ptr + 1)).to(tl.float32)
        if OUT_BF16:
            y = _round_bf16(y, HW_CAST)

    # The descale of a = max(amax, floor), taken from the float32 bits (the amax is an integer
    # max over the magnitude bits: order-free, NaN-proof).
    mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = tl.max(mag, axis=1) >= 0x7F800000  # a NaN or Inf in the vector (bits above +Inf: NaN)
    a = tl.maximum(tl.max(mag, axis=1), floor_bits)
    if RATIO == 0:
        # Exact UE8M0: a = m * 2**E, m in [0.5, 1), E = biased exponent - 126; the smallest
        # admissible e is E - 8 if m > 0.875 (mantissa bits > 0x600000) else E - 9.
        e = (a >> 23) - 126 - tl.where((a & 0x7FFFFF) > 0x600000, 8, 9)
    else:
        af = a.to(tl.float32, bitcast=True)
        if RATIO == 1:
            r = tl.math.div_rn(af, 448.0)  # IEEE division
        else:
            r = af * rcp_448  # fp32(1 / 448)
        rb = r.to(tl.int32, bitcast=True)
        e = (rb >> 23) - 127
        m = rb & 0x7FFFFF
        if LOG2_CEIL:  # exp2(ceil(log2(r))) with a correctly rounded float32 log2
            k = tl.abs(e) - (e < 0).to(tl.int32)
            binade = (
                (k >= 2).to(tl.int32) + (k >= 4).to(tl.int32) + (k >= 8).to(tl.int32)
                + (k >= 16).to(tl.int32) + (k >= 32).to(tl.int32) + (k >= 64).to(tl.int32)
            )  # fmt: skip
            band = tl.where(
                binade == 2,
                1,
                tl.where(
                    binade == 3,
                    2,
                    tl.where(
                        binade == 4, 5, tl.where(binade == 5, 11, tl.where(binade == 6, 22, 0))
                    ),
                ),
            )  # fmt: skip  (quantize.LOG2_CEIL_BAND)
            e = e + (m > band).to(tl.int32)
        else:  # the exact ceiling
            e = e + (m != 0).to(tl.int32)
    nan = tl.full((BLOCK_R,), _FLOAT32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    if FP32_SCALE:
        descale = tl.where(bad, nan, r)
        if APPLY_RECIPROCAL:
            v = y * tl.math.div_rn(1.0, r)[:, None]
        else:
            v = tl.math.div_rn(y, r[:, None])
    else:
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e: exact, and so is y * inv
        descale = tl.where(bad, nan, ((e + 127) << 23).to(tl.float32, bitcast=True))
        v = y * inv[:, None]
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)  # saturate (only the rounded rules reach it)
    codes = tl.where(bad[:, None], _E4M3_NAN_BITS, _e4m3_codes(v, HW_CAST))

    out_row = (b * seq + s) * n_heads + h  # BSHD
    # The output's lanes: the RoPE slice in rotate-half order, or (LANE_ORDER_IN) each value in
    # the lane its input came from (lane_a: the engines' order of interleaved pairs); the
    # descale is the same (an amax is order-free), so this is a permutation of the bytes.
    out_lanes = lane_a if LANE_ORDER_IN else lanes
    tl.store(out_ptr + out_row[:, None] * D + out_lanes, codes.to(tl.uint8), mask)
    tl.store(scale_ptr + out_row, descale, r_ok)
    if FOLD_W:  # w' = (((fp32(w) * q_descale) * c1) * c2) * c3, float32
        w = _load_f32(w_ptr + s * w_stride_s + b * w_stride_b + h, r_ok, W_BF16)
        tl.store(w_out_ptr + out_row, (((w * descale) * fold_c1) * fold_c2) * fold_c3, r_ok)


# Default launch shape: 8 vectors per program over 2 warps, the fastest shape of
# tools/tune_prepare.py on the H200 at S=16384, H=64 (docs/benchmarks.md); every row stays inside
# one warp, so the butterfly and the amax never cross warps. Any shape gives the same bits.
BLOCK_ROWS = 8
NUM_WARPS = 2


def _float64_constants(eps: float, d: int, device: torch.device) -> torch.Tensor:
    """``[eps, d**-0.5]`` float64 on ``device``, built once (:func:`_device_constant`)."""
    return _device_constant((eps, d**-0.5), torch.float64, device)


def _float32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """BF16 data as its int16 bit view (see ``_load_f32``); float32 as is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def preprocess_quantize(
    x: torch.Tensor,
    rules: PreprocessRules,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    layer_norm: tuple[torch.Tensor | None, torch.Tensor | None, float] | None = None,
    weights: torch.Tensor | None = None,
    fold_scales: tuple[float, ...] = (),
    block_rows: int = BLOCK_ROWS,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Preprocess and quantize Megatron-layout vectors into BSHD FP8 operands.

    Args:
        x: ``[S, B, H, 128]`` queries or ``[S, B, 128]`` keys (``H = 1``), BF16 or float32, on
            CUDA; the last dimension contiguous. Keys take ``rules.k_quant`` and
            ``rules.k_out_bf16``, queries the ``q_`` rules.
        rules: the arithmetic (:class:`~dsa_precision.kernels.rules.PreprocessRules`); its
            quantization floors at least :data:`_MIN_AMAX_FLOOR` once rounded to float32.
        cos, sin: ``[S, rope_dim]`` RoPE tables from :func:`dsa_precision.rope.rope_tables` in
            ``rules.math_dtype``; unused when ``rules.rope_dim == 0``.
        layer_norm: ``(weight, bias, eps)`` of the ``rope_fp32`` key LayerNorm (``weight``
            already ``zero_centered_gamma``-adjusted; either may be ``None``), applied first.
        weights: ``[S, B, H]`` head weights (BF16 or float32) to fold the q descale into.
        fold_scales: up to three float32 scalars multiplied into the folded weights, in order,
            after the descale (a multiplication by 1.0 is exact).
        block_rows, num_warps: launch shape (vectors per program, warps per program); every
            shape gives the same bits (tools/tune_prepare.py picks the fastest).

    Returns:
        ``(x_fp8 [B, S, H, 128] float8_e4m3fn, descale [B, S, H] float32, folded weights
        [B, S, H] float32 or None)``, contiguous; keys come back as ``[B, S, 1, 128]`` and
        ``[B, S, 1]``.
    """
    keys = x.ndim == 3
    x4 = x.unsqueeze(2) if keys else x
    n_seq, batch, n_heads, d = x4.shape
    if d != _HEAD_DIM:
        raise ValueError(f"expected 128-wide vectors, got {tuple(x.shape)}")
    if x4.stride(3) != 1:
        x4 = x4.contiguous()
    rope_dim = rules.rope_dim
    if rope_dim and (cos is None or sin is None or cos.shape[-1] != rope_dim):
        raise ValueError(f"rope_dim={rope_dim} needs cos and sin tables [S, {rope_dim}].")
    rule = rules.k_quant if keys else rules.q_quant
    out_bf16 = rules.k_out_bf16 if keys else rules.q_out_bf16
    ln_out_bf16 = rules.ln_out_bf16 and layer_norm is not None
    ln_w, ln_b, eps = layer_norm if layer_norm is not None else (None, None, 0.0)
    device = x.device
    consts = _float64_constants(float(eps), d, device)
    ln_w, w_kind = _layer_norm_param(ln_w, device, consts)
    ln_b, b_kind = _layer_norm_param(ln_b, device, consts)
    scalars, constexprs = _launch_constants(
        rule, tuple(fold_scales), float(eps), d,
        (rope_dim, rules.interleaved, rules.hadamard, layer_norm is not None, w_kind, b_kind,
         x.dtype == torch.bfloat16, rules.bf16_math, ln_out_bf16, out_bf16, weights is not None,
         weights is not None and weights.dtype == torch.bfloat16,
         _LN_ARITH[rules.layer_norm], rules.fma, rules.fma and rules.rope_fma == "cos-sin",
         rules.hadamard_scale_fp32, block_rows, num_warps, not interpreting(),
         rules.input_lane_order),
    )  # fmt: skip
    out = torch.empty((batch, n_seq, n_heads, d), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((batch, n_seq, n_heads), dtype=torch.float32, device=device)
    w_out = None
    if weights is not None:
        if weights.stride(-1) != 1:
            weights = weights.contiguous()
        w_out = torch.empty_like(scale)
    n_rows = n_seq * batch * n_heads
    grid = (-(-n_rows // block_rows),)  # ceil (triton.cdiv is a slower jit-aware call)
    if not rope_dim:
        cos = sin = consts  # never read
    assert cos is not None and sin is not None  # checked above when rope_dim
    w_arg = weights if weights is not None else scale
    _preprocess_quantize_kernel[grid](
        _bits_view(x4),
        x4.stride(0),
        x4.stride(1),
        x4.stride(2),
        _bits_view(cos.contiguous()),
        _bits_view(sin.contiguous()),
        ln_w,
        ln_b,
        consts,
        _bits_view(w_arg),
        w_arg.stride(0),
        w_arg.stride(1),
        out.view(torch.uint8),
        scale,
        w_out if w_out is not None else scale,
        n_rows,
        batch,
        n_seq,
        n_heads,
        *scalars,
        **constexprs,
    )
    return out, scale, w_out


def _layer_norm_param(
    t: torch.Tensor | None, device: torch.device, consts: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """A LayerNorm weight or bias as the kernel reads it, and its kind (``LN_W`` / ``LN_B``):
    float64, float32 or BF16 (as int16 bits) on ``device`` as it is, widened in the kernel; any
    other dtype, device or layout as a float64 copy; ``None`` as kind 0 (``consts``, unread)."""
    if t is None:
        return consts, 0
    if t.device == device and t.is_contiguous():
        kind = _PARAM_KINDS.get(t.dtype)
        if kind is not None:
            return _bits_view(t), kind  # read only: no autograd involved
    return t.detach().to(device=device, dtype=torch.float64).contiguous(), 1


_PARAM_KINDS = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3}
# The kernel's LN_OPS for each LayerNorm arithmetic (EngineProfile.layernorm).
_LN_ARITH = {
    "float64": 0,
    "fp32-ops": 1,
    "fp32-warp": 2,
    "fp32-warp-up": 3,
    "fp32-welford": 4,
    "fp32-inductor-x1": 5,
    "fp32-inductor-x8": 6,
}


@functools.lru_cache(maxsize=256)
def _launch_constants(
    rule: Fp8Rule, fold_scales: tuple[float, ...], eps: float, d: int, flags: tuple
) -> tuple[tuple[int | float, ...], dict[str, object]]:
    """The scalar arguments after ``n_heads`` and the compile-time arguments of one launch, for
    these Python values (built once per combination: host time per launch). Raises for a floor
    or a fold the kernel cannot take."""
    (rope_dim, interleaved, hadamard, layer_norm, w_kind, b_kind, x_bf16, bf16_math, ln_out_bf16,
     out_bf16, fold_w, w_bf16, layer_norm_ops, fma, fma_sin2, hadamard_scale_fp32, block_rows,
     num_warps, hw_cast, input_lane_order) = flags  # fmt: skip
    floor32 = _f32(float(rule.amax_floor))
    if not _MIN_AMAX_FLOOR <= floor32 < float("inf"):
        raise ValueError(f"amax_floor={rule.amax_floor!r} is outside [2**-100, float32 max].")
    if len(fold_scales) > 3:
        raise ValueError(f"fold_scales takes at most three scalars, got {fold_scales}.")
    c1, c2, c3 = (*fold_scales, 1.0, 1.0, 1.0)[:3]
    scalars = (
        _float32_bits(floor32),
        _f32(1.0 / 448.0),
        _f32(c1),  # torch multiplies float32 tensors by float32 scalars too
        _f32(c2),
        _f32(c3),
        _f32(eps),
        _f32(d**-0.5),
    )
    constexprs = dict(
        D=d,
        LOG2_D=_LOG2_HEAD_DIM,
        ROPE_DIM=rope_dim,
        INTERLEAVED=interleaved,
        HADAMARD=hadamard,
        LAYER_NORM=layer_norm,
        LN_W=w_kind,
        LN_B=b_kind,
        X_BF16=x_bf16,
        BF16_MATH=bf16_math,
        LN_OUT_BF16=ln_out_bf16,
        OUT_BF16=out_bf16,
        RATIO={"exact": 0, "divide": 1, "reciprocal": 2}[rule.scale_ratio],
        LOG2_CEIL=rule.ue8m0_ceil == "log2",
        FP32_SCALE=rule.scale_format == "fp32",
        APPLY_RECIPROCAL=rule.scale_apply == "reciprocal",
        FOLD_W=fold_w,
        W_BF16=w_bf16,
        LN_OPS=layer_norm_ops,
        FMA=fma,
        FMA_SIN2=fma_sin2,
        HAD_SCALE_F32=hadamard_scale_fp32,
        LANE_ORDER_IN=input_lane_order,
        HW_CAST=hw_cast,
        BLOCK_R=block_rows,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return scalars, constexprs
