"""Boundary ties and the classification of differing rows (``dsa_precision.ties``), against a
direct computation in the test: a row's sorted scores for the margin, and every valid top-k of a
small row enumerated for the classification."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_precision import indexer_topk
from dsa_precision.ties import (
    INVALID,
    PRECISION,
    SAME,
    TIE,
    classify_rows,
    selection_margins,
)

NEG = float("-inf")


def _valid_topks(row: list[float], length: int, k: int) -> set[frozenset[int]]:
    """Every set of min(k, |V|) valid keys whose smallest score is >= every other's (by brute
    force over the subsets)."""
    valid = [c for c in range(length) if row[c] != NEG and row[c] == row[c]]
    n = min(k, len(valid))
    out = set()
    for subset in itertools.combinations(valid, n):
        rest = [row[c] for c in valid if c not in subset]
        if not rest or min(row[c] for c in subset) >= max(rest):
            out.add(frozenset(subset))
    return out


rows_st = st.integers(2, 9).flatmap(
    lambda width: st.tuples(
        st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, 3.0, NEG]), min_size=width, max_size=width),
        st.integers(1, width),
        st.integers(1, width),
    )
)


@settings(max_examples=200, deadline=None)
@given(rows_st, st.randoms(use_true_random=False))
def test_classification_is_the_brute_force_set_of_valid_topks(case, rnd):
    row, length, k = case
    scores = torch.tensor([row])
    lengths = torch.tensor([length])
    train = indexer_topk(scores, k, seq_lens=lengths)
    valid = [c for c in range(length) if row[c] != NEG]
    candidates = list(_valid_topks(row, length, k))
    # An engine set: a valid top-k, any subset of valid keys, or one breaking the index rule.
    kind = rnd.randrange(3)
    if kind == 0 and candidates:
        chosen = sorted(rnd.choice(candidates))
    elif kind == 1 and valid:
        chosen = sorted(rnd.sample(valid, rnd.randint(1, min(k, len(valid)))))
    else:
        chosen = [rnd.choice([length, -2, 0])] + ([0] if k > 1 else [])
    engine = torch.full((1, k), -1, dtype=torch.int32)
    engine[0, : len(chosen)] = torch.tensor(chosen[:k], dtype=torch.int32)
    cause = int(classify_rows(train, engine, scores, lengths=lengths).cause[0])
    picks = [c for c in engine[0].tolist() if c != -1]
    train_set = {c for c in train[0].tolist() if c >= 0}
    broken = any(
        c < -1 or c >= length or row[c] == NEG for c in engine[0].tolist() if c != -1
    ) or len(set(picks)) != len(picks)
    if broken:
        assert cause == INVALID
    elif set(picks) == train_set:
        assert cause == SAME
    elif frozenset(picks) in _valid_topks(row, length, k):
        assert cause == TIE
    else:
        assert cause == PRECISION


@settings(max_examples=200, deadline=None)
@given(rows_st)
def test_margin_is_the_kth_minus_the_next_score(case):
    row, length, k = case
    scores = torch.tensor([row])
    lengths = torch.tensor([length])
    picks = indexer_topk(scores, k, seq_lens=lengths)
    margin = float(selection_margins(scores, picks, lengths)[0])
    valid = sorted((row[c] for c in range(length) if row[c] != NEG), reverse=True)
    if len(valid) <= k:
        assert margin != margin  # NaN: no key left out
    else:
        assert margin == valid[k - 1] - valid[k]


def test_margins_read_windows_and_tie_across_signed_zeros():
    scores = torch.tensor([[9.0, 0.0, -0.0, 1.0, 5.0]])
    window = dict(lengths=torch.tensor([3]), starts=torch.tensor([1]))  # columns 1, 2, 3
    # Keys {2, 0} = columns {3, 1}: 1.0 and 0.0, leaving -0.0 out: a tie across the zeros.
    assert float(selection_margins(scores, torch.tensor([[2, 0]]), **window)[0]) == 0.0
    # Keys {2, 1} = columns {3, 2}: 1.0 and -0.0, leaving 0.0 out: a tie too.
    assert float(selection_margins(scores, torch.tensor([[2, 1]]), **window)[0]) == 0.0
    # Columns 0 (9.0) and 4 (5.0) lie outside the window; a window of 4 reads 5.0.
    wider = dict(lengths=torch.tensor([4]), starts=torch.tensor([1]))
    assert float(selection_margins(scores, torch.tensor([[2, 0]]), **wider)[0]) == -5.0


def test_only_the_rows_that_differ_are_scored():
    scores = torch.tensor([[3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 1.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    train = indexer_topk(scores, 2)
    engine = train.clone()
    engine[0] = torch.tensor([0, 2])  # a tie
    engine[2] = torch.tensor([0, 3])  # not a top-k
    asked = []

    def score_rows(rows):
        asked.append(rows.tolist())
        return scores[rows]

    causes = classify_rows(train, engine, score_rows)
    assert asked == [[0, 2]]
    assert causes.cause.tolist() == [TIE, SAME, PRECISION]
    assert causes.counts() == {"same": 1, "tie": 1, "precision": 1, "invalid": 0}
    assert int(causes.scored_rows) == 2
    assert causes.rows(TIE).tolist() == [0]
    asked.clear()
    assert classify_rows(train, train, score_rows).counts()["same"] == 3 and asked == []


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(train_idx=torch.zeros(2, 2)), "int16/int32/int64 picks"),
        (dict(infer_idx=torch.zeros(3, 2, dtype=torch.int32)), "same rows"),
        (dict(lengths=torch.ones(3, dtype=torch.int64)), r"one count per row, shape \(2,\)"),
        (dict(lengths=torch.ones(2)), "integer tensor"),
        (dict(scores=torch.zeros(2, 4, dtype=torch.int32)), "float scores of the same rows"),
        (dict(scores=lambda rows: torch.zeros(5, 4)), r"must return \(1, S_k\)"),
    ],
)
def test_bad_input_is_named(kw, match):
    args = dict(
        train_idx=torch.tensor([[0, 1], [0, 1]], dtype=torch.int32),
        infer_idx=torch.tensor([[0, 1], [0, 2]], dtype=torch.int32),
        scores=torch.zeros(2, 4),
    )
    args.update(kw)
    with pytest.raises((TypeError, ValueError), match=match):
        classify_rows(args.pop("train_idx"), args.pop("infer_idx"), args.pop("scores"), **args)
