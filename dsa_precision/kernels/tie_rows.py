"""Count each row's keys scoring at least a threshold, inside the row's window (Triton).

The engine side of the tie replay (:func:`dsa_precision.capture.engine_tie_rows`) asks, per row,
whether a key the top-k left out scores at least the smallest pick's score: the keys of the
row's window scoring at least that value outnumber the picks. One program per row reads the
window once and writes one count; the torch expression makes four passes over ``(rows, W)`` and
three boolean temporaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["count_at_least"]

_BLOCK = 2048


@triton.jit
def _count_at_least_kernel(
    logits_ptr, stride, kth_ptr, start_ptr, end_ptr, count_ptr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    kth = tl.load(kth_ptr + row)
    start = tl.load(start_ptr + row)
    end = tl.load(end_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    for first in range(start, end, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < end
        v = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        total += ((v >= kth) & inside).to(tl.int32)  # NaN compares False
    tl.store(count_ptr + row, tl.sum(total, axis=0))


def count_at_least(
    logits: torch.Tensor,
    kth: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """int32 ``(rows,)``: per row, the columns ``c`` in ``[starts, ends)`` with
    ``logits[row, c] >= kth[row]`` (float compare: NaN never counts, ``-0.0 == +0.0``).

    Args:
        logits: ``(rows, W)`` float32 / bfloat16 / float16, unit column stride.
        kth: ``(rows,)`` float32 thresholds.
        starts, ends: ``(rows,)`` int32 column windows, ``0 <= starts <= ends <= W``.
        block: columns per loop step (any gives the same counts).
    """
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be (rows, W) with unit column stride.")
    rows = logits.shape[0]
    for name, t, dtype in (("kth", kth, torch.float32), ("starts", starts, torch.int32),
                           ("ends", ends, torch.int32)):  # fmt: skip
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({rows},) {dtype} tensor.")
    count = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows:
        block = _BLOCK if block is None else block
        _count_at_least_kernel[(rows,)](
            logits, logits.stride(0), kth, starts, ends, count, BLOCK=block
        )
    return count
