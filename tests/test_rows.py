"""Row arithmetic of causal and packed scoring (dsa_precision.rows) against the formulas written out."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsa_precision.rows import (
    WindowScores,
    _causal_offsets,
    _constant_key_counts,
    _constant_offsets,
    _varlen_key_counts,
    _varlen_row_slice,
    causal_key_counts,
)

from .support.configs import CPU
from .support.helpers import (
    causal_counts,
    cu_seqlens,
)


@pytest.mark.parametrize("ratio", [1, 3])
def test_causal_key_counts_follow_the_formula(ratio):
    offsets = torch.tensor([0, 7, 100], dtype=torch.int32)
    got = causal_key_counts(offsets, 4, 9, ratio, 30)
    assert got.dtype == torch.int32 and got.shape == (3, 9)
    want = [causal_counts(off, range(4, 13), ratio, 30) for off in (0, 7, 100)]
    assert got.tolist() == want


def test_varlen_key_counts_and_row_slices_follow_the_formula():
    lens_q, lens_k = [5, 0, 17, 9], [5, 0, 17, 12]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    offsets = torch.tensor([0, 4, 2, 3])
    got = _varlen_key_counts(cu_q, cu_k, offsets, 2, sum(lens_q))
    want = []
    for i, n in enumerate(lens_q):
        want += [min(c, lens_k[i]) for c in causal_counts(int(offsets[i]), range(n), 2, 10**9)]
    assert got.tolist() == want
    # Rows [8, 20) of the packing: sequence 2's rows 3..14, sequence 3 untouched.
    sliced_cu, sliced_off = _varlen_row_slice(cu_q, offsets, 8, 20)
    assert sliced_cu.tolist() == [0, 0, 0, 12, 12] and sliced_cu.dtype == torch.int32
    assert sliced_off.tolist()[2:] == [2 + 3, 3]  # sequence 2 starts at its local row 3


def test_constant_offsets_and_key_counts_match_their_uncached_builds():
    """Every argument is part of the key: a sequence of calls that differ in one argument each
    returns each one's own values (a cache keyed on fewer would return a previous call's)."""
    cases = [
        (0, 1, 0, 8, 1, 8),
        (5, 1, 0, 8, 1, 8),  # another offset
        (5, 2, 0, 8, 1, 8),  # another batch
        (5, 2, 3, 8, 1, 8),  # another first row
        (5, 2, 3, 5, 1, 8),  # fewer rows
        (5, 2, 3, 5, 4, 8),  # another ratio
        (5, 2, 3, 5, 4, 3),  # fewer keys
        (0, 1, 0, 8, 1, 8),  # the first again
    ]
    for offset, b, r0, rows, ratio, sk in cases:
        offsets = torch.full((b,), offset, dtype=torch.int32)
        want = causal_key_counts(offsets, r0, rows, ratio, sk).view(-1)
        got = _constant_key_counts(offset, b, r0, rows, ratio, sk, CPU)
        assert got.dtype == torch.int32 and torch.equal(got, want), (offset, b, r0, rows)
        assert torch.equal(_constant_offsets(offset, b, CPU), offsets)
        assert torch.equal(
            _causal_offsets(offset, b, CPU, "batch row", rows=rows, validate=False), offsets
        )
    assert torch.equal(
        _causal_offsets(None, 3, CPU, "batch row", rows=4, validate=False),
        torch.zeros(3, dtype=torch.int32),
    )


# ------------------------------------------------------------------- WindowScores' layouts


@st.composite
def strided_scores(draw):
    """float32 scores ``(*rows, columns)`` of unit column stride over a buffer, any row strides
    (0: broadcast; below the columns: overlapping), and int32 lengths in ``[0, columns]``."""
    columns = draw(st.integers(0, 5))
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    strides = draw(st.lists(st.integers(0, 3 * columns + 3), min_size=len(sizes),
                            max_size=len(sizes)))  # fmt: skip
    span = sum(st_ * (n - 1) for st_, n in zip(strides, sizes, strict=True)) + max(columns, 1)
    buffer = torch.arange(span, dtype=torch.float32)
    scores = buffer.as_strided((*sizes, columns), (*strides, 1))
    lengths = torch.tensor(
        draw(
            st.lists(
                st.integers(0, columns),
                min_size=math.prod(sizes),
                max_size=math.prod(sizes),
            )
        ),
        dtype=torch.int32,
    ).view(sizes)
    return buffer, scores, lengths


def _offsets(t: torch.Tensor) -> list[int]:
    """Every element's storage offset, computed one by one."""
    return [
        t.storage_offset() + sum(i * s for i, s in zip(index, t.stride(), strict=True))
        for index in itertools.product(*(range(n) for n in t.shape))
    ]


@given(strided_scores())
def test_window_scores_refuse_rows_that_share_memory(case):
    """Accepted layouts have every element in memory of its own (a direct enumeration of the
    offsets); a layout whose rows share memory is refused, so masked() never writes another
    row; masked() writes -inf exactly past each row's length and nothing outside the view."""
    buffer, scores, lengths = case
    offsets = _offsets(scores)
    shared = len(set(offsets)) < len(offsets)
    try:
        window = WindowScores(scores, lengths)
    except ValueError as exc:
        assert "not rows of their own memory" in str(exc)
        return
    assert not shared, (scores.shape, scores.stride())
    before = buffer.clone()
    want = scores.clone()
    for index in itertools.product(*(range(n) for n in scores.shape[:-1])):
        want[index][int(lengths[index]) :] = float("-inf")
    try:
        window.masked()
    except ValueError as exc:  # a layout torch cannot view as (rows, columns)
        assert "not rows uniformly apart" in str(exc)
        return
    assert torch.equal(scores, want)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[offsets] = False
    assert torch.equal(buffer[outside], before[outside])


@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 3))
def test_padded_row_major_scores_are_accepted(rows, columns, pad):
    """DeepGEMM's layout: rows ``columns + pad`` floats apart in one buffer."""
    buffer = torch.zeros(rows * (columns + pad))
    scores = buffer.as_strided((rows, columns), (columns + pad, 1))
    lengths = torch.full((rows,), columns, dtype=torch.int32)
    assert torch.equal(WindowScores(scores, lengths).masked(), buffer.view(rows, -1)[:, :columns])
