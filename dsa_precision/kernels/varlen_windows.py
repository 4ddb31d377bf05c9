"""Each packed (THD) query row's key window in one launch (Triton): DeepGEMM's ``ks`` / ``ke``.

Row ``r`` of sequence ``i`` (``cu_q[i] <= r < cu_q[i + 1]``) sees the packed keys
``[cu_k[i], cu_k[i] + count)``, ``count = min(max(floor((offset_i + r - cu_q[i] + 1) / ratio), 0),
cu_k[i + 1] - cu_k[i])``: what :func:`dsa_precision.rows._varlen_windows` computes in torch with a
``searchsorted`` and a dozen gathers and casts (about 20 launches, each a few microseconds of
device time in front of a ~0.1 ms kernel at T = 8192). Here one program binary-searches a block of
rows in ``cu_q`` and writes the three int32 rows ``start``, ``end``, ``count`` of one buffer.
Integer arithmetic only, so the values are the torch expression's, bit for bit (for
non-decreasing ``cu_q``; rows past ``cu_q[-1]`` belong to the last sequence, as there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = []

_BLOCK = 1024


@triton.jit
def _varlen_windows_kernel(
    cu_q_ptr, cu_k_ptr, off_ptr, out_ptr, total_q, n_seq, steps, ratio, stride,
    BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < total_q
    r = rows.to(tl.int64)
    # The sequence of each row: the number of cu_q[1:] entries <= r (searchsorted, right=True),
    # by a binary search over [0, n_seq), clamped to the last sequence.
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.zeros((BLOCK,), tl.int32) + n_seq
    for _ in range(steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(cu_q_ptr + 1 + mid, mask=live & open_, other=0).to(tl.int64)
        right = open_ & (v <= r)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    seq = tl.minimum(lo, n_seq - 1)
    q0 = tl.load(cu_q_ptr + seq, mask=live, other=0).to(tl.int64)
    k0 = tl.load(cu_k_ptr + seq, mask=live, other=0)
    k1 = tl.load(cu_k_ptr + seq + 1, mask=live, other=0)
    off = tl.load(off_ptr + seq, mask=live, other=0).to(tl.int64)
    # Truncating division: equal to the floor once clamped at 0 (ratio > 0).
    count = tl.maximum((off + (r - q0) + 1) // ratio, 0)
    count = tl.minimum(count, (k1 - k0).to(tl.int64)).to(tl.int32)
    start = k0.to(tl.int32)
    tl.store(out_ptr + rows, start, live)
    tl.store(out_ptr + stride + rows, start + count, live)
    tl.store(out_ptr + 2 * stride + rows, count, live)


def _varlen_windows(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    offsets: torch.Tensor,
    ratio: int,
    total_q: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(start, end, count)``, each ``(total_q,)`` int32 contiguous (rows of one buffer, each
    16-byte aligned): every packed row's key window, as in the module docstring.

    Args:
        cu_q, cu_k: ``(n + 1,)`` int32 or int64 cumulative lengths, contiguous, on one device.
        offsets: ``(n,)`` int32 or int64: each sequence's global index of its query 0.
        ratio: positive Python int, the key compression ratio.
        total_q: the packed query rows.
    """
    n = cu_q.numel() - 1
    if n < 1 or cu_k.shape != cu_q.shape or offsets.shape != (n,):
        raise ValueError(
            f"expected cu_q and cu_k of n + 1 >= 2 entries and n offsets; got cu_q "
            f"{tuple(cu_q.shape)}, cu_k {tuple(cu_k.shape)}, offsets {tuple(offsets.shape)}."
        )
    stride = -(-total_q // 4) * 4  # each row 16-byte aligned
    out = torch.empty((3, stride), dtype=torch.int32, device=cu_q.device)
    if total_q:
        _varlen_windows_kernel[(triton.cdiv(total_q, _BLOCK),)](
            cu_q.contiguous(), cu_k.contiguous(), offsets.contiguous(), out, total_q, n,
            n.bit_length(), ratio, stride, BLOCK=_BLOCK,
        )  # fmt: skip
    return out[0, :total_q], out[1, :total_q], out[2, :total_q]
