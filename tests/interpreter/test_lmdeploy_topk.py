"""LMDeploy 0.18.0's Triton ``bitonic_topk`` (its DSA indexer's top-k for a top-k other than 512
and 2048, or without TileLang), run unmodified by Triton's interpreter on the CPU from
``DSA_ENGINE_KERNELS`` (skipped without it): the exact top-k on rows without ties; on an exact
tie its compare-and-swap keeps one key twice and drops the other (a repeated key: INVALID)."""

import pytest
import torch

from conformance import lmdeploy_topk
from dsa_precision import classify_rows, indexer_topk
from dsa_precision.ties import INVALID, PRECISION, SAME, selection_margins


@pytest.fixture(autouse=True)
def _files():
    reason = lmdeploy_topk.missing_reason("bitonic")
    if reason is not None:
        pytest.skip(reason)


def test_rows_without_ties_are_the_exact_topk():
    g = torch.Generator().manual_seed(0)
    rows, width, k = 5, 160, 32
    s = torch.randn(rows, width, generator=g)  # distinct scores: no row has a tie
    lengths = torch.tensor([160, 100, 32, 7, 65], dtype=torch.int32)
    picks = lmdeploy_topk.run("bitonic", s, lengths, k)
    exact = indexer_topk(s, k, seq_lens=lengths)
    assert picks.dtype == torch.int32 and picks.shape == (rows, k)
    assert bool((classify_rows(exact, picks, s, lengths=lengths).cause == SAME).all())
    assert bool((picks[3, 7:] == -1).all())  # a short row: -1 past its keys


def test_an_exact_tie_repeats_a_key():
    """``_compare_and_swap`` swaps where ``(x > y) != (flip ^ is_right)``: for two equal scores
    the left element keeps its key and the right one takes it too (Triton's own
    ``_compare_and_swap`` compares the pair symmetrically instead)."""
    s = torch.tensor([[3.0, 1.0, 1.0, 2.0] + [-5.0] * 12])
    lengths = torch.tensor([4], dtype=torch.int32)
    picks = lmdeploy_topk.run("bitonic", s, lengths, 4)
    assert sorted(picks[0].tolist()) == [0, 2, 2, 3]  # key 1 lost, key 2 twice
    exact = indexer_topk(s, 4, seq_lens=lengths)
    assert int(classify_rows(exact, picks, s, lengths=lengths).cause[0]) == INVALID


def test_tied_rows_of_longer_rows_are_invalid_or_the_exact_set():
    g = torch.Generator().manual_seed(1)
    rows, width, k = 4, 128, 16
    s = torch.randint(-4, 5, (rows, width), generator=g).float()  # many ties
    lengths = torch.full((rows,), width, dtype=torch.int32)
    exact = indexer_topk(s, k, seq_lens=lengths)
    tied = selection_margins(s, exact, lengths) == 0
    picks = lmdeploy_topk.run("bitonic", s, lengths, k)
    cause = classify_rows(exact, picks, s, lengths=lengths).cause
    assert bool(tied.all())
    # Never a wrong set of valid keys; where ties meet in the network, a repeated key.
    assert not bool((cause == PRECISION).any()), cause.tolist()
    assert bool((cause == INVALID).any())
