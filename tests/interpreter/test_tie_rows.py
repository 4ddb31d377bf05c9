"""The tie replay's counting kernel in Triton's interpreter against the torch expression the
engine side uses on the CPU."""

import pytest
import torch

from dsa_precision.kernels.tie_rows import count_at_least


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 16])
def test_counts_the_window_keys_at_least_the_threshold(dtype, block):
    g = torch.Generator().manual_seed(0)
    rows, width = 9, 70
    logits = torch.randint(-2, 3, (rows, width), generator=g).float()
    logits[0, :5] = torch.tensor([0.0, -0.0, float("nan"), float("-inf"), float("inf")])
    logits = logits.to(dtype)
    kth = torch.randint(-2, 3, (rows,), generator=g).float()
    kth[0] = 0.0  # -0.0 counts as 0.0, NaN never
    kth[1] = float("-inf")
    starts = torch.randint(0, 30, (rows,), generator=g, dtype=torch.int32)
    ends = (starts + torch.randint(0, 41, (rows,), generator=g, dtype=torch.int32)).clamp(max=width)
    starts[0], ends[0] = 0, 5
    cols = torch.arange(width)
    inside = (cols >= starts[:, None]) & (cols < ends[:, None])
    want = ((logits.float() >= kth[:, None]) & inside).sum(-1).to(torch.int32)
    got = count_at_least(logits, kth, starts, ends, block=block)
    assert torch.equal(got, want)
    assert int(got[0]) == 3  # 0.0, -0.0 and +inf; not NaN, not -inf
