"""Row digests: the device digest against the pure-Python reference, per-layer mismatch counts, and verify by digest."""

import pytest
import torch

from dsa_precision.capture import (
    digest_mismatches,
    digest_row_reference,
    digest_rows,
)

from ..support.engine_outputs import causal_picks, engine_rows


def test_digest_matches_the_reference_and_ignores_order_and_padding():
    idx = causal_picks(64, k=16, seed=18).to(torch.int64)
    idx[7] = -1
    d = digest_rows(idx)
    assert d.dtype == torch.int64 and d.shape == (64,)
    assert d.tolist() == [digest_row_reference(r) for r in idx.tolist()]
    shuffled = idx[:, torch.randperm(16, generator=torch.Generator().manual_seed(1))]
    assert torch.equal(digest_rows(shuffled.to(torch.int32)), d)  # order and dtype don't matter
    assert digest_row_reference([]) == 0 == int(d[7])
    # Large keys, and values whose SplitMix products overflow int64 (wraparound arithmetic).
    big = torch.tensor([[2**31 - 1, 65536, 0, -1]])
    assert digest_rows(big).tolist() == [digest_row_reference([2**31 - 1, 65536, 0])]
    assert digest_row_reference([1, 2]) != digest_row_reference([3])  # not just a count


def test_digest_mismatches_counts_rows_per_layer():
    ours = {1: causal_picks(32, seed=19), 3: causal_picks(32, seed=20)}
    engine = {n: digest_rows(t) for n, t in ours.items()}
    changed = ours[3].clone()
    changed[[9, 20], 0] = torch.tensor([-1, -1], dtype=torch.int32)  # two rows lose a key
    masks = digest_mismatches({1: ours[1], 3: changed}, engine)
    assert int(masks[1].sum()) == 0
    assert masks[3].nonzero().flatten().tolist() == [9, 20]
    with pytest.raises(ValueError, match=r"layers differ"):
        digest_mismatches({1: ours[1]}, engine)


def test_engine_digests_verify_training_picks_without_the_payload():
    from dsa_precision.capture import pack_digests

    fulls = {"a": engine_rows(7, 2, seed=26), "b": engine_rows(5, 2, seed=27)}
    # Engine side: digest each request's rows (every token but the last), per layer.
    engine = {r: digest_rows(f[:-1]) for r, f in fulls.items()}  # (n, L) int64
    digests, ran = pack_digests(engine, {"a": 7, "b": 5}, order=["b", "a"])
    assert ran.tolist() == [True] * 4 + [False] + [True] * 6 + [False]
    # Training side: its own picks of the packed micro-batch, one row off in layer 2.
    ours = {n: torch.cat([fulls["b"][:, n - 1], fulls["a"][:, n - 1]]) for n in (1, 2)}
    ours[2] = ours[2].clone()
    ours[2][7, 0] = -1  # request a, token 2 loses a key
    masks = digest_mismatches(ours, digests, ran)
    assert int(masks[1].sum()) == 0  # the last tokens (digest 0 vs a real set) are not counted
    assert masks[2].nonzero().flatten().tolist() == [7]
    with pytest.raises(ValueError, match=r"request 'a': 6 digest rows .* 5 tokens"):
        pack_digests(engine, {"a": 5, "b": 5})
