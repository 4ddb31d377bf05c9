"""The packed rows' key windows in Triton's interpreter against the torch expression of
``dsa_precision.rows._varlen_windows`` (the CPU path): the same integers, every row."""

import pytest
import torch

from dsa_precision.kernels.varlen_windows import _varlen_windows as fused
from dsa_precision.rows import _varlen_row_slice, _varlen_windows

from ..support.helpers import cu_seqlens


def _random_lengths(n: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g).tolist()


def _assert_same(cu_q, cu_k, offsets, ratio, total_q):
    got = fused(cu_q, cu_k, offsets, ratio, total_q)
    want = _varlen_windows(cu_q, cu_k, offsets, ratio, total_q)
    for name, a, b in zip(("start", "end", "counts"), got, want, strict=True):
        assert a.dtype == torch.int32 and a.is_contiguous() and a.shape == (total_q,), name
        assert a.data_ptr() % 16 == 0, name  # rows of one buffer, each 16-byte aligned
        assert torch.equal(a, b), (name, (a != b).nonzero()[:5].tolist())


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_uneven_sequences_and_empty_ones(ratio, dtype):
    lens_q, lens_k = [700, 0, 1500, 3, 1], [700, 5, 1200, 0, 9]  # keys shorter, longer, none
    cu_q, cu_k = cu_seqlens(lens_q).to(dtype), cu_seqlens(lens_k).to(dtype)
    offsets = torch.tensor([0, 4, 300, 2, 7], dtype=dtype)
    _assert_same(cu_q, cu_k, offsets, ratio, sum(lens_q))  # 2204 rows: 3 blocks, a ragged one


@pytest.mark.parametrize("n", [1, 2, 37, 64])
def test_binary_search_over_many_sequences(n):
    lens = _random_lengths(n, 90, seed=n)
    lens[-1] += 1  # at least one row
    cu = cu_seqlens(lens)
    offsets = torch.tensor(_random_lengths(n, 50, seed=n + 1))
    _assert_same(cu, cu, offsets, 1, sum(lens))


def test_chunks_of_a_packing_as_select_cuts_them():
    lens = [1000, 37, 2000, 555]
    cu = cu_seqlens(lens).to(torch.int32)
    offsets = torch.tensor([0, 3, 0, 10], dtype=torch.int32)
    for r0, r1 in ((0, 512), (512, 1536), (1536, 3592)):
        cu_chunk, off_chunk = _varlen_row_slice(cu, offsets, r0, r1)
        _assert_same(cu_chunk, cu, off_chunk.to(torch.int32), 2, r1 - r0)


def test_no_rows_no_launch_and_bad_shapes_named():
    cu = cu_seqlens([0, 0])
    start, end, counts = fused(cu, cu, torch.zeros(2, dtype=torch.int32), 1, 0)
    assert start.shape == end.shape == counts.shape == (0,)
    with pytest.raises(ValueError, match="offsets"):
        fused(cu, cu, torch.zeros(3, dtype=torch.int32), 1, 0)
