"""Bit-exact replays of the kernel paths on an SM90 GPU (registered in tests/determinism)."""

import pytest
import torch

from dsa_precision import (
    IndexerPreprocess,
    fused_indexer_sparse_attention,
    indexer_scores,
    indexer_select,
    indexer_topk,
)
from dsa_precision.preprocess import indexer_head_weights
from dsa_precision.scoring import _indexer_forward
from dsa_precision.testing import assert_replays_bit_exact

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _qkw(b, s, h, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (
        torch.randn(b, s, h, 128, device=DEV, generator=g).to(dtype),
        torch.randn(b, s, 1, 128, device=DEV, generator=g).to(dtype),
        (torch.randn(b, s, h, device=DEV, generator=g) * 0.02).to(torch.bfloat16),
    )


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("contention", [False, True])
def test_scoring_replays_bit_exact(precision, contention):
    q, k, w = _qkw(1, 128, 32)

    def score(q, k, w):
        return _indexer_forward(q, k, w, scoring_precision=precision, backend="cudnn")

    assert_replays_bit_exact(score, (q, k, w), contention=contention, what=f"{precision} scoring")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_scoring_replays_bit_exact(precision):
    q, k, w = _qkw(1, 8192, 64)

    def score(q, k, w):  # 512-row chunks over 8192 keys
        return indexer_scores(
            q, k, w, scoring_precision=precision, backend="cudnn", chunk_bytes=512 * 8192 * 4
        )

    assert_replays_bit_exact(score, (q, k, w), contention=True, what=f"chunked {precision}")


def test_topk_replays_bit_exact():
    g = torch.Generator(device=DEV).manual_seed(3)
    scores = torch.round(torch.randn(4, 512, 8192, device=DEV, generator=g) * 4) / 4  # many ties
    assert_replays_bit_exact(
        lambda s: indexer_topk(s, 2048, backend="cudnn"), (scores,), contention=True, what="top-k"
    )
    # The split path: 512-row chunks (scores + top-k scratch, 12 bytes per score), each chunk's
    # top-k written into one result.
    q, k, w = _qkw(1, 4096, 64)
    assert_replays_bit_exact(
        lambda q, k, w: indexer_select(
            q, k, w, 2048, scoring_precision="fp8", backend="cudnn", chunk_bytes=512 * 4096 * 12
        ),
        (q, k, w),
        what="chunked select",
    )


@pytest.mark.parametrize("hadamard", [False, True])
def test_fp32_preprocessing_route_replays_and_keeps_dtypes(hadamard):
    g = torch.Generator(device=DEV).manual_seed(4)
    pre = IndexerPreprocess(128, 64, rotate_activation=hadamard, rope_fp32=True).to(DEV)
    q = torch.randn(2048, 1, 32, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(2048, 1, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, 1, 32, device=DEV, generator=g).to(torch.bfloat16)
    freqs = torch.rand(2048, 1, 1, 64, device=DEV, generator=g) * 100

    def route(q, k, w):
        qq, kk = pre(q, k, freqs)
        ww = indexer_head_weights(w, n_heads=32, head_dim=128, fp32=False)
        return qq, kk, ww

    qq, kk, ww = assert_replays_bit_exact(route, (q, k, w), what="rope_fp32 preprocessing")
    assert qq.dtype == kk.dtype == torch.float32 and ww.dtype == torch.bfloat16


def _fused_inputs(seed=5, s=2048):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (
        torch.randn(s, 1, 16, 576, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(s, 1, 576, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(s, 1, 32, 128, device=DEV, generator=g),
        torch.randn(s, 1, 128, device=DEV, generator=g),
        (torch.randn(s, 1, 32, device=DEV, generator=g) * 0.02).float(),
    )


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_forward_replays_bit_exact(precision):
    def run(*x):
        return fused_indexer_sparse_attention(
            *x, topk=256, softmax_scale=576**-0.5, d_v=512, scoring_precision=precision
        )

    assert_replays_bit_exact(run, _fused_inputs(), contention=True, what=f"fused {precision}")


def test_fused_backward_replays_bit_exact_when_deterministic():
    """cuDNN's SM90 sparse backward accumulates dKV with atomics; under
    torch.use_deterministic_algorithms(True) the built-in deterministic backward runs."""

    def run(*x):
        out, _, _ = fused_indexer_sparse_attention(
            *x, topk=256, softmax_scale=576**-0.5, d_v=512, scoring_precision="fp8"
        )
        return out

    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        assert_replays_bit_exact(run, _fused_inputs(s=1024), backward=True, what="fused backward")
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_non_finite_inputs_replay_and_stay_non_finite(precision):
    q, k, w = _qkw(1, 512, 64)
    q[0, 100, 3, 7] = float("nan")
    k[0, 200, 0, 5] = float("inf")

    def score_and_pick(q, k, w):
        s = _indexer_forward(q, k, w, scoring_precision=precision, backend="cudnn")
        return s, indexer_topk(s, 64, backend="cudnn")

    scores, picks = assert_replays_bit_exact(
        score_and_pick, (q, k, w), what=f"non-finite {precision}"
    )
    assert torch.isnan(scores[0, 100, :101]).all()
    assert torch.isnan(scores[0, 200:, 200]).all() and torch.isfinite(scores[0, 300, :200]).all()
    assert (picks[0, 100] == -1).all() and not (picks == 200).any()
