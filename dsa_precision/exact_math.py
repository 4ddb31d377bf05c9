"""Emulated float32 arithmetic: the exact operations the engine profiles name.

Each function fixes an order or a rounding that ``torch``'s own kernels leave to the device, so
that the torch reference, the fused Triton kernel and an engine's kernel agree bit for bit on
every device: a fused multiply-add rounded once (:func:`fma_fp32`), sums in a fixed tree
(:func:`_pairwise_sum`, :func:`_triton_block_sum`), and the key LayerNorm evaluated in float64
rounded once (:func:`layer_norm_fp32`) or float32 operation by operation as the engines' Triton
kernels do (:func:`layer_norm_fp32_ops`), SGLang's CUDA kernel does (:func:`_layer_norm_fp32_warp`)
or Inductor's Welford kernel does (:func:`layer_norm_fp32_welford`; its persistent kernel:
:func:`layer_norm_fp32_ops` with :func:`inductor_block_sum`). Why each order is the
engine's: docs/numerics.md,
"The engines' float32 arithmetic".
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from .devices import _device_constant

__all__ = [
    "InductorBlock",
    "fma_fp32",
    "inductor_block_sum",
    "layer_norm_fp32",
    "layer_norm_fp32_ops",
    "layer_norm_fp32_welford",
    "rsqrt_fp32",
]


class _Fma32(torch.autograd.Function):
    """Exact float32 fused multiply-add; the gradient of ``a * b + c``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.shapes = (a.shape, b.shape, c.shape)
        a64, b64, c64 = a.double(), b.double(), c.double()
        p = a64 * b64  # exact
        s = p + c64
        bp = s - p
        err = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + err is exact
        bits = s.view(torch.int64)
        # Round to odd: inexact with an even last bit -> one ulp toward the exact value.
        step = torch.where((err > 0) == (s > 0), 1, -1)
        odd = torch.where((err != 0) & (bits & 1 == 0), bits + step, bits)
        return odd.view(torch.float64).to(torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        sa, sb, sc = ctx.shapes
        return (grad * b).sum_to_size(sa), (grad * a).sum_to_size(sb), grad.sum_to_size(sc)


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors with one rounding (a fused multiply-add, ``fma.rn.f32``).

    Computed in float64, where ``a * b`` is exact, with the sum rounded to odd (the float64 sum,
    its error recovered by TwoSum, the last bit forced odd when inexact); rounding that to float32
    is then the correctly rounded result. The same bits on every device; broadcasts;
    differentiable (the gradient of ``a * b + c``).
    """
    a, b, c = torch.broadcast_tensors(a, b, c)
    return _Fma32.apply(a, b, c)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in a fixed order, keeping it (size 1).

    For a power-of-two width the order is a tree of adjacent pairs: ``x[2i] + x[2i+1]``, then
    the same on the results, and so on. Unlike ``torch.sum``, whose order depends on the device,
    the memory layout and the kernel, this order is part of the definition, so a fused kernel can
    reproduce every rounding. Other widths fall back to ``torch.sum`` (order unspecified).
    """
    n = x.shape[-1]
    if n == 0 or n & (n - 1):
        return x.sum(dim=-1, keepdim=True)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def layer_norm_fp32(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of ``x`` ``[..., d]`` over the last dimension, float32 out.

    Statistics and the affine map are evaluated in float64 from the exact values of ``x``,
    ``weight`` and ``bias`` and rounded to float32 once. The sums of the mean and the variance
    run in the fixed order of :func:`_pairwise_sum` (the sum of squares is not exact in float64,
    so a device-chosen reduction order would leak into the last float32 bit once in ~2**29
    values): the result is the same on every device, and a fused kernel reproduces it bit for bit.
    Differentiable.
    """
    d = x.shape[-1]
    x64 = x.to(torch.float64)
    mean = _pairwise_sum(x64) / d
    centered = x64 - mean
    var = _pairwise_sum(centered * centered) / d
    y = centered / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


# Triton's tl.sum over one 128-vector laid out one element per thread on 4 warps (vLLM's
# fused_norm_rope and LMDeploy's k-cache kernel, num_warps=4): a butterfly over the lanes
# (shfl.bfly 16, 8, 4, 2, 1: element distances 16 ... 1), then over the 4 warp partials read back
# from shared memory (xor 2, 1: distances 64, 32). Each step adds elements this far apart.
_TRITON_SUM_DISTANCES_128 = (16, 8, 4, 2, 1, 64, 32)


def _pair_step(x: torch.Tensor, distance: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of one tree step over the last dimension: the elements whose index has
    the bit ``distance`` clear, and their partners ``distance`` further on."""
    n = x.shape[-1]
    y = x.reshape(*x.shape[:-1], n // (2 * distance), 2, distance)
    flat = (*x.shape[:-1], n // 2)
    return y[..., 0, :].reshape(flat), y[..., 1, :].reshape(flat)


def _tree_distances(distances: tuple[int, ...]) -> list[int]:
    """The distances of the same tree after each step removed its index bit (what a reshape of
    the shrinking tensor needs)."""
    out: list[int] = []
    removed: list[int] = []
    for d in distances:
        bit = d.bit_length() - 1
        out.append(1 << (bit - sum(r < bit for r in removed)))
        removed.append(bit)
    return out


def _tree_add(x: torch.Tensor, distances: list[int]) -> torch.Tensor:
    """Add the pairs of each step of :func:`_tree_distances`' reshaped tree, step by step."""
    for d in distances:
        lo, hi = _pair_step(x, d)
        x = lo + hi
    return x


def _check_width(x: torch.Tensor, caller: str) -> None:
    """The block sums model 128-wide vectors (the indexer's head dimension)."""
    if x.shape[-1] != 128:
        raise ValueError(f"{caller} takes 128-wide vectors, got shape {tuple(x.shape)}.")


def _triton_block_sum(
    x: torch.Tensor,
    *,
    squares_of: torch.Tensor | None = None,
    fma: bool = False,
    distances: tuple[int, ...] = _TRITON_SUM_DISTANCES_128,
) -> torch.Tensor:
    """float32 sum over the last dimension (128) in the order of ``distances`` (a tree: each
    step adds the elements that far apart; default :data:`_TRITON_SUM_DISTANCES_128`).

    ``squares_of=d``: the sum of ``d * d`` (``x`` unused); with ``fma`` its first step is what a
    contracting compiler emits, ``fma(d_i, d_i, fl(d_j * d_j))`` for the lower element ``i`` of
    each pair ``(i, j)``. Returns ``[..., 1]``.
    """
    src = x if squares_of is None else squares_of
    _check_width(src, "_triton_block_sum")
    if sorted(distances) != [1 << i for i in range(7)]:
        raise ValueError(
            f"distances={distances!r} must order the powers of two 1 ... 64, each once."
        )
    steps = _tree_distances(distances)
    if squares_of is not None:
        lo, hi = _pair_step(squares_of, steps[0])
        x = fma_fp32(lo, lo, hi * hi) if fma else lo * lo + hi * hi
        steps = steps[1:]
    return _tree_add(x, steps)


# Inductor's persistent LayerNorm reduction (read from torch 2.11's kernel compiled by Triton 3.6
# for Hopper, and Triton 3.7.1 compiles its form alike; 2 warps, the block [XBLOCK, 128] of BF16
# loads vectorised): with XBLOCK 1 each thread holds two adjacent
# elements (sizePerThread [1, 2] on 32 x 2 threads): their pair, then the lanes 32 ... 2 elements
# apart, then the two warps 64 apart.
_INDUCTOR_SUM_DISTANCES_X1 = (1, 32, 16, 8, 4, 2, 64)
# With XBLOCK 8 or 32 (sizePerThread [1, 8], 16 lanes a row): a thread's eight consecutive
# elements in turn, then the 16 lanes' partials 64, 32, 16, 8 elements apart.
_INDUCTOR_X8_LANE_DISTANCES = (8, 4, 2, 1)

# The persistent reductions Inductor's autotuner chooses among (XBLOCK 1, 8 or 32; 8 and 32 add
# alike): docs/numerics.md, section 8.4.
InductorBlock = Literal[1, 8]


def inductor_block_sum(
    x: torch.Tensor,
    *,
    xblock: InductorBlock,
    squares_of: torch.Tensor | None = None,
    fma: bool = False,
) -> torch.Tensor:
    """float32 sum over the last dimension (128) as Inductor's persistent reduction adds it
    (``tl.sum`` of a ``[XBLOCK, 128]`` block on 2 warps; ``xblock=8`` stands for 8 and 32).

    ``xblock=1``: :func:`_triton_block_sum` in the order of :data:`_INDUCTOR_SUM_DISTANCES_X1`.
    ``xblock=8``: each thread's eight consecutive elements in turn, ``((x0 + x1) + x2) + ...``,
    then the 16 partials 8, 4, 2, 1 apart. ``squares_of=d``: the sum of ``d * d`` (``x`` unused);
    under ``fma`` as the PTX contracts it: ``fma(d0, d0, fl(d1 * d1))``, then ``fma(di, di, acc)``
    (``xblock=1``: the pair's ``fma(d0, d0, fl(d1 * d1))``). Returns ``[..., 1]``.
    """
    if xblock == 1:
        return _triton_block_sum(
            x, squares_of=squares_of, fma=fma, distances=_INDUCTOR_SUM_DISTANCES_X1
        )
    if xblock != 8:
        raise ValueError(f"xblock={xblock!r} must be 1 or 8 (8 stands for 8 and 32).")
    src = x if squares_of is None else squares_of
    _check_width(src, "inductor_block_sum")
    threads = src.to(torch.float32).reshape(*src.shape[:-1], 16, 8)
    e = [threads[..., i] for i in range(8)]
    if squares_of is None:
        acc = e[0]
        for v in e[1:]:
            acc = acc + v
    elif fma:
        acc = fma_fp32(e[0], e[0], e[1] * e[1])
        for v in e[2:]:
            acc = fma_fp32(v, v, acc)
    else:
        acc = e[0] * e[0]
        for v in e[1:]:
            acc = acc + v * v
    return _tree_add(acc, _tree_distances(_INDUCTOR_X8_LANE_DISTANCES))


def rsqrt_fp32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / sqrt(x)`` as the engines' Triton kernels get it: on CUDA ``torch.rsqrt``
    (the hardware's ``rsqrt.approx``, as Triton's ``tl.rsqrt``); elsewhere the IEEE square
    root and the IEEE division (what Triton's interpreter computes). The square root is taken in
    float64 and rounded, the correctly rounded float32 root (torch 2.14's CPU ``sqrt`` of float32
    is not: it misses by an ulp in about 20 % of values)."""
    if x.is_cuda:
        return torch.rsqrt(x)
    return 1.0 / torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _affine_fp32(
    y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, fma: bool
) -> torch.Tensor:
    """The LayerNorm's float32 affine map ``fl(fl(y * w) + b)``, or ``fma(y, w, b)`` under ``fma``
    (weight and bias read as float32)."""
    w = None if weight is None else weight.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32)
    if w is not None and b is not None and fma:
        return fma_fp32(y, w, b)
    if w is not None:
        y = y * w
    return y if b is None else y + b


def layer_norm_fp32_ops(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    fma: bool,
    inductor_xblock: InductorBlock | None = None,
) -> torch.Tensor:
    """The key LayerNorm float32 operation by operation, as vLLM 0.33's ``fused_norm_rope`` and
    LMDeploy 0.18's k-cache kernel evaluate it (``x``: ``[..., 128]``; float32 out)::

        mean = fl(tree_sum(x) / 128);  d = fl(x - mean)
        var = fl(tree_sum(d * d) / 128);  rstd = rsqrt(fl(var + fl32(eps)))
        y = fl(fl(fl(d * rstd) * w) + b)      (fma: fma(fl(d * rstd), w, b))

    ``tree_sum`` is :func:`_triton_block_sum` (the first step of the variance contracted under
    ``fma``), or with ``inductor_xblock`` :func:`inductor_block_sum` (Inductor's persistent
    reduction of ``F.layer_norm``, the same operations: vLLM 0.26-0.28's compiled key at small
    compile sizes); ``rsqrt`` as :func:`rsqrt_fp32`. Differentiable.
    """
    x = x.to(torch.float32)
    if inductor_xblock is None:
        block_sum = _triton_block_sum
    else:
        block_sum = functools.partial(inductor_block_sum, xblock=inductor_xblock)
    mean = block_sum(x) / 128.0
    d = x - mean
    var = block_sum(d, squares_of=d, fma=fma) / 128.0
    eps32 = _device_constant(float(eps), torch.float32, x.device)
    return _affine_fp32(d * rsqrt_fp32(var + eps32), weight, bias, fma)


# A warp's butterfly over its 32 lanes (shfl.bfly 16, 8, 4, 2, 1): lanes this far apart add.
_WARP_LANE_DISTANCES = (16, 8, 4, 2, 1)


def _warp_block_sum(
    x: torch.Tensor,
    *,
    squares_of: torch.Tensor | None = None,
    fma: bool = False,
    butterfly_up: bool = False,
) -> torch.Tensor:
    """float32 sum over the last dimension (128) as one CUDA warp sums a vector whose lane ``l``
    holds the four consecutive elements ``4l .. 4l + 3`` (SGLang's ``warp::reduce_sum``): each
    lane adds its elements in order, ``((x0 + x1) + x2) + x3``, then the lanes' partials add in
    the butterfly 16, 8, 4, 2, 1 lanes apart (``butterfly_up``: 1, 2, 4, 8, 16 apart, as
    FlashInfer's CuTe DSL ``row_reduce_sum``).

    ``squares_of=d``: the sum of ``d * d`` (``x`` unused), each lane accumulating from zero,
    ``v = fl(v + fl(d_i * d_i))``, or with ``fma`` the chain ``v = fma(d_i, d_i, v)`` a contracting
    compiler emits. Returns ``[..., 1]``.
    """
    src = x if squares_of is None else squares_of
    _check_width(src, "_warp_block_sum")
    lanes = src.to(torch.float32).reshape(*src.shape[:-1], 32, 4)
    e = [lanes[..., i] for i in range(4)]
    if squares_of is None:
        v = ((e[0] + e[1]) + e[2]) + e[3]
    else:
        v = e[0] * e[0]
        for sq in e[1:]:
            v = fma_fp32(sq, sq, v) if fma else v + sq * sq
    distances = _WARP_LANE_DISTANCES[::-1] if butterfly_up else _WARP_LANE_DISTANCES
    return _tree_add(v, _tree_distances(distances))


def _layer_norm_fp32_warp(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    fma: bool,
    butterfly_up: bool = False,
) -> torch.Tensor:
    """The key LayerNorm float32 operation by operation, as SGLang 0.5.23's fused key kernel
    (``fused_k_indexer_norm_rope_store``, one warp per vector) evaluates it as nvcc compiles it
    (``x``: ``[..., 128]``; float32 out); ``butterfly_up``: the warp's sums the other way round,
    as FlashInfer 0.7.2's CuTe DSL LayerNorm (SGLang's unfused path) evaluates it::

        mean = warp_sum(x) * 2**-7;  d = fl(x - mean)
        rstd = rsqrt(fma(warp_sum(d * d), 2**-7, fl32(eps)))    (no fma: fl(fl(. * 2**-7) + eps))
        y = fma(fl(d * rstd), w, b)                              (no fma: fl(fl(fl(d * rstd) * w) + b))

    ``warp_sum`` is :func:`_warp_block_sum` (its squares a chain of fused multiply-adds under
    ``fma``); ``rsqrt`` as :func:`rsqrt_fp32` (``rsqrtf`` is the hardware's ``MUFU.RSQ``, as
    ``rsqrt.approx``). Differentiable.
    """
    x = x.to(torch.float32)
    mean = _warp_block_sum(x, butterfly_up=butterfly_up) * 2.0**-7  # exact: one rounding in d
    d = x - mean
    squares = _warp_block_sum(d, squares_of=d, fma=fma, butterfly_up=butterfly_up)
    eps32 = _device_constant(float(eps), torch.float32, x.device)
    var_eps = (
        fma_fp32(squares, torch.full_like(squares, 2.0**-7), eps32)
        if fma
        else (squares * 2.0**-7 + eps32)
    )
    return _affine_fp32(d * rsqrt_fp32(var_eps), weight, bias, fma)


# Triton's div.full.f32 of 1 by 3, the one inexact weight ratio of Inductor's Welford LayerNorm
# (the others are powers of two); measured on the H100 (docs/numerics.md, section 8.4).
_DIV_FULL_ONE_THIRD = 0.3333333432674408


def _welford_step(
    state: tuple[torch.Tensor, torch.Tensor],
    other: tuple[torch.Tensor, torch.Tensor],
    weight: float,
    ratio: torch.Tensor,
    fma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inductor's ``welford_combine`` of ``state`` (count ``weight``) with ``other``, as Triton
    compiles it: ``ratio`` is ``w_other / (weight + w_other)``; ``delta = fl(m' - m)``,
    ``mean = fma(ratio, delta, m)``, ``m2 = fma(ratio, fl(weight * fl(delta * delta)),
    fl(m2 + m2'))`` (no ``fma``: each product and sum rounded)."""
    (mean, m2), (mean_o, m2_o) = state, other
    delta = mean_o - mean
    spread = (delta * delta) * weight
    if fma:
        return fma_fp32(ratio, delta, mean), fma_fp32(ratio, spread, m2 + m2_o)
    return mean + ratio * delta, (m2 + m2_o) + ratio * spread


def layer_norm_fp32_welford(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    fma: bool,
    one_third: float = _DIV_FULL_ONE_THIRD,
) -> torch.Tensor:
    """The key LayerNorm as Inductor compiles ``F.layer_norm`` of a float32 ``[N, 128]`` tensor
    for Triton (torch 2.11, Triton 3.6, Hopper: vLLM 0.26-0.28's compiled indexer key): a Welford
    reduction, one warp a row, lane ``l`` holding ``x[4l .. 4l + 3]`` (``x``: ``[..., 128]``;
    float32 out)::

        lane l:  (x[4l], 0) combined with x[4l + 1], x[4l + 2], x[4l + 3] in turn (ratios 1/2,
                 div.full(1, 3), 1/4; see _welford_step)
        butterfly 16, 8, 4, 2, 1 lanes apart: lane l combines its state with lane l ^ s's
                 (ratio 1/2); the combine is not symmetric, so each lane ends with statistics
                 of its own
        rstd = rsqrt(fl(m2 / 128 + fl32(eps)));  y = fma(fl(fl(x - mean) * rstd), w, b)

    each element normalised with the statistics of the lane that holds it; ``rsqrt`` as
    :func:`rsqrt_fp32`. Differentiable.
    """
    x = x.to(torch.float32)
    _check_width(x, "layer_norm_fp32_welford")
    lanes = x.reshape(*x.shape[:-1], 32, 4)
    zero = torch.zeros_like(lanes[..., 0])
    state = (lanes[..., 0], zero)
    for i, ratio in enumerate((0.5, one_third, 0.25), start=1):
        r = _device_constant(ratio, torch.float32, x.device)
        state = _welford_step(state, (lanes[..., i], zero), float(i), r, fma)
    half = _device_constant(0.5, torch.float32, x.device)
    index = torch.arange(32, device=x.device)
    count = 4.0
    for s in (16, 8, 4, 2, 1):
        partner = index ^ s
        state = _welford_step(
            state, (state[0][..., partner], state[1][..., partner]), count, half, fma
        )
        count *= 2
    mean, m2 = state
    eps32 = _device_constant(float(eps), torch.float32, x.device)
    rstd = rsqrt_fp32(m2 * 2.0**-7 + eps32)  # m2 / 128: exact
    d = x - mean.repeat_interleave(4, dim=-1)
    return _affine_fp32(d * rstd.repeat_interleave(4, dim=-1), weight, bias, fma)
