"""The top-k fix-up kernel in Triton's interpreter against the torch expression it replaces."""

import torch

from dsa_precision.kernels.topk_picks import drop_invalid_picks


def test_drops_exactly_the_minus_inf_and_nan_picks():
    g = torch.Generator().manual_seed(0)
    n = 3 * 2048 + 5  # several programs and a ragged tail
    values = torch.randn(n, generator=g)
    kinds = torch.randint(0, 6, (n,), generator=g)
    values[kinds == 0] = float("-inf")
    values[kinds == 1] = float("nan")
    values[kinds == 2] = float("inf")  # a +inf score is a valid pick
    values[:4] = torch.tensor([-0.0, 0.0, -3.4e38, float("-inf")])
    indices = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32)
    want = indices.clone().masked_fill_(~(values > float("-inf")), -1)
    empty = drop_invalid_picks(torch.empty(0, dtype=torch.int32), torch.empty(0))  # no launch
    assert empty.numel() == 0
    got = drop_invalid_picks(indices, values)
    assert got.data_ptr() == indices.data_ptr()  # in place
    assert torch.equal(got, want)
    assert torch.equal(got == -1, values.isnan() | values.isneginf())
