"""The owned top-k under Megatron's parallel layouts: which rows, which keys, which causal limits.

Inside ``DSAttention.forward`` (megatron-core 0.19) a rank holds:

- **indexer rows**: its context-parallel (CP) rows, gathered over tensor parallelism (TP) when
  sequence parallel is on (the indexer gathers ``x`` and ``qr``);
- **query rows**: those rows, or only this TP rank's slice of them when sequence parallel gives
  the attention a sequence-local query (``query.size(0) == x.size(0)``);
- **keys**: the indexer rows of every CP rank, all-gathered and put back in global order
  (Megatron's allgather CP; zigzag chunks for BSHD, per-sequence zigzag for packed THD).

:func:`owned_topk` scores the query rows against the keys with their global causal rows, the
same rows Megatron's own indexer paths use, and returns the top-k in the layout
``DSAttention`` consumes: ``(b, query rows, topk)`` key indices into the gathered keys. It calls
Megatron's layout helpers (``dsa_layout``) for positions and key order; the scoring is
:func:`dsa_precision.indexer_select` (one causal run per batch row) or
:func:`dsa_precision.indexer_select_varlen` (packed sequences, and the two zigzag chunks of each
sequence under CP as "pseudo-sequences" that share their sequence's keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
from megatron.core.transformer.experimental_attention_variant import dsa_layout

from ..devices import _to_device
from ..operands import ScoringOperands
from ..rows import _packed_sequence_of, _varlen_row_slice
from ..select import indexer_select, indexer_select_varlen

__all__ = ["Gather", "RankLayout", "owned_topk", "query_positions"]

# (tensor with the sequence dimension first) -> the tensors of every CP rank concatenated along
# it: Megatron's gather_from_sequence_parallel_region over the CP group, or a test's stand-in.
Gather = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """What a rank holds (all Python ints; see the module docstring)."""

    cp_size: int = 1
    cp_rank: int = 0
    # Query rows [query_start, query_start + query_rows) of the indexer rows.
    query_start: int = 0
    query_rows: int | None = None
    # Packed THD: cu_seqlens of the global packed sequence (Megatron's padded ones when given),
    # and host bounds on the sequence lengths (None: bounded by the packed length).
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    # Whether cu_seqlens covers every packed row (Megatron's max_seqlen metadata proves it for a
    # single sequence; otherwise rows past cu_seqlens[-1] are padding).
    cu_seqlens_cover_output: bool = False

    def query_stop(self, rows: int) -> int:
        """One past the last query row, for a rank of ``rows`` indexer rows."""
        return self.query_start + (rows if self.query_rows is None else self.query_rows)


def query_positions(layout: RankLayout, rows: int, device: torch.device) -> torch.Tensor:
    """``(query rows,)`` int64: where each query row sits globally -- its position in its
    sequence (BSHD) or its row of the global packed sequence (THD), from Megatron's helpers."""
    if layout.cu_seqlens is None:
        positions = dsa_layout.build_zigzag_cp_local_positions(
            rows * layout.cp_size, layout.cp_size, layout.cp_rank, device
        )
    else:
        positions = dsa_layout.build_packed_allgather_cp_local_positions(
            _to_device(layout.cu_seqlens, device),
            layout.cp_size,
            layout.cp_rank,
            device,
            output_size=rows,
            cu_seqlens_cover_output=layout.cu_seqlens_cover_output,
        )
    return positions[layout.query_start : layout.query_stop(rows)]


def _gather_keys(ops: ScoringOperands, gather: Gather, reorder: torch.Tensor) -> ScoringOperands:
    """Keys of every CP rank in global order: the E4M3 bytes (or BF16) and descales gathered
    along the sequence (1 byte per value for FP8, not Megatron's 2), then reordered."""
    k = ops.k.transpose(0, 1)  # (S, B, D)
    raw = k.view(torch.uint8) if k.dtype == torch.float8_e4m3fn else k
    k_all = gather(raw.contiguous()).index_select(0, reorder)
    if k.dtype == torch.float8_e4m3fn:
        k_all = k_all.view(torch.float8_e4m3fn)
    ks = None
    if ops.k_descale is not None:
        ks = gather(ops.k_descale.transpose(0, 1).contiguous()).index_select(0, reorder)
        ks = ks.transpose(0, 1).contiguous()
    return dataclasses.replace(ops, k=k_all.transpose(0, 1).contiguous(), k_descale=ks)


def _zigzag_runs(local_rows: int, cp_size: int, cp_rank: int, start: int, stop: int):
    """Affine runs ``(row_start, row_stop, global_position)`` of rows ``[start, stop)`` of a
    rank's zigzag CP rows (its front chunk, then its mirrored back chunk)."""
    half = local_rows // 2
    chunks = ((0, half, cp_rank * half), (half, local_rows, (2 * cp_size - 1 - cp_rank) * half))
    for lo, hi, pos in chunks:
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            yield a, b, pos + (a - lo)


def _bshd_keys(ops: ScoringOperands, layout: RankLayout, gather: Gather | None) -> ScoringOperands:
    """The operands with every CP rank's keys in global order (the rank's own rows of q)."""
    if layout.cp_size == 1:
        return ops
    reorder = dsa_layout.build_zigzag_allgather_cp_key_reorder(
        sq=ops.q.shape[1], cp_size=layout.cp_size, device=ops.device
    )
    assert gather is not None  # checked by _keys
    return _gather_keys(ops, gather, reorder)


def _bshd_topk(keys: ScoringOperands, layout: RankLayout, topk: int, **select):
    """BSHD picks ``(b, rows, topk)`` (with ``margins=True`` in ``select``: and ``(b, rows)``)."""
    rows = keys.q.shape[1]
    start, stop = layout.query_start, layout.query_stop(rows)
    if layout.cp_size == 1:
        return indexer_select(keys.rows(start, stop), topk=topk, q_causal_offsets=start, **select)
    runs = _zigzag_runs(rows, layout.cp_size, layout.cp_rank, start, stop)
    parts: list[Any] = [  # the picks, or (picks, margins)
        indexer_select(keys.rows(lo, hi), topk=topk, q_causal_offsets=pos, **select)
        for lo, hi, pos in runs
    ]
    if not select.get("margins"):
        return torch.cat(parts, dim=1)
    return tuple(torch.cat(p, dim=1) for p in zip(*parts, strict=True))


def _thd_pseudo_sequences(layout: RankLayout, rows: int, device: torch.device):
    """Packed rows as pseudo-sequences: ``(cu_q, offsets, seq_of_pseudo, n_pseudo)``.

    Without CP each packed sequence is one pseudo-sequence. With CP every sequence contributes
    its two zigzag chunks on this rank (each ``len / (2 cp)`` rows, at positions ``rank * half``
    and ``(2 cp - 1 - rank) * half`` of the sequence), in Megatron's local order. Rows past the
    last chunk (padding) form a final pseudo-sequence that sees no key.
    """
    assert layout.cu_seqlens is not None  # THD
    cu = _to_device(layout.cu_seqlens, device, torch.int64)
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    seqs = torch.arange(n, device=device)
    if layout.cp_size == 1:
        q_lens, offsets, seq_of = lens, torch.zeros_like(lens), seqs
    else:
        half = lens // (2 * layout.cp_size)
        q_lens = half.repeat_interleave(2)
        front = layout.cp_rank * half
        back = (2 * layout.cp_size - 1 - layout.cp_rank) * half
        offsets = torch.stack((front, back), dim=1).reshape(-1)
        seq_of = seqs.repeat_interleave(2)
    cu_q = torch.cat((q_lens.new_zeros(1), q_lens.cumsum(0)))
    # Padding rows: one more pseudo-sequence, with no key (its sequence index is n).
    cu_q = torch.cat((cu_q, cu_q.new_full((1,), rows)))
    offsets = torch.cat((offsets, offsets.new_zeros(1)))
    seq_of = torch.cat((seq_of, seq_of.new_full((1,), n)))
    return cu_q, offsets, seq_of, seq_of.numel()


def _thd_keys(ops: ScoringOperands, layout: RankLayout, gather: Gather | None) -> ScoringOperands:
    """The operands with every CP rank's packed keys in global packed order."""
    if layout.cp_size == 1:
        return ops
    rows = ops.q.shape[1]
    _, reorder = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
        cu_seqlens_q=layout.cu_seqlens,
        cu_seqlens_kv=layout.cu_seqlens,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        device=ops.device,
        local_output_size=rows,
        key_local_output_size=rows,
        global_output_size=rows * layout.cp_size,
        query_cu_seqlens_cover_output=layout.cu_seqlens_cover_output,
        key_cu_seqlens_cover_output=layout.cu_seqlens_cover_output,
    )
    assert gather is not None  # checked by _keys
    return _gather_keys(ops, gather, reorder)


def _thd_topk(keys: ScoringOperands, layout: RankLayout, topk: int, **select):
    """Packed picks ``(1, rows, topk)`` (with ``margins=True`` in ``select``: and ``(1, rows)``)."""
    want_margins = select.pop("margins", False)
    rows = keys.q.shape[1]
    device = keys.device
    start, stop = layout.query_start, layout.query_stop(rows)
    assert layout.cu_seqlens is not None  # THD
    cu = _to_device(layout.cu_seqlens, device, torch.int64)
    total_k = keys.k.shape[1]
    cu_q, offsets, seq_of, n_pseudo = _thd_pseudo_sequences(layout, rows, device)
    # Every pseudo-sequence reads its sequence's keys [cu[i], cu[i + 1]); with CP the two chunks
    # of a sequence share them, so the keys are laid out once per pseudo-sequence: an index
    # gather of the E4M3 keys, sized on the host (2 x the gathered keys; unused slots read key 0).
    key_start = torch.cat((cu[:-1], cu.new_zeros(1)))[seq_of]
    key_len = torch.cat((cu[1:] - cu[:-1], cu.new_zeros(1)))[seq_of]
    cu_k = torch.cat((key_len.new_zeros(1), key_len.cumsum(0)))
    if layout.cp_size > 1:
        copies = 2 * total_k
        counts = torch.cat((key_len, (copies - cu_k[-1]).view(1)))
        owner = torch.repeat_interleave(
            torch.arange(n_pseudo + 1, device=device), counts, output_size=copies
        )
        starts = torch.cat((key_start, key_start.new_zeros(1)))
        firsts = torch.cat((cu_k[:-1], cu_k[-1:]))
        index = torch.arange(copies, device=device) - firsts[owner] + starts[owner]
        index = torch.where(owner < n_pseudo, index, 0)
        keys = dataclasses.replace(
            keys,
            k=keys.k.index_select(1, index),
            k_descale=None if keys.k_descale is None else keys.k_descale.index_select(1, index),
        )
    max_len = layout.max_seqlen if layout.max_seqlen is not None else total_k
    sliced_cu, sliced_offsets = _varlen_row_slice(cu_q, offsets, start, stop)
    selected: Any = indexer_select_varlen(  # the picks, or (picks, margins)
        keys.rows(start, stop),
        topk=topk,
        cu_seqlens_q=sliced_cu,
        cu_seqlens_k=cu_k.to(torch.int32),
        max_seqlen_q=min(max_len, stop - start),
        max_seqlen_k=max_len,
        q_causal_offsets=sliced_offsets,
        margins=want_margins,
        **select,
    )
    picks, margins = selected if want_margins else (selected, None)
    # Sequence-local keys -> rows of the gathered packed keys.
    base = key_start[_packed_sequence_of(cu_q, torch.arange(start, stop, device=device))]
    picks = torch.where(picks >= 0, picks + base.unsqueeze(1).to(picks.dtype), picks).unsqueeze(0)
    return (picks, cast(torch.Tensor, margins).unsqueeze(0)) if want_margins else picks


def _keys(ops: ScoringOperands, layout: RankLayout, gather: Gather | None) -> ScoringOperands:
    if layout.cp_size > 1 and gather is None:
        raise ValueError(f"cp_size={layout.cp_size} needs the CP all-gather (gather=...).")
    if layout.cu_seqlens is None:
        return _bshd_keys(ops, layout, gather)
    if ops.q.shape[0] != 1:
        raise ValueError(f"packed THD operands have batch 1, got q {tuple(ops.q.shape)}.")
    return _thd_keys(ops, layout, gather)


def _select(keys: ScoringOperands, layout: RankLayout, topk: int, backend: str, margins: bool):
    """The picks (and with ``margins`` each row's margin) of one selection per scoring chunk."""
    if layout.cu_seqlens is None:
        return _bshd_topk(keys, layout, topk, backend=backend, margins=margins)
    return _thd_topk(keys, layout, topk, backend=backend, margins=margins)


def owned_topk(
    ops: ScoringOperands,
    layout: RankLayout,
    topk: int,
    *,
    gather: Gather | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-``topk`` keys of the query rows, in ``DSAttention``'s layout.

    Args:
        ops: the indexer's operands for all its rows (``(b, rows, ...)``; packed: batch 1) and
            their keys.
        layout: what this rank holds.
        topk: keys per query row.
        gather: the all-gather over the CP group (needed when ``layout.cp_size > 1``).
        backend: scoring backend of :func:`dsa_precision.indexer_select`.

    Returns:
        int32 ``(b, query rows, topk)``: indices into the gathered keys in global order (packed:
        global packed rows), ``-1`` in unused slots.
    """
    return _select(_keys(ops, layout, gather), layout, topk, backend, margins=False)


def _owned_topk_with_margins(
    ops: ScoringOperands,
    layout: RankLayout,
    topk: int,
    *,
    gather: Gather | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`owned_topk` and each query row's margin: its ``topk``-th minus its
    ``(topk + 1)``-th largest score (how close the row's boundary is to a tie), read from the
    scores of the same, single selection (``indexer_select(..., margins=True)``: the picks are
    :func:`owned_topk`'s bit for bit, each chunk is scored once); NaN for a row with fewer than
    ``topk + 1`` visible keys. Returns ``(picks (b, rows, topk) int32, margins (b, rows)
    float32)``.
    """
    return _select(_keys(ops, layout, gather), layout, topk, backend, margins=True)
