"""Write ``-inf`` past each row's written prefix, in place (Triton): DeepGEMM's scores.

DeepGEMM's compressed logits (:class:`dsa_precision.rows.WindowScores`) are written for
``j < counts[i]`` only; the scores :func:`dsa_precision.indexer_scores` returns hold ``-inf`` from
there on. This kernel stores exactly those tails and reads nothing but ``counts``, where the torch
expression (``logits.masked_fill_(cols >= counts[:, None], -inf)``) builds a boolean matrix and
reads and writes every score: for causal rows about half the matrix written instead of three
passes over all of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = []

_BLOCK = 1024


@triton.jit
def _mask_tails_kernel(ptr, counts_ptr, stride, columns, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    n = tl.load(counts_ptr + row)
    if (block + 1) * BLOCK > n:  # this block holds part of the tail
        cols = block * BLOCK + tl.arange(0, BLOCK)
        tail = (cols >= n) & (cols < columns)
        tl.store(ptr + row * stride + cols, tl.full((BLOCK,), float("-inf"), tl.float32), tail)


def _mask_tails(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Set ``logits[i, j] = -inf`` for every ``j >= counts[i]``; returns ``logits``.

    Args:
        logits: ``(rows, columns)`` float32 with unit column stride (rows may be padded apart),
            modified in place.
        counts: ``(rows,)`` int32, contiguous: each row's written prefix.
    """
    if logits.dtype != torch.float32 or counts.dtype != torch.int32:
        raise TypeError(
            f"expected float32 logits and int32 counts, got {logits.dtype}, {counts.dtype}"
        )
    if logits.ndim != 2 or logits.stride(1) != 1 or counts.shape != logits.shape[:1]:
        raise ValueError(
            f"expected (rows, columns) logits with unit column stride and (rows,) counts; got "
            f"logits {tuple(logits.shape)} strides {logits.stride()}, counts {tuple(counts.shape)}."
        )
    rows, columns = logits.shape
    if rows and columns:
        grid = (rows, -(-columns // _BLOCK))
        _mask_tails_kernel[grid](
            logits, counts.contiguous(), logits.stride(0), columns, BLOCK=_BLOCK
        )
    return logits
