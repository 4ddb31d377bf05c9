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
