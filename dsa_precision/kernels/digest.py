"""Row digests of top-k picks in one pass (Triton): :func:`dsa_precision.capture.digest_rows`.

The digest (defined in :mod:`dsa_precision.capture.digest`) mixes every valid key with
SplitMix64's finaliser, sums the mixes and the count modulo ``2**64`` and mixes the result. As
torch ops that is about a dozen elementwise passes over ``(rows, k)`` int64 temporaries (at 6,144
rows of top-2048, about 1 ms on an H100: more than the engine's top-k kernel); here one program
per row reads its picks once. Unsigned 64-bit arithmetic wraps as the definition says, and a sum
modulo ``2**64`` does not depend on its order: the same bits as the torch path and the
pure-Python reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = []

_BLOCK = 1024
# The digest's constants (dsa_precision.capture.digest): the golden-ratio increment and
# SplitMix64's two multipliers, passed to the kernels as unsigned 64-bit arguments.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@triton.jit
def _splitmix64(z, M1, M2):
    """SplitMix64's finaliser of uint64 ``z`` (``M1``, ``M2``: :data:`_MIX1`, :data:`_MIX2`)."""
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    return z ^ (z >> 31)


@triton.jit
def _digest_kernel(idx_ptr, out_ptr, k, stride, G, M1, M2, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = idx_ptr + row.to(tl.int64) * stride
    total = tl.zeros((BLOCK,), dtype=tl.uint64)
    count = tl.zeros((BLOCK,), dtype=tl.uint64)
    for first in range(0, k, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < k
        v = tl.load(base + cols, mask=inside, other=-1).to(tl.int64)
        valid = inside & (v >= 0)
        mixed = _splitmix64((v + 1).to(tl.uint64) * G, M1, M2)
        total += tl.where(valid, mixed, 0)
        count += valid.to(tl.uint64)
    digest = _splitmix64(tl.sum(total, axis=0) ^ (tl.sum(count, axis=0) * G), M1, M2)
    tl.store(out_ptr + row, digest.to(tl.int64, bitcast=True))


def _digest_picks(indices: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """int64 ``(rows,)`` digests of ``(rows, k)`` int16/int32/int64 picks (unit column stride;
    keys below ``-1`` must have been refused by the caller: they digest as padding here).
    ``block``: picks per loop step (any gives the same digests)."""
    if indices.ndim != 2 or indices.stride(1) != 1:
        raise ValueError("indices must be (rows, k) with unit column stride.")
    rows, k = indices.shape
    out = torch.empty(rows, dtype=torch.int64, device=indices.device)
    if rows:
        block = _BLOCK if block is None else block
        _digest_kernel[(rows,)](
            indices, out, k, indices.stride(0), _GOLDEN, _MIX1, _MIX2, BLOCK=block
        )
    return out
