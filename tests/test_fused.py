"""FusedIndexerSparseAttnFunc on the CPU: composition, gradients, loss, backward arity."""

import inspect

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    indexer_select,
    reset_scoring_calls,
    scoring_calls,
)

from .support.fused_attention import FusedIndexerSparseAttnFunc, fused_indexer_sparse_attention
from .test_sparse_attention import dense_reference

SQ, B, N, D, DV, H, K = 24, 2, 4, 72, 64, 32, 6
CONFIGS = {p: IndexerPrecisionConfig(scoring_precision=p) for p in ("bf16", "fp8")}


def _fused(inputs, config, **kw):
    """The fused function on ``(query, kv, q_indexer, k_indexer, weights)``, top-``K``."""
    return fused_indexer_sparse_attention(
        *inputs, topk=K, softmax_scale=0.1, d_v=DV, config=config, **kw
    )


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(SQ, B, N, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(SQ, B, D, generator=g).to(torch.bfloat16)
    q_i = torch.randn(SQ, B, H, 128, generator=g)
    k_i = torch.randn(SQ, B, 128, generator=g)
    w = (torch.randn(SQ, B, H, generator=g) * 0.02).to(torch.bfloat16)
    return query, kv, q_i, k_i, w


def test_backward_returns_one_slot_per_forward_input():
    forward_inputs = list(inspect.signature(FusedIndexerSparseAttnFunc.forward).parameters)[1:]
    query, kv, q_i, k_i, w = _inputs()
    query.requires_grad_()
    kv.requires_grad_()
    seen = {}
    original = FusedIndexerSparseAttnFunc.backward

    def spy(ctx, *grads):
        out = original(ctx, *grads)
        seen["slots"] = len(out)
        return out

    FusedIndexerSparseAttnFunc.backward = staticmethod(spy)
    try:
        out, _, _ = _fused((query, kv, q_i, k_i, w), CONFIGS["fp8"])
        out.float().sum().backward()
    finally:
        FusedIndexerSparseAttnFunc.backward = original
    assert seen["slots"] == len(forward_inputs) == 11


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_matches_select_then_dense_attention(precision):
    query, kv, q_i, k_i, w = _inputs()
    reset_scoring_calls()
    query.requires_grad_()
    kv.requires_grad_()
    out, loss, picks = _fused((query, kv, q_i, k_i, w), CONFIGS[precision])
    assert scoring_calls(precision) == 1 and scoring_calls() == 1
    want_picks = indexer_select(
        q_i.transpose(0, 1),
        k_i.transpose(0, 1),
        w.transpose(0, 1),
        topk=K,
        config=IndexerPrecisionConfig(scoring_precision=precision),
    )
    assert torch.equal(picks, want_picks) and loss.item() == 0.0
    for b in range(B):
        ref = dense_reference(query[:, b].detach(), kv[:, b].detach(), picks[b], 0.1, DV)
        assert torch.allclose(out[:, b].double(), ref, atol=2e-2, rtol=2e-2)
    # Gradients flow to query and kv and match a dense reference.
    out.float().pow(2).sum().backward()
    qr = query.detach().double().requires_grad_()
    kvr = kv.detach().double().requires_grad_()
    sum(
        dense_reference(qr[:, b], kvr[:, b], picks[b], 0.1, DV).pow(2).sum() for b in range(B)
    ).backward()
    assert (query.grad.double() - qr.grad).abs().max() <= 5e-2 * qr.grad.abs().max()
    assert (kv.grad.double() - kvr.grad).abs().max() <= 5e-2 * kvr.grad.abs().max()


def test_bf16_indexer_loss_gradients_are_precomputed_and_scaled():
    query, kv, q_i, k_i, w = _inputs()
    q_i.requires_grad_()
    w32 = w.float().requires_grad_()

    def loss_fn(q, k, weights, picks):
        return (q.float().pow(2).mean() + weights.float().sum() * 0.5) * 3.0

    inputs = (query, kv, q_i, k_i, w32)
    _, loss, _ = _fused(inputs, CONFIGS["bf16"], loss_coeff=1.0, indexer_loss_fn=loss_fn)
    assert loss.item() == pytest.approx(float(loss_fn(q_i.detach(), k_i, w32.detach(), None)))
    (loss * 2.0).backward()
    assert torch.allclose(q_i.grad, 2.0 * 3.0 * 2 * q_i.detach() / q_i.numel())
    assert torch.allclose(w32.grad, torch.full_like(w32, 2.0 * 3.0 * 0.5))


def test_fp8_with_loss_is_refused():
    with pytest.raises(ValueError, match=r"loss_coeff=0\.5.*BF16"):
        _fused(_inputs(), CONFIGS["fp8"], loss_coeff=0.5, indexer_loss_fn=lambda *a: a[0].sum())


def test_fp8_quantizes_under_the_configs_engine():
    """The engine travels in the config (it used to be no input at all: FP8 always followed
    vllm-exact). SGLang's plain float32 scales pick differently from UE8M0 on these inputs, and
    the fused picks are indexer_select's under the same config."""
    inputs = _inputs()
    picks = {}
    for engine in ("vllm-exact", "sglang-fused"):
        config = IndexerPrecisionConfig(scoring_precision="fp8", engine=engine)
        _, _, picks[engine] = _fused(inputs, config)
        q_i, k_i, w = (t.transpose(0, 1) for t in inputs[2:])
        assert torch.equal(picks[engine], indexer_select(q_i, k_i, w, topk=K, config=config))
    assert not torch.equal(picks["vllm-exact"], picks["sglang-fused"])


def test_the_old_precision_keyword_says_what_to_pass():
    with pytest.raises(TypeError, match=r"pass config=IndexerPrecisionConfig\(scoring_precision="):
        fused_indexer_sparse_attention(
            *_inputs(), topk=K, softmax_scale=0.1, d_v=DV, scoring_precision="fp8"
        )
