"""What reaches cuDNN's kernels, checked on the CPU with a recording fake of ``cudnn.DSA``."""

import pytest
import torch

from dsa_precision import indexer_scores, indexer_topk, quantize_e4m3_ue8m0

from . import fake_cudnn
from .helpers import rel_err


@pytest.fixture
def fake(monkeypatch):
    return fake_cudnn.install(monkeypatch)


def _inputs(b=2, sq=20, sk=20, h=64):
    return (
        torch.randn(b, sq, h, 128),  # FP32 carriers, as with rope_fp32
        torch.randn(b, sk, 128),
        (torch.randn(b, sq, h) * 0.01).to(torch.bfloat16),
    )


def test_fp8_operands_scales_and_folded_weights(fake):
    q, k, w = _inputs()
    got = indexer_scores(q, k, w, scoring_precision="fp8", sm_scale=0.5, backend="cudnn")
    (call,) = fake.forward_calls
    assert call["precision"] == "fp8" and call["q_dtype"] == torch.float8_e4m3fn
    assert call["w_dtype"] == torch.float32 and call["sm_scale"] == 1.0  # folded into w
    assert call["q_scale_shape"] == (2, 20, 64) and call["k_scale_shape"] == (2, 20, 1)
    ref = indexer_scores(q, k, w, scoring_precision="fp8", sm_scale=0.5, backend="torch")
    assert rel_err(got, ref) <= 1e-6


def test_fp8_weight_folding_is_q_descale_times_sm_scale(fake, monkeypatch):
    q, k, w = _inputs(b=1, sq=3, sk=3)
    seen = {}
    real = fake.indexer_forward_wrapper

    def spy(qq, kk, ww, *a, **kw):
        seen["w"], seen["q"] = ww.clone(), qq.clone()
        return real(qq, kk, ww, *a, **kw)

    monkeypatch.setattr(fake, "indexer_forward_wrapper", spy)
    indexer_scores(q, k, w, scoring_precision="fp8", sm_scale=0.3, backend="cudnn")
    q8, qs = quantize_e4m3_ue8m0(q)
    assert torch.equal(seen["q"].view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(seen["w"], (w.float() * qs) * 0.3)


def test_bf16_rounds_carriers_before_the_kernel(fake):
    q, k, w = _inputs()
    indexer_scores(q, k, w, scoring_precision="bf16", sm_scale=0.5, backend="cudnn")
    (call,) = fake.forward_calls
    assert call["precision"] == "bf16" and call["q_dtype"] == call["k_dtype"] == torch.bfloat16
    assert call["sm_scale"] == 0.5 and call["q_scale_shape"] is None


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_launches_keep_global_rows_and_precision(fake, precision):
    q, k, w = _inputs(sq=20, sk=20)
    full = indexer_scores(
        q, k, w, scoring_precision=precision, backend="cudnn", q_causal_offsets=torch.tensor([0, 4])
    )
    fake.forward_calls.clear()
    chunked = indexer_scores(
        q,
        k,
        w,
        scoring_precision=precision,
        backend="cudnn",
        q_causal_offsets=torch.tensor([0, 4]),
        chunk_bytes=9 * 2 * 20 * 4,
    )
    # 9 rows fit the budget; chunks hold whole 8-row kernel tiles.
    assert [c["offsets"] for c in fake.forward_calls] == [[0, 4], [8, 12], [16, 20]]
    assert {c["precision"] for c in fake.forward_calls} == {precision}
    assert torch.equal(full, chunked)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_packed_thd_single_launch_and_chunked(fake, precision):
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    q, k, w = torch.randn(16, 32, 128), torch.randn(16, 128), torch.randn(16, 32).to(torch.bfloat16)
    one = indexer_scores(
        q, k, w, scoring_precision=precision, backend="cudnn", cu_seqlens_q=cu, cu_seqlens_k=cu
    )
    (call,) = fake.forward_calls
    assert call["thd"] and call["precision"] == precision and call["q_shape"] == (16, 32, 128)
    if precision == "fp8":
        assert call["q_scale_shape"] == (16, 32) and call["k_scale_shape"] == (16, 1)
    fake.forward_calls.clear()
    chunked = indexer_scores(
        q,
        k,
        w,
        scoring_precision=precision,
        backend="cudnn",
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        chunk_bytes=4 * 10 * 4,
    )
    assert all(not c["thd"] and c["precision"] == precision for c in fake.forward_calls)
    # budget 160 B: 6 rows x 6 keys fit one launch; 10 rows x 10 keys take 8 + 2 (whole tiles)
    assert len(fake.forward_calls) == 3
    assert torch.equal(one, chunked)
    ref = indexer_scores(
        q, k, w, scoring_precision=precision, backend="torch", cu_seqlens_q=cu, cu_seqlens_k=cu
    )
    assert rel_err(one, ref) <= 1e-6


def test_topk_cudnn_path_matches_torch_path(fake):
    scores = torch.randint(-3, 4, (3, 9, 40)).float()  # many exact ties
    scores[..., 30:] = float("-inf")
    seq_lens = torch.randint(0, 41, (3, 9))
    for k in (1, 8, 40, 64):
        a = indexer_topk(scores, k, seq_lens=seq_lens, backend="cudnn")
        b = indexer_topk(scores, k, seq_lens=seq_lens, backend="torch")
        assert torch.equal(a, b), k
    assert fake.topk_calls[-1]["deterministic"] is True and fake.topk_calls[-1]["top_k"] == 40


def test_select_budgets_scores_and_topk_scratch(fake):
    from dsa_precision import indexer_select

    q, k, w = _inputs(b=2, sq=20, sk=20)
    picks = indexer_select(
        q, k, w, 4, scoring_precision="fp8", backend="cudnn", chunk_bytes=8 * 2 * 20 * 12
    )
    # 12 bytes per score (float32 score + two int32 top-k buffers): 8 rows per chunk.
    assert [c["offsets"] for c in fake.forward_calls] == [[0, 0], [8, 8], [16, 16]]
    assert torch.equal(picks, indexer_select(q, k, w, 4, scoring_precision="fp8", backend="torch"))
