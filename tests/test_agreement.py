import pytest
import torch

from dsa_precision import topk_agreement


def python_metrics(train, infer):
    rows = [
        (set(t) - {-1}, set(i) - {-1})
        for t, i in zip(
            train.reshape(-1, train.shape[-1]).tolist(),
            infer.reshape(-1, infer.shape[-1]).tolist(),
            strict=True,
        )
    ]
    rows = [(t, i) for t, i in rows if i]
    flips = [len(i - t) for t, i in rows]
    return dict(
        member_agreement=sum(len(t & i) for t, i in rows) / sum(len(i) for _, i in rows),
        rows_identical=sum(t == i for t, i in rows) / len(rows),
        flipped_mean=sum(flips) / len(rows),
        flipped_max=max(flips),
        rows=len(rows),
        members=sum(len(i) for _, i in rows),
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_set_arithmetic(dtype):
    g = torch.Generator().manual_seed(3)
    sk, k = 50, 12
    infer = torch.stack([torch.randperm(sk, generator=g)[:k] for _ in range(60)])
    train = infer.clone()
    swap = torch.rand(60, k, generator=g) < 0.1
    train[swap] = sk + torch.arange(int(swap.sum()))  # distinct picks outside I
    infer[:5, 6:] = -1  # short rows
    train[5:8] = train[5:8].flip(-1)  # order does not matter
    infer[8] = -1  # empty inference row: excluded
    got = topk_agreement(train.to(dtype).view(3, 20, k), infer.to(dtype).view(3, 20, k)).as_dict()
    want = python_metrics(train, infer) | {"broken_rows": 0}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_identical_and_errors():
    """The same sets in another order and padding layout agree fully; one changed member shows."""
    x = torch.tensor([[1, 2, -1], [4, 3, 0]])
    same = torch.tensor([[-1, 2, 1], [0, 4, 3]])
    got = topk_agreement(same, x).as_dict()
    assert (
        got["member_agreement"] == 1.0 and got["rows_identical"] == 1.0 and got["flipped_max"] == 0
    )
    got = topk_agreement(torch.tensor([[-1, 2, 1], [0, 4, 5]]), x).as_dict()
    assert got["member_agreement"] == 4 / 5 and got["rows_identical"] == 0.5
    assert got["flipped_max"] == 1
    with pytest.raises(ValueError, match="same rows"):
        topk_agreement(x, torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="int16/int32/int64"):
        topk_agreement(x.float(), x)


# The index rule: keys >= 0, -1 pads, no key twice in a row (the same rule as the agree command).
BROKEN = {
    "repeated key": (torch.tensor([[1, 2, -1], [4, 4, -1]]), r"row 1 of 2 .* repeats a key"),
    "negative": (torch.tensor([[1, 2, -1], [4, -3, -1]]), r"row 1 of 2 .* holds -3; keys are >= 0"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("side", ["train_idx", "infer_idx"])
def test_the_index_rule_is_an_error_with_validate(case, side):
    broken, message = BROKEN[case]
    good = torch.tensor([[1, 2, -1], [4, 5, -1]])
    args = (broken, good) if side == "train_idx" else (good, broken)
    with pytest.raises(ValueError, match=f"^{side}: {message}"):
        topk_agreement(*args, validate=True)


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("side", ["train_idx", "infer_idx"])
def test_without_validate_a_broken_row_makes_the_metrics_nan(case, side):
    """No host sync, but never an agreement: a repeated key would otherwise count twice and a
    -3 would pass as padding."""
    broken, _ = BROKEN[case]
    good = torch.tensor([[1, 2, -1], [4, 5, -1]])
    args = (broken, good) if side == "train_idx" else (good, broken)
    got = topk_agreement(*args)
    for name in ("member_agreement", "rows_identical", "flipped_mean"):
        assert torch.isnan(getattr(got, name)), name
    # Padding may repeat: -1 twice in a row is not a violation.
    assert topk_agreement(good, good, validate=True).as_dict()["member_agreement"] == 1.0


def test_k_zero_and_zero_dim_are_clear_errors():
    empty = torch.zeros(3, 0, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"train_idx has shape \(3, 0\): k = 0 slots per row"):
        topk_agreement(empty, empty)
    with pytest.raises(ValueError, match="0-d tensor"):
        topk_agreement(torch.tensor(1), torch.tensor(1))


def test_nothing_compared_never_reads_as_a_match():
    train = torch.tensor([[0, 1], [2, 3]])
    padding = torch.full((2, 2), -1)  # no engine row: nothing to compare
    got = topk_agreement(train, padding).as_dict()
    assert got["rows"] == 0 and got["members"] == 0
    for name in ("member_agreement", "rows_identical", "flipped_mean"):
        assert got[name] != got[name], name  # NaN
    empty = topk_agreement(
        torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64)
    )
    assert empty.as_dict()["rows"] == 0 and torch.isnan(empty.member_agreement)


def test_with_scores_the_differing_rows_are_told_apart():
    # Row 0: the same set; 1: another valid top-k of a tied boundary; 2: a key below the k-th
    # score taken (precision); 3: a key twice (invalid); 4: no engine row (not compared).
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 5)
    scores[1] = torch.tensor([4.0, 2.0, 2.0, 1.0])
    train = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1]])
    infer = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 1], [-1, -1]])
    got = topk_agreement(train, infer, scores=scores).as_dict()
    assert (got["tie_rows"], got["precision_rows"], got["invalid_rows"]) == (1, 1, 1)
    assert got["rows"] == 4
    asked = []

    def score_rows(rows):
        asked.append(rows.tolist())
        return scores[rows]

    by_function = topk_agreement(train, infer, scores=score_rows).as_dict()
    assert asked == [[1, 2, 3, 4]]  # only the rows that differ are scored
    assert by_function["tie_rows"] == 1 and by_function["precision_rows"] == 1
    assert "tie_rows" not in topk_agreement(train, infer).as_dict()
    with pytest.raises(ValueError, match=r"lengths=.*qualifies scores="):
        topk_agreement(train, infer, lengths=torch.full((5,), 4))
