"""indexer_topk (torch path) against a per-row Python reference."""

import math

import pytest
import torch

from dsa_precision import indexer_topk


def reference_topk(row: list[float], k: int, seq_len: int) -> list[int]:
    """Largest scores among keys < seq_len that are not -inf; ties -> lower index;
    +0.0 ranks above -0.0; ascending output, -1 padded."""
    cand = [(v, i) for i, v in enumerate(row[:seq_len]) if v != -math.inf]
    cand.sort(key=lambda vi: (-vi[0], -math.copysign(1.0, vi[0]), vi[1]))
    picked = sorted(i for _, i in cand[:k])
    return picked + [-1] * (k - len(picked))


def check(scores, k, seq_lens=None, **kw):
    got = indexer_topk(scores, k, seq_lens=seq_lens, backend="torch", **kw)
    assert got.dtype == torch.int32 and got.shape == (*scores.shape[:-1], k)
    flat = scores.reshape(-1, scores.shape[-1]).tolist()
    lens = [scores.shape[-1]] * len(flat) if seq_lens is None else seq_lens.reshape(-1).tolist()
    want = [reference_topk(r, k, n) for r, n in zip(flat, lens, strict=True)]
    assert got.reshape(len(flat), k).tolist() == want


@pytest.mark.parametrize("k", [1, 3, 16, 50])
def test_random_scores_with_masks(k):
    scores = torch.randn(2, 7, 33)
    scores[0, :, 20:] = float("-inf")
    check(scores, k)
    check(scores, k, seq_lens=torch.randint(0, 34, (2, 7)))


def test_exact_ties_break_toward_lower_index():
    scores = torch.zeros(4, 64)  # e.g. keys whose heads are all ReLU-zero
    scores[1, ::3] = 1.0
    scores[2] = torch.randint(0, 3, (64,)).float()
    check(scores, 10)
    got = indexer_topk(scores, 10, backend="torch")
    assert got[0].tolist() == list(range(10))


def test_signed_zeros_rank_like_the_radix_kernel():
    row = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0]])
    assert indexer_topk(row, 2, backend="torch").tolist() == [[1, 3]]
    assert indexer_topk(row, 3, backend="torch").tolist() == [[0, 1, 3]]


def test_fewer_valid_keys_than_k_pads_with_minus_one():
    scores = torch.full((1, 3, 8), float("-inf"))
    scores[0, 1, :2] = torch.tensor([0.5, 2.0])
    scores[0, 2] = torch.arange(8.0)
    got = indexer_topk(scores, 4, backend="torch")
    assert got.tolist() == [[[-1] * 4, [0, 1, -1, -1], [4, 5, 6, 7]]]
    assert indexer_topk(scores, 4, seq_lens=torch.tensor([[8, 1, 6]]), backend="torch")[
        0, 2
    ].tolist() == [2, 3, 4, 5]


def test_bf16_scores_and_deterministic_false_select_valid_sets():
    scores = torch.randn(5, 40)
    check(scores.to(torch.bfloat16).float(), 7)
    got = indexer_topk(scores.to(torch.bfloat16), 7, backend="torch")
    check_vals = indexer_topk(scores.to(torch.bfloat16).float(), 7, backend="torch")
    assert torch.equal(got, check_vals)
    loose = indexer_topk(torch.randn(5, 40), 7, deterministic=False, backend="torch")
    assert (loose >= 0).all() and torch.equal(loose, loose.sort(-1).values)


def test_empty_inputs():
    assert indexer_topk(torch.empty(0, 5), 3, backend="torch").shape == (0, 3)
    assert indexer_topk(torch.empty(2, 0), 3, backend="torch").tolist() == [[-1] * 3] * 2


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(k=0), ValueError, "k=0"),
        (dict(k=-2), ValueError, "k=-2"),
        (dict(k=2.5), ValueError, "k=2.5"),
        (dict(scores=torch.ones(2, 4, dtype=torch.int32)), TypeError, "scores has dtype"),
        (dict(seq_lens=torch.tensor([1, 2, 3])), ValueError, "seq_lens has shape"),
        (dict(seq_lens=torch.tensor([1.0, 2.0])), TypeError, "seq_lens has dtype"),
        (dict(seq_lens=torch.tensor([1, 5])), ValueError, r"\[0, S_k=4\]"),
        (dict(seq_lens=torch.tensor([-1, 2])), ValueError, r"\[0, S_k=4\]"),
        (dict(backend="radix"), ValueError, "backend='radix'"),
    ],
)
def test_bad_inputs(kwargs, err, match):
    args = dict(scores=torch.randn(2, 4), k=2)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        indexer_topk(**args)


def test_explicit_cudnn_without_gpu_raises():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="backend='cudnn' cannot run"):
        indexer_topk(torch.randn(2, 4), 2, backend="cudnn")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_select_streams_chunks_like_scores_then_topk(precision):
    from dsa_precision import indexer_scores, indexer_select

    q, k = torch.randn(2, 40, 32, 128), torch.randn(2, 40, 128)
    w = (torch.randn(2, 40, 32) * 0.02).to(torch.bfloat16)
    want = indexer_topk(indexer_scores(q, k, w, scoring_precision=precision, backend="torch"), 6)
    for kw in ({}, {"chunk_bytes": 8 * 2 * 40 * 20}):
        got = indexer_select(q, k, w, 6, scoring_precision=precision, backend="torch", **kw)
        assert torch.equal(got, want)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    packed = indexer_select(
        q[0],
        k[0],
        w[0],
        6,
        scoring_precision=precision,
        backend="torch",
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    assert torch.equal(packed, want[0])
