"""The engine side of the tie replay in one pass per row (Triton).

For each row of an indexer call, :func:`dsa_precision.capture.engine_tie_rows` needs the digest
of the engine's picks and whether a key the picks left out scores at least the smallest pick's
score (the row's margin is not positive: a boundary tie, or a set that is no top-k). One program
per row reads the row's picks once -- the digest (as :mod:`.digest`), their count and the
smallest of their scores, gathered from the row's logits -- then the row's window of logits
once, counting the keys scoring at least that value: more of them than picks means the row is
sent. The torch expression of the same makes a dozen passes over ``(rows, k)`` int64
temporaries and four over the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .digest import _GOLDEN, _MIX1, _MIX2, _splitmix64

__all__ = ["tie_rows"]

_BLOCK_PICKS = 1024
_BLOCK_KEYS = 2048


@triton.jit
def _tie_rows_kernel(
    logits_ptr,
    logits_stride,
    picks_ptr,
    picks_stride,
    k,
    start_ptr,
    length_ptr,
    digest_ptr,
    sent_ptr,
    G,
    M1,
    M2,
    BLOCK_PICKS: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.load(start_ptr + row).to(tl.int64)
    end = start + tl.load(length_ptr + row).to(tl.int64)
    scores = logits_ptr + row.to(tl.int64) * logits_stride
    picks = picks_ptr + row.to(tl.int64) * picks_stride
    total = tl.zeros((BLOCK_PICKS,), dtype=tl.uint64)
    count = tl.zeros((BLOCK_PICKS,), dtype=tl.int32)
    smallest = tl.full((BLOCK_PICKS,), float("inf"), dtype=tl.float32)
    nan = tl.zeros((BLOCK_PICKS,), dtype=tl.int32)
    for first in range(0, k, BLOCK_PICKS):
        slots = first + tl.arange(0, BLOCK_PICKS)
        key = tl.load(picks + slots, mask=slots < k, other=-1).to(tl.int64)
        valid = (slots < k) & (key >= 0)
        total += tl.where(valid, _splitmix64((key + 1).to(tl.uint64) * G, M1, M2), 0)
        count += valid.to(tl.int32)
        s = tl.load(scores + start + key, mask=valid, other=float("inf")).to(tl.float32)
        nan += (s != s).to(tl.int32)
        smallest = tl.minimum(smallest, tl.where(s != s, float("inf"), s))
    n = tl.sum(count, axis=0)
    digest = _splitmix64(tl.sum(total, axis=0) ^ (n.to(tl.uint64) * G), M1, M2)
    tl.store(digest_ptr + row, digest.to(tl.int64, bitcast=True))
    # A NaN among the picks' scores makes the smallest NaN (torch's amin): no key compares >= it.
    kth = tl.where(tl.sum(nan, axis=0) > 0, float("nan"), tl.min(smallest, axis=0))
    at_least = tl.zeros((BLOCK_KEYS,), dtype=tl.int32)
    for first in range(start, end, BLOCK_KEYS):
        cols = first + tl.arange(0, BLOCK_KEYS)
        inside = cols < end
        v = tl.load(scores + cols, mask=inside, other=0.0).to(tl.float32)
        at_least += ((v >= kth) & inside).to(tl.int32)  # NaN compares False
    tl.store(sent_ptr + row, (tl.sum(at_least, axis=0) > n).to(tl.int8))


def tie_rows(
    logits: torch.Tensor,
    picks: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_picks: int | None = None,
    block_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(digests (rows,) int64, sent (rows,) bool)`` of one indexer call: each row's digest of
    its picks (:func:`dsa_precision.capture.digest_rows`) and whether its margin is not positive.

    Args:
        logits: ``(rows, W)`` float32 / bfloat16 / float16, unit column stride.
        picks: ``(rows, k)`` int16/int32/int64 keys (``-1`` padding), unit column stride; key
            ``j`` of a row is column ``starts + j`` (keys below ``-1`` and past the row's window
            must have been refused by the caller).
        starts, lengths: ``(rows,)`` int32: each row's window of columns.
        block_picks, block_keys: loop steps (any gives the same result).
    """
    if logits.ndim != 2 or logits.stride(1) != 1 or picks.ndim != 2 or picks.stride(1) != 1:
        raise ValueError("logits (rows, W) and picks (rows, k) need unit column strides.")
    rows = logits.shape[0]
    for name, t in (("starts", starts), ("lengths", lengths)):
        if t.shape != (rows,) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({rows},) int32 tensor.")
    digests = torch.empty(rows, dtype=torch.int64, device=logits.device)
    sent = torch.empty(rows, dtype=torch.int8, device=logits.device)
    if rows:
        _tie_rows_kernel[(rows,)](
            logits, logits.stride(0), picks, picks.stride(0), picks.shape[1], starts, lengths,
            digests, sent, _GOLDEN, _MIX1, _MIX2, BLOCK_PICKS=block_picks or _BLOCK_PICKS,
            BLOCK_KEYS=block_keys or _BLOCK_KEYS,
        )  # fmt: skip
    return digests, sent.bool()
