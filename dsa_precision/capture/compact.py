"""Compact storage / transfer of top-k picks, decoded on the device with torch ops.

Plain picks cost ``4 k`` bytes per token and layer (2048 picks: 8 KiB; about 170 KB per token
for a GLM-5-class model's indexer layers). Three formats:

- ``"int32"``: the plain layout (the reference).
- ``"int16"``: positions as int16, ``-1`` padding; only when every key is ``<= 32767`` (sequences
  up to 32768 tokens). Order preserving; decoding is one cast. ``2 k`` bytes.
- ``"delta"``: per row, the valid keys sorted ascending, stored as gaps
  ``d_0 = s_0, d_j = s_j - s_{j-1} - 1`` bit-packed at the row's own width
  ``w = bit_length(max d)`` (0 bits when a row picks every key it can see, i.e. the first ``k``
  positions), plus a 1-byte width and a 2-byte count per row. Any sequence length (keys below
  ``2**31``). Decoding: a prefix sum of the row sizes, two gathers, shifts and a cumulative sum
  per row; no host synchronisation. Rows come back **sorted** (the same set: the package's
  replay reads the picks as a set of keys; ``-1`` padding last).

Encoding (at the engine or at storage time) may synchronise; decoding never does.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, cast

import torch

__all__ = ["FORMATS", "CompactPicks", "decode_picks", "encode_picks"]

Format = Literal["int32", "int16", "delta"]
FORMATS = ("int32", "int16", "delta")
_WORD = 32
_LOW32 = (1 << 32) - 1


@dataclasses.dataclass(frozen=True)
class CompactPicks:
    """Encoded ``(T, k)`` picks of one layer.

    Attributes:
        format: ``"int32"``, ``"int16"`` or ``"delta"``.
        shape: ``(T, k)`` of the decoded picks.
        data: ``int32`` / ``int16``: the ``(T, k)`` picks; ``delta``: ``(W,)`` int32 words of the
            bit stream (little-endian bit order, one zero word of slack at the end).
        width: ``delta``: ``(T,)`` uint8 bits per gap of each row.
        count: ``delta``: ``(T,)`` int16 (int32 when ``k > 32767``) valid keys per row.
    """

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    width: torch.Tensor | None = None
    count: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.width, self.count) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes stored / moved."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CompactPicks:
        """The same encoding on ``device`` (``non_blocking`` from pinned memory)."""
        moved = [
            None if t is None else t.to(device, non_blocking=non_blocking)
            for t in (self.data, self.width, self.count)
        ]
        data = cast(torch.Tensor, moved[0])  # never None
        return dataclasses.replace(self, data=data, width=moved[1], count=moved[2])

    def pin_memory(self) -> CompactPicks:
        pinned = [
            None if t is None else t.pin_memory() for t in (self.data, self.width, self.count)
        ]
        data = cast(torch.Tensor, pinned[0])  # never None
        return dataclasses.replace(self, data=data, width=pinned[1], count=pinned[2])


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of non-negative int64 values below 2**53 (0 -> 0), exact via frexp."""
    return torch.frexp(x.to(torch.float64)).exponent.to(torch.int64)


def _word_sums(q: torch.Tensor, values: torch.Tensor, n_words: int) -> torch.Tensor:
    """``out[w] = sum(values[q == w])`` for non-decreasing ``q`` (the bit stream is written in
    order): a difference of prefix sums at the run ends, exact integer arithmetic, the same bits
    on every run (no scatter accumulation)."""
    prefix = torch.cat((values.new_zeros(1), torch.cumsum(values, 0)))
    ends = torch.searchsorted(q, torch.arange(n_words, device=q.device), right=True)
    return prefix[ends] - prefix[torch.cat((ends.new_zeros(1), ends[:-1]))]


def encode_picks(
    indices: torch.Tensor, format: Format = "delta", *, rows_per_chunk: int = 8192
) -> CompactPicks:
    """Encode ``(T, k)`` int16/int32/int64 picks (``-1`` padding, distinct keys per row).

    Raises ``ValueError`` for ``"int16"`` when a key exceeds 32767, for keys outside
    ``[-1, 2**31)``, and (``"delta"``) for a row that repeats a key. ``rows_per_chunk`` bounds the encoder's temporary memory (``delta``).
    """
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dtype
        not in (
            torch.int16,
            torch.int32,
            torch.int64,
        )
        or indices.ndim != 2
    ):
        raise TypeError(
            f"indices must be a (T, k) int16/int32/int64 tensor, got "
            f"{getattr(indices, 'dtype', type(indices).__name__)} "
            f"{tuple(getattr(indices, 'shape', ()))}."
        )
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: use one of {FORMATS}.")
    shape = (int(indices.shape[0]), int(indices.shape[1]))
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < -1 or high >= 2**31:
            raise ValueError(
                f"picks hold {low}..{high}; keys are -1 (padding) or 0 <= key < 2**31."
            )
    else:
        high = -1
    if format == "int32":
        return CompactPicks("int32", shape, indices.to(torch.int32).contiguous())
    if format == "int16":
        if high > 32767:
            raise ValueError(
                f"format='int16' holds keys up to 32767, the picks reach {high}; use 'delta' "
                "(any length) or 'int32'."
            )
        return CompactPicks("int16", shape, indices.to(torch.int16).contiguous())
    t, k = shape
    widths, counts, chunks, bit_total = [], [], [], 0
    for r0 in range(0, t, max(1, rows_per_chunk)):
        v = indices[r0 : r0 + rows_per_chunk].to(torch.int64)
        n = (v >= 0).sum(-1)
        s = torch.where(v < 0, torch.iinfo(torch.int64).max, v).sort(-1).values
        slot = torch.arange(k, device=v.device)
        valid = slot < n[:, None]
        gaps = torch.cat((s[:, :1], s[:, 1:] - s[:, :-1] - 1), dim=1)
        repeated = ((gaps < 0) & valid).any(-1)  # a key twice: gap -1, which no width encodes
        gaps = torch.where(valid, gaps, 0)
        w = _bit_length(gaps.max(-1).values) if k else torch.zeros_like(n)
        sizes = n * w
        start = bit_total + torch.cumsum(sizes, 0) - sizes
        chunk_bits, n_repeated = torch.stack((sizes.sum(), repeated.sum())).tolist()
        if n_repeated:
            row = r0 + int(repeated.nonzero()[0])
            raise ValueError(
                f"indices: row {row} repeats a key ({indices[row].tolist()[:8]}); a top-k row "
                "holds distinct keys (format='delta' stores the gaps between them)."
            )
        base = bit_total // _WORD  # this chunk's words start here (the first may be shared)
        local = (start - base * _WORD)[:, None] + slot * w[:, None]
        pos, gap = local[valid], gaps[valid]
        part = torch.zeros(
            (bit_total - base * _WORD + chunk_bits) // _WORD + 2, dtype=torch.int64, device=v.device
        )
        q, sh = pos >> 5, pos & 31
        part += _word_sums(q, (gap << sh) & _LOW32, part.numel())  # disjoint bits: sum = OR
        part += _word_sums(q + 1, gap >> (_WORD - sh), part.numel())
        chunks.append((base, part))
        widths.append(w)
        counts.append(n)
        bit_total += chunk_bits
    n_words = (bit_total + _WORD - 1) // _WORD + 1  # one word of slack for the decoder's pair read
    words = torch.zeros(n_words + 2, dtype=torch.int64, device=indices.device)
    for base, part in chunks:
        words[base : base + part.numel()] += part  # a shared boundary word: disjoint bits
    data = torch.where(words >= 2**31, words - 2**32, words)[:n_words].to(torch.int32)
    count_dtype = torch.int16 if k <= 32767 else torch.int32
    return CompactPicks(
        "delta",
        shape,
        data.contiguous(),
        width=torch.cat(widths).to(torch.uint8),
        count=torch.cat(counts).to(count_dtype),
    )


def decode_picks(picks: CompactPicks) -> torch.Tensor:
    """``(T, k)`` int32 picks on ``picks``' device, ``-1`` padding. No host synchronisation.

    ``delta`` rows come back sorted ascending, padding last (the same set of keys)."""
    if not isinstance(picks, CompactPicks):
        raise TypeError(f"expected CompactPicks, got {type(picks).__name__}.")
    if picks.format in ("int32", "int16"):
        return picks.data.to(torch.int32)
    if picks.format != "delta":
        raise ValueError(f"unknown format {picks.format!r}.")
    k = picks.shape[1]
    # delta: both are given
    w = cast(torch.Tensor, picks.width).to(torch.int64)
    n = cast(torch.Tensor, picks.count).to(torch.int64)
    sizes = n * w
    start = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(k, device=w.device)
    pos = start[:, None] + slot * w[:, None]
    words = picks.data.to(torch.int64) & _LOW32
    last = words.numel() - 1
    q = (pos >> 5).clamp_(max=last - 1)
    pair = words[q] | (words[q + 1] << _WORD)  # 64 bits; a gap has at most 31
    gaps = (pair >> (pos & 31)) & ((1 << w[:, None]) - 1)
    keys = torch.cumsum(gaps, -1) + slot
    return torch.where(slot < n[:, None], keys, -1).to(torch.int32)
