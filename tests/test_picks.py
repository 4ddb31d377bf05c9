"""TokenLayout and TopkPicks: the engines' layout of picks and the one check of picks that enter from outside."""

import pytest
import torch

from dsa_precision.picks import TokenLayout


def test_token_layout_check_rows_is_the_row_count_rule_of_picks_and_digests():
    """One row-count rule for picks (check_indices) and engine digests (replay): BSHD a whole
    number of sequences, THD with host cu_seqlens exactly cu_seqlens[-1] rows, the fix named."""
    bshd = TokenLayout(seq_len=4)
    bshd.check_rows("d", 8)
    with pytest.raises(ValueError, match=r"d: 6 token rows are not a whole number .* seq_len=4"):
        bshd.check_rows("d", 6)
    thd = TokenLayout(cu_seqlens=torch.tensor([0, 3, 5]))
    thd.check_rows("d", 5)
    with pytest.raises(ValueError, match=r"d: 6 token rows but cu_seqlens ends at 5; pass five"):
        thd.check_rows("d", 6, fix="pass five")
    with pytest.raises(ValueError, match=r"ends at 5; the picks must hold one row per packed"):
        thd.check_indices("picks", torch.zeros(6, 2, dtype=torch.int32))
