"""Replay checks that also run on the CPU."""

import torch

from dsa_precision.sparse_attention import sparse_mla_attention
from dsa_precision.testing import assert_replays_bit_exact


def test_sparse_attention_replays_bit_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 4, 72, generator=g).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(80, 72, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.randint(-1, 80, (64, 16), generator=g, dtype=torch.int32)
    assert_replays_bit_exact(
        lambda q, kv: sparse_mla_attention(q, kv, idx, 0.1, 64), (q, kv), backward=True
    )


def test_assert_replays_reports_output_and_index():
    calls = []

    def flaky(x):
        calls.append(1)
        y = x.clone()
        if len(calls) == 2:
            y[1, 2] += 1
        return {"scores": y, "n": 3}

    try:
        assert_replays_bit_exact(flaky, (torch.zeros(3, 4),), what="flaky")
    except AssertionError as exc:
        assert (
            "flaky: replay 1" in str(exc) and "out['scores']" in str(exc) and "(1, 2)" in str(exc)
        )
    else:
        raise AssertionError("a differing replay was not reported")
    nan = torch.full((2,), float("nan"))
    assert_replays_bit_exact(lambda x: x * 1, (nan,))  # NaN-aware: same payload is equal
