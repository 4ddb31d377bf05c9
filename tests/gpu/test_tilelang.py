"""The drop-ins on Megatron's TileLang sparse attention (``dsa_kernel_backend="tilelang"``).

A layer that owns its top-k (FP8, or the engine's picks replayed) hands its picks to Megatron's
forward, which runs TileLang's SparseMLA on them (forward and backward). Checked against the same
layer and weights on ``dsa_kernel_backend="none"`` (Megatron's PyTorch sparse attention on the
same picks), with the kernel's own cache showing that SparseMLA compiled for the layer's shape
(TileLang would otherwise decline silently and Megatron fall back). Needs tilelang 0.1.15
(``bash tools/gpu_session.sh tilelang``).
"""

import importlib.util

import pytest
import torch

from .test_megatron import _attention, _config, _forward, _inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("tilelang") is None,
        reason="tilelang is not installed (bash tools/gpu_session.sh tilelang)",
    ),
]

FP8 = {"dsa_indexer_rope_fp32": True, "dsa_indexer_scoring_precision": "fp8"}


@pytest.fixture(scope="module")
def dsap(megatron_parallel_gpu):
    import dsa_precision.megatron as dsap

    return dsap


def _sparse_mla_topks() -> set[int]:
    """The top-k widths TileLang's SparseMLA forward has compiled for (its kernel cache)."""
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_fwd as fwd,
    )

    return {key[3] for key in fwd._tilelang_sparse_mla_fwd_kernel_cache}


def _pair(dsap, **fields):
    """The same layer (weights) on TileLang and on Megatron's PyTorch sparse attention."""
    tl = _attention(dsap, _config(dsap, dsa_kernel_backend="tilelang", **fields))
    ref = _attention(dsap, _config(dsap, dsa_kernel_backend="none", **fields))
    ref.load_state_dict(tl.state_dict())
    return tl, ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _run_both(tl, ref, s, handed_in=None):
    """Outputs and (query, key) gradients of both layers on the same inputs."""
    results = []
    for attn in (tl, ref):
        query, key, x, qr, up_v = _inputs(s)
        with handed_in() if handed_in else torch.enable_grad():
            out = _forward(attn)(query, key, x, qr, up_v)
        out.float().square().sum().backward()
        results.append((out, query.grad, key.grad))
    return results


@pytest.mark.parametrize("s, topk", [(2048, 256), (200, 320)], ids=["S2048", "S200_padded"])
def test_owned_fp8_picks_run_on_tilelang_sparse_mla(dsap, record, s, topk):
    """FP8 picks through TileLang's SparseMLA: the same picks, outputs and gradients as
    Megatron's PyTorch attention on them to BF16 precision; at S = 200 < top-k the picks (200
    wide) are padded with -1 to 320, a multiple of 64, which SparseMLA takes."""
    tl, ref = _pair(dsap, dsa_indexer_topk=topk, **FP8)
    query, _, x, qr, _ = _inputs(s)
    picks = tl.compute_topk(query, x, qr, None)
    assert torch.equal(picks, ref.compute_topk(query, x, qr, None))
    assert picks.shape == (1, s, topk)  # the top-k width SparseMLA takes
    assert bool((picks[..., min(s, topk) :] == -1).all())  # S < top-k: the rest padded with -1
    (out, dq, dk), (out_ref, dq_ref, dk_ref) = _run_both(tl, ref, s)
    assert topk in _sparse_mla_topks()  # SparseMLA compiled for this width: it ran
    errs = {"out": _rel(out, out_ref), "dq": _rel(dq, dq_ref), "dkv": _rel(dk, dk_ref)}
    record("tilelang_owned_fp8", s=s, topk=topk, **errs)
    # BF16 outputs of two summation orders (H200, 2026-12-02, S = 2048: out 4.7e-3, dq 1.1e-2,
    # dkv 3.2e-3).
    assert all(e < 3e-2 for e in errs.values()), errs


def test_replayed_picks_run_on_tilelang_sparse_mla(dsap):
    from .test_replay import _picks

    s, topk = 2048, 256
    tl, ref = _pair(dsap, dsa_indexer_topk=topk, dsa_indexer_topk_source="replay")
    picks = {1: _picks([s], 64, "cuda")}
    (out, dq, _), (out_ref, dq_ref, _) = _run_both(
        tl, ref, s, handed_in=lambda: dsap.engine_topk(picks, seq_len=s)
    )
    assert topk in _sparse_mla_topks()
    assert _rel(out, out_ref) < 3e-2 and _rel(dq, dq_ref) < 3e-2


def test_default_fields_on_tilelang_are_stock_megatron(dsap):
    """With the fields at their defaults the layer is Megatron's, TileLang indexer and
    SparseMLA included: the forward equals stock Megatron's bit for bit (the backward
    atomic-adds into dKV, so it is compared to BF16 precision only)."""
    ours = _attention(dsap, _config(dsap, dsa_kernel_backend="tilelang"))
    stock = _attention(dsap, _config(dsap, stock=True, dsa_kernel_backend="tilelang"), stock=True)
    stock.load_state_dict(ours.state_dict())
    a, b = _inputs(), _inputs()
    out_a, out_b = _forward(ours)(*a), _forward(stock)(*b)
    assert torch.equal(out_a, out_b)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    assert _rel(a[0].grad, b[0].grad) < 1e-2
