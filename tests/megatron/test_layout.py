"""The owned top-k under Megatron's parallel layouts, on synthetic per-rank shards (CPU).

Each rank's shard is cut from one global problem with Megatron's own layout helpers (zigzag CP
positions for BSHD, per-sequence zigzag chunks for packed THD, a TP slice of the query rows for
sequence parallelism); the CP all-gather is a stand-in that concatenates the ranks' shards. The
picks of every rank must be the single-process picks of the global problem at that rank's rows:
scoring a row does not depend on how rows are split. The real collectives run in
tests/examples/test_parallel_parity.py (gloo, two processes) and on two H200s.
"""

import dataclasses
import itertools

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant import dsa_layout

from dsa_precision import ScoringOperands, indexer_select, indexer_select_varlen
from dsa_precision.megatron.layout import RankLayout, owned_topk
from dsa_precision.quantize import quantize_fp8

TOPK = 5


def _operands(b: int, s: int, seed: int = 0) -> ScoringOperands:
    g = torch.Generator().manual_seed(seed)
    q8, qs = quantize_fp8(torch.randn(b, s, 32, 128, generator=g))
    k8, ks = quantize_fp8(torch.randn(b, s, 128, generator=g))
    w = torch.randn(b, s, 32, generator=g) * qs
    return ScoringOperands(q8, k8, w, qs, ks)


def _shard(ops: ScoringOperands, rows: torch.Tensor) -> ScoringOperands:
    """A rank's rows (queries, weights, and keys of the same tokens)."""
    pick = lambda t: t.index_select(1, rows)  # noqa: E731
    return ScoringOperands(
        pick(ops.q), pick(ops.k), pick(ops.weights), pick(ops.q_descale), pick(ops.k_descale)
    )


def _gather(shards: list[torch.Tensor], mine: int, seen: list[int]):
    """Stand-in for the CP all-gather: this rank's tensor must be its shard; returns all shards
    concatenated along the sequence (dim 0)."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [s(t) for s in shards]
        assert torch.equal(parts[mine], t), "the gathered tensor is not this rank's shard"
        seen.append(t.shape[0])
        return torch.cat(parts, dim=0)

    return gather


def _key_views(ops: ScoringOperands, positions: list[torch.Tensor]):
    """For each rank: a function mapping the tensor that rank passes to the gather onto the
    same data cut from the global operands (E4M3 bytes or descales, sequence first)."""

    def view(rows):
        def cut(t: torch.Tensor) -> torch.Tensor:
            src = ops.k if t.dtype == torch.uint8 else ops.k_descale
            out = src.index_select(1, rows).transpose(0, 1).contiguous()
            return out.view(torch.uint8) if t.dtype == torch.uint8 else out

        return cut

    return [view(p) for p in positions]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cp_rank", [0, 1])
@pytest.mark.parametrize(
    "tp_slice", [None, (0, 8), (8, 8), (4, 8)], ids=["all", "tp0", "tp1", "straddle"]
)
def test_bshd_zigzag_cp_and_sequence_parallel_slices(batch, cp_rank, tp_slice):
    s, cp = 32, 2
    ops = _operands(batch, s)
    want = indexer_select(ops, topk=TOPK)  # single process, global rows
    positions = [dsa_layout.build_zigzag_cp_local_positions(s, cp, r, "cpu") for r in range(cp)]
    local = _shard(ops, positions[cp_rank])
    start, rows = tp_slice or (0, s // cp)
    seen: list[int] = []
    gather = _gather(_key_views(ops, positions), cp_rank, seen)
    layout = RankLayout(cp_size=cp, cp_rank=cp_rank, query_start=start, query_rows=rows)
    got = owned_topk(local, layout, TOPK, gather=gather)
    rows_here = positions[cp_rank][start : start + rows]
    assert torch.equal(got, want[:, rows_here]), (cp_rank, tp_slice)
    assert seen == [s // cp, s // cp]  # the E4M3 keys and their descales, once each


def _packed_reference(ops: ScoringOperands, cu: list[int]) -> torch.Tensor:
    """Single-process picks of every packed row, as global packed key rows."""
    t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    local = indexer_select_varlen(
        ops, topk=TOPK, cu_seqlens_q=t, cu_seqlens_k=t, max_seqlen_q=longest, max_seqlen_k=longest
    )
    starts = torch.repeat_interleave(t[:-1], t[1:] - t[:-1]).to(local.dtype)
    return torch.where(local >= 0, local + starts[:, None], local)


@pytest.mark.parametrize("cp_rank", [0, 1])
@pytest.mark.parametrize("tp_slice", [None, (0, 8), (5, 9)], ids=["all", "tp0", "cut"])
def test_thd_per_sequence_zigzag_cp(cp_rank, tp_slice):
    cu, cp = [0, 8, 20, 36], 2  # three sequences of unequal length, each divisible by 2 cp
    total = cu[-1]
    ops = _operands(1, total, seed=1)
    want = _packed_reference(ops, cu)
    t = torch.tensor(cu, dtype=torch.int32)
    positions = [
        dsa_layout.build_packed_allgather_cp_local_positions(t, cp, r, "cpu", total // cp)
        for r in range(cp)
    ]
    local = _shard(ops, positions[cp_rank])
    start, rows = tp_slice or (0, total // cp)
    seen: list[int] = []
    layout = RankLayout(
        cp_size=cp,
        cp_rank=cp_rank,
        query_start=start,
        query_rows=rows,
        cu_seqlens=t,
        max_seqlen=16,
    )
    got = owned_topk(local, layout, TOPK, gather=_gather(_key_views(ops, positions), cp_rank, seen))
    assert torch.equal(got[0], want[positions[cp_rank][start : start + rows]])


@pytest.mark.parametrize("tp_slice", [None, (0, 9), (9, 9), (4, 11)])
def test_thd_without_cp_and_sequence_parallel_slices(tp_slice):
    cu = [0, 5, 6, 18]
    ops = _operands(1, cu[-1], seed=2)
    want = _packed_reference(ops, cu)
    start, rows = tp_slice or (0, cu[-1])
    layout = RankLayout(
        query_start=start, query_rows=rows, cu_seqlens=torch.tensor(cu), max_seqlen=12
    )
    got = owned_topk(ops, layout, TOPK)
    assert torch.equal(got[0], want[start : start + rows])


def test_thd_padding_rows_select_nothing():
    cu = [0, 6, 10]
    ops = _operands(1, 14, seed=3)  # 4 packed rows past the last sequence
    got = owned_topk(ops, RankLayout(cu_seqlens=torch.tensor(cu), max_seqlen=6), TOPK)
    want = _packed_reference(_shard(ops, torch.arange(10)), cu)
    assert torch.equal(got[0, :10], want) and bool((got[0, 10:] == -1).all())


def test_unknown_max_seqlen_is_bounded_by_the_packed_length():
    cu = [0, 7, 12]
    ops = _operands(1, 12, seed=4)
    layout = RankLayout(cu_seqlens=torch.tensor(cu))
    unknown = owned_topk(ops, layout, TOPK)
    assert torch.equal(unknown[0], _packed_reference(ops, cu))
    assert torch.equal(unknown, owned_topk(ops, dataclasses.replace(layout, max_seqlen=7), TOPK))


def test_cp_without_a_gather_is_refused():
    with pytest.raises(ValueError, match=r"cp_size=2 needs the CP all-gather"):
        owned_topk(_operands(1, 8), RankLayout(cp_size=2), TOPK)
