"""The row-digest kernel in Triton's interpreter against the pure-Python reference."""

import pytest
import torch

from dsa_precision.capture import digest_row_reference
from dsa_precision.kernels.digest import _digest_picks


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("block", [None, 8])
def test_digests_are_the_references(dtype, block):
    g = torch.Generator().manual_seed(0)
    rows, k = 7, 37  # a ragged last step for block 8
    picks = torch.randint(-1, 30000, (rows, k), generator=g).to(dtype)
    picks[0] = -1  # an empty row digests to the reference's value of no key
    picks[1, ::2] = -1
    got = _digest_picks(picks, block=block)
    assert got.tolist() == [digest_row_reference(r) for r in picks.tolist()]
    strided = torch.randint(0, 100, (rows, 2 * k), generator=g).to(dtype)[:, :k]  # row stride 2k
    assert _digest_picks(strided).tolist() == [digest_row_reference(r) for r in strided.tolist()]
