"""The tail mask of DeepGEMM's scores in Triton's interpreter against the torch expression."""

import pytest
import torch

from dsa_precision.kernels.mask_tails import _mask_tails


def test_writes_exactly_the_tails_of_padded_rows():
    g = torch.Generator().manual_seed(0)
    rows, columns, stride = 7, 2 * 1024 + 3, 2 * 1024 + 256  # several blocks, a ragged last one
    buf = torch.randn(rows + 2, stride, generator=g)
    counts = torch.tensor([0, 1, 1023, 1024, 1500, columns, columns - 1], dtype=torch.int32)
    logits = buf[:rows, :columns]
    want = buf.clone()
    cols = torch.arange(columns)
    want[:rows, :columns].masked_fill_(cols >= counts.long().unsqueeze(1), float("-inf"))
    got = _mask_tails(logits, counts)
    assert got.data_ptr() == buf.data_ptr()  # in place
    assert torch.equal(buf, want)  # the padding columns and rows are untouched
    _mask_tails(torch.empty(0, 5), torch.empty(0, dtype=torch.int32))  # no launch


def test_rejects_other_layouts():
    with pytest.raises(ValueError, match="unit column stride"):
        _mask_tails(torch.empty(4, 4).t(), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32 counts"):
        _mask_tails(torch.empty(4, 4), torch.zeros(4, dtype=torch.int64))
