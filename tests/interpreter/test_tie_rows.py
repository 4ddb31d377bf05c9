"""The tie replay's one-pass kernel in Triton's interpreter against the torch path the engine
side takes on the CPU (the row digests and the margin test of capture.engine_tie_rows)."""

import pytest
import torch

from dsa_precision.capture import digest_rows, engine_tie_rows
from dsa_precision.kernels.tie_rows import tie_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [(None, None), (8, 16)])
def test_digests_and_rows_sent_are_the_torch_paths(dtype, blocks):
    g = torch.Generator().manual_seed(0)
    rows, width, k = 12, 70, 6
    logits = torch.randint(-2, 3, (rows, width), generator=g).float()
    logits[:, ::5] = -0.0  # signed zeros tie with zeros
    logits[0, 3] = float("nan")  # a NaN key: never counted
    logits = logits.to(dtype)
    starts = torch.randint(0, 30, (rows,), generator=g, dtype=torch.int32)
    lengths = torch.randint(1, 41, (rows,), generator=g, dtype=torch.int32)
    picks = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):  # a random valid subset of the window, some rows short
        n = min(int(lengths[r]), int(torch.randint(1, k + 1, (), generator=g)))
        picks[r, :n] = torch.randperm(int(lengths[r]), generator=g)[:n].to(torch.int32)
    picks[1, 0] = 3 - int(starts[1])  # row 1 picks a NaN key: its smallest score is NaN
    picks[1, 0] = max(int(picks[1, 0]), 0)
    logits[1, int(starts[1]) + int(picks[1, 0])] = float("nan")
    digests, sent = tie_rows(logits, picks, starts, lengths, block_picks=blocks[0],
                             block_keys=blocks[1])  # fmt: skip
    assert torch.equal(digests, digest_rows(picks))
    reference = engine_tie_rows(logits, picks, lengths.long(), starts=starts.long())  # CPU path
    assert sent.nonzero().view(-1).tolist() == reference.rows.tolist()
    assert 0 < int(sent.sum()) < rows and not bool(sent[1])


@pytest.mark.parametrize("k", [8, 6])
def test_a_row_holding_a_key_twice_is_sent_and_padding_never_repeats(k):
    """LMDeploy's bitonic top-k may return a key twice: such a row is sent even though its margin
    is positive; ``-1`` padding (anywhere in the row) never counts as a repeated key."""
    rows, width = 5, 64
    logits = torch.arange(rows * width, dtype=torch.float32).view(rows, width).flip(-1).contiguous()
    top = torch.arange(k, dtype=torch.int32).expand(rows, k).clone()  # the highest scores first
    top[1, k - 1] = top[1, 0]  # a key twice: the k-th key displaced, the margin still positive
    top[2] = torch.tensor([0, 1, -1, *range(2, k - 1)])  # padding inside: the top k - 1
    top[3] = torch.tensor([0, -1, -1, *range(1, k - 2)])
    top[4] = torch.tensor([-1, 0, 1, 1, *range(2, k - 2)])  # padding and a key twice
    starts = torch.zeros(rows, dtype=torch.int32)
    lengths = torch.full((rows,), width, dtype=torch.int32)
    digests, sent = tie_rows(logits, top, starts, lengths)
    assert sent.nonzero().view(-1).tolist() == [1, 4]
    reference = engine_tie_rows(logits, top, lengths.long())  # the CPU path: margins and a sort
    assert reference.rows.tolist() == [1, 4]
    assert torch.equal(digests, digest_rows(top))


def test_more_picks_than_the_kernel_sorts_is_refused():
    from dsa_precision.kernels.tie_rows import MAX_SORTED_PICKS

    k = MAX_SORTED_PICKS + 1
    logits = torch.zeros(1, k)
    with pytest.raises(ValueError, match="more than the 4096 the kernel sorts"):
        tie_rows(logits, torch.zeros(1, k, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                 torch.ones(1, dtype=torch.int32))  # fmt: skip
