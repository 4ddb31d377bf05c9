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
    train[swap] = torch.randint(sk, sk + 20, (int(swap.sum()),), generator=g)  # picks outside I
    infer[:5, 6:] = -1  # short rows
    train[5:8] = train[5:8].flip(-1)  # order does not matter
    infer[8] = -1  # empty inference row: excluded
    got = topk_agreement(train.to(dtype).view(3, 20, k), infer.to(dtype).view(3, 20, k)).as_dict()
    want = python_metrics(train, infer)
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
