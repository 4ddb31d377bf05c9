"""Every public entry point answers bad input with an error naming the argument, the value and
the fix, or with a documented, tested result (docs/robustness.md)."""

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    IndexerPreprocess,
    fused_indexer_sparse_attention,
    indexer_scores,
    indexer_select,
    indexer_topk,
    quantize_e4m3_ue8m0,
)


def qkw(b=1, sq=8, sk=8, h=32, d=128):
    return torch.randn(b, sq, h, d), torch.randn(b, sk, d), torch.randn(b, sq, h).to(torch.bfloat16)


def scores_call(**kw):
    q, k, w = qkw()
    args = dict(q=q, k=k, weights=w, scoring_precision="fp8", backend="torch")
    args.update(kw)
    return lambda: indexer_scores(**args)


ERRORS = [
    # (name, call, exception, message pattern)
    ("config: precision", lambda: IndexerPrecisionConfig(scoring_precision="e5m2"), ValueError, r"scoring_precision='e5m2'.*'bf16', 'fp8'"),
    ("config: rope_fp32 type", lambda: IndexerPrecisionConfig(rope_fp32=1), TypeError, "rope_fp32 must be a bool"),
    ("quantize: dtype", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 128, dtype=torch.int8)), TypeError, "x has dtype torch.int8"),
    ("quantize: width", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 96)), ValueError, "last dimension must be 128"),
    ("quantize: floor", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 128), amax_floor=0), ValueError, "amax_floor=0.0"),
    ("preprocess: rank", lambda: IndexerPreprocess(128, 64)(torch.randn(4, 8, 128), torch.randn(4, 1, 128), torch.rand(4, 1, 1, 64)), ValueError, r"q must be \[s, b, h, d\]"),
    ("preprocess: rope width", lambda: IndexerPreprocess(128, 64)(torch.randn(4, 1, 8, 128), torch.randn(4, 1, 128), torch.rand(4, 1, 1, 32)), ValueError, "rope width 32"),
    ("preprocess: THD batch", lambda: IndexerPreprocess(128, 64)(torch.randn(4, 2, 8, 128), torch.randn(4, 2, 128), torch.rand(4, 1, 1, 64), cu_seqlens=torch.tensor([0, 4])), ValueError, "batch 1"),
    ("scores: fp8 head dim", scores_call(q=torch.randn(1, 8, 32, 64), k=torch.randn(1, 8, 64)), ValueError, "head dim 64"),
    ("scores: fp8 16 heads", scores_call(q=torch.randn(1, 8, 16, 128), weights=torch.randn(1, 8, 16)), ValueError, "q has 16"),
    ("scores: q rank", scores_call(q=torch.randn(8, 32, 128)), ValueError, "expected q"),
    ("scores: batch mismatch", scores_call(k=torch.randn(2, 8, 128)), ValueError, "batch mismatch"),
    ("scores: weights shape", scores_call(weights=torch.randn(1, 7, 32)), ValueError, "weights has shape"),
    ("scores: integer q", scores_call(q=torch.ones(1, 8, 32, 128, dtype=torch.int64)), TypeError, "q has dtype torch.int64"),
    ("scores: float64 k", scores_call(k=torch.randn(1, 8, 128, dtype=torch.float64)), TypeError, "k has dtype torch.float64"),
    ("scores: precision", scores_call(scoring_precision="fp4"), ValueError, r"'bf16', 'fp8'"),
    ("scores: backend", scores_call(backend="tilelang"), ValueError, "backend='tilelang'"),
    ("scores: ratio", scores_call(ratio=-1), ValueError, "ratio=-1"),
    ("scores: chunk budget", scores_call(chunk_bytes=0), ValueError, "chunk_bytes=0"),
    ("scores: offsets length", scores_call(q_causal_offsets=torch.tensor([0, 1])), ValueError, "q_causal_offsets has 2"),
    ("scores: offsets sign", scores_call(q_causal_offsets=-3), ValueError, "non-negative"),
    ("scores: cu_seqlens pair", scores_call(cu_seqlens_k=torch.tensor([0, 8])), ValueError, "needs both"),
    ("scores: cu_seqlens end", lambda: indexer_scores(torch.randn(8, 32, 128), torch.randn(8, 128), torch.randn(8, 32), scoring_precision="bf16", backend="torch", cu_seqlens_q=torch.tensor([0, 9]), cu_seqlens_k=torch.tensor([0, 8])), ValueError, "end at the packed length 8"),
    ("scores: cu_seqlens order", lambda: indexer_scores(torch.randn(8, 32, 128), torch.randn(8, 128), torch.randn(8, 32), scoring_precision="bf16", backend="torch", cu_seqlens_q=torch.tensor([0, 5, 3, 8]), cu_seqlens_k=torch.tensor([0, 5, 3, 8])), ValueError, "non-decreasing"),
    ("scores: cu_seqlens count", lambda: indexer_scores(torch.randn(8, 32, 128), torch.randn(8, 128), torch.randn(8, 32), scoring_precision="bf16", backend="torch", cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 4, 8])), ValueError, "same sequences"),
    ("scores: cu_seqlens float", lambda: indexer_scores(torch.randn(8, 32, 128), torch.randn(8, 128), torch.randn(8, 32), scoring_precision="bf16", backend="torch", cu_seqlens_q=torch.tensor([0.0, 8.0]), cu_seqlens_k=torch.tensor([0, 8])), TypeError, "cu_seqlens_q has dtype"),
    ("topk: k", lambda: indexer_topk(torch.randn(2, 8), 0), ValueError, "k=0"),
    ("topk: seq_lens range", lambda: indexer_topk(torch.randn(2, 8), 2, seq_lens=torch.tensor([9, 1])), ValueError, r"\[0, S_k=8\]"),
    ("topk: seq_lens shape", lambda: indexer_topk(torch.randn(2, 8), 2, seq_lens=torch.tensor([1])), ValueError, "seq_lens has shape"),
    ("topk: integer scores", lambda: indexer_topk(torch.ones(2, 8, dtype=torch.int32), 2), TypeError, "scores has dtype"),
    ("topk: backend", lambda: indexer_topk(torch.randn(2, 8), 2, backend="triton"), ValueError, "backend='triton'"),
    ("select: topk", lambda: indexer_select(*qkw(), 0, scoring_precision="bf16", backend="torch"), ValueError, "topk=0"),
    ("fused: fp8 with loss", lambda: fused_indexer_sparse_attention(torch.randn(8, 1, 4, 72), torch.randn(8, 1, 72), torch.randn(8, 1, 32, 128), torch.randn(8, 1, 128), torch.randn(8, 1, 32), topk=4, softmax_scale=0.1, d_v=64, scoring_precision="fp8", loss_coeff=1.0, indexer_loss_fn=lambda *a: a[0].sum()), ValueError, "loss_coeff=1.0"),
    ("fused: ranks", lambda: fused_indexer_sparse_attention(torch.randn(8, 4, 72), torch.randn(8, 1, 72), torch.randn(8, 1, 32, 128), torch.randn(8, 1, 128), torch.randn(8, 1, 32), topk=4, softmax_scale=0.1, d_v=64, scoring_precision="bf16"), ValueError, "expected query"),
]  # fmt: skip


@pytest.mark.parametrize("name, call, exc, pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_a_clear_error(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_cpu_cuda_mixing_is_rejected():
    q, _, w = qkw()
    meta = torch.empty(1, 8, 128, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        indexer_scores(q, meta, w, scoring_precision="bf16", backend="torch")


def test_explicit_cudnn_without_a_usable_gpu_raises():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot score this call.*CUDA"):
        indexer_scores(*qkw(), scoring_precision="bf16", backend="cudnn")
    with pytest.raises(RuntimeError, match="backend='cudnn' cannot run this top-k"):
        indexer_topk(torch.randn(2, 8), 2, backend="cudnn")


# ------------------------------------------------------------------ documented, tested results


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_non_contiguous_views_are_accepted_and_equal(precision):
    q, k, w = qkw(b=2, sq=12, sk=12)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    k_s = torch.cat([k, k], dim=-1)[..., :128]  # a strided slice
    w_t = w.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_t.is_contiguous() and not k_s.is_contiguous()
    a = indexer_scores(q, k, w, scoring_precision=precision, backend="torch")
    b = indexer_scores(q_t, k_s, w_t, scoring_precision=precision, backend="torch")
    assert torch.equal(a, b)


def test_empty_and_single_token_sequences():
    q, k, w = qkw(sq=0, sk=0)
    assert indexer_scores(q, k, w, scoring_precision="fp8", backend="torch").shape == (1, 0, 0)
    assert indexer_select(q, k, w, 4, scoring_precision="fp8", backend="torch").shape == (1, 0, 4)
    q, k, w = qkw(sq=1, sk=1)
    s = indexer_scores(q, k, w, scoring_precision="fp8", backend="torch")
    assert s.shape == (1, 1, 1) and torch.isfinite(s).all()
    assert indexer_topk(s, 3).tolist() == [[[0, -1, -1]]]
    cu = torch.tensor([0, 0, 1], dtype=torch.int32)  # an empty packed sequence
    packed = indexer_scores(
        q[0],
        k[0],
        w[0],
        scoring_precision="bf16",
        backend="torch",
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    assert packed.shape == (1, 1) and torch.isfinite(packed).all()


def test_k_larger_than_valid_keys_pads_with_minus_one():
    s = indexer_scores(*qkw(sq=5, sk=5), scoring_precision="bf16", backend="torch")
    picks = indexer_topk(s, 8)
    for row in range(5):
        assert picks[0, row].tolist() == list(range(row + 1)) + [-1] * (7 - row)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_q_or_k_never_becomes_finite_scores(precision, bad):
    q, k, w = qkw(sq=16, sk=16)
    clean = indexer_scores(q, k, w, scoring_precision=precision, backend="torch")
    q[0, 5, 3, 7] = bad
    k[0, 9, 4] = bad
    got = indexer_scores(q, k, w, scoring_precision=precision, backend="torch")
    assert not torch.isfinite(got[0, 5, :6]).any()  # the row of the bad query, visible keys
    assert not torch.isfinite(got[0, 9:, 9]).any()  # the bad key, for every row that sees it
    untouched = torch.ones_like(got, dtype=torch.bool)
    untouched[0, 5] = False
    untouched[0, :, 9] = False
    assert torch.equal(got[untouched], clean[untouched])  # nothing else changes
    picks = indexer_topk(got, 4)
    assert (picks[0, 5] == -1).all() and not (picks == 9).any()
    assert torch.equal(
        picks[0, 6:8], indexer_topk(clean.masked_fill(~untouched, float("-inf")), 4)[0, 6:8]
    )
