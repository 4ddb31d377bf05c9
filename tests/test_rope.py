"""RoPE of the indexer (dsa_precision.rope): per-token angles of packed sequences."""

import itertools

import pytest
import torch


def _positions_reference(cu: list[int]) -> list[int]:
    return [t - a for a, b in itertools.pairwise(cu) for t in range(a, b)]


@pytest.mark.parametrize("cu", [[0, 5], [0, 3, 3, 10], [0, 1, 2, 3, 4], [0, 7, 8, 16]])
def test_thd_token_freqs_restarts_positions_per_sequence(cu):
    from dsa_precision.preprocess import thd_token_freqs

    freqs = torch.randn(9, 1, 1, 8)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    want = freqs[_positions_reference(cu)] if longest <= 9 else None
    for total in (None, cu[-1]):
        if want is None:
            with pytest.raises(ValueError, match="freqs covers 9 positions but a packed sequence"):
                thd_token_freqs(freqs, cu_t, total)
            continue
        got = thd_token_freqs(freqs, cu_t, total)
        assert torch.equal(got, want), (cu, total)
    table = torch.randn(cu[-1], 1, 1, 8)  # one row per packed token: used as is
    assert thd_token_freqs(table, cu_t, cu[-1]) is table


def test_thd_token_freqs_checks_host_lengths_against_the_rows():
    from dsa_precision.preprocess import thd_token_freqs

    freqs = torch.randn(8, 1, 1, 8)
    with pytest.raises(ValueError, match=r"packs 6 tokens but the input has 7 packed rows"):
        thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 7)
    # more packed tokens than rows (a padded tail past the input): the first rows' angles
    assert torch.equal(thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 3), freqs[[0, 1, 0]])
    with pytest.raises(ValueError, match="total=-1 must be a positive integer"):
        thd_token_freqs(freqs, torch.tensor([0, 2]), -1)


def test_thd_token_freqs_of_no_rows_and_a_models_own_rope_with_padded_rows():
    from dsa_precision.preprocess import IndexerPreprocess, thd_token_freqs

    freqs = torch.randn(4, 1, 1, 16)
    assert thd_token_freqs(freqs, torch.tensor([0]), 0).shape == (0, 1, 1, 16)
    # A model's own RoPE (rope_fn) takes freqs and cu_seqlens itself: rows past cu_seqlens[-1]
    # (padding) are its business, no per-token table is built.
    seen = []

    def rope_fn(x, f, mscale, cu):
        seen.append(cu.tolist())
        return x

    pre = IndexerPreprocess(
        head_dim=64, rope_dim=16, k_norm=torch.nn.LayerNorm(64), rope_fn=rope_fn
    )
    q, k = torch.randn(6, 1, 2, 64), torch.randn(6, 1, 64)
    pre(q, k, freqs, cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32))
    assert seen == [[0, 4, 5], [0, 4, 5]]
