"""Fused indexer + sparse MLA attention, with the scoring precision as an explicit input.

One autograd Function runs: indexer scoring and top-k through the scoring choke point (BF16 or
FP8, as requested), sparse attention over the selected keys (FlashMLA or built-in forward; cuDNN
SM90 or built-in backward), and, for BF16 scoring only, the optional indexer KL loss, whose
gradients are precomputed in forward and scaled by the loss gradient in backward.

Layouts are Megatron's (sequence first): ``query`` ``(S_q, B, N, D)``, ``kv`` ``(S_k, B, D)``
(absorbed MLA: keys and values share storage, values are the first ``d_v`` channels),
``q_indexer`` ``(S_q, B, H, 128)``, ``k_indexer`` ``(S_k, B, 128)``, ``weights`` ``(S_q, B, H)``.

Test support, not part of the installed package: the tests run the package's selection and
precision checks through a whole autograd path with it (its attention is :mod:`.sparse_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from dsa_precision.checks import (
    _INT32_MAX,
    _check_positive_int,
    _check_real,
    _check_same_device,
    _check_tensor,
    _takes_precision_config,
)
from dsa_precision.config import (
    IndexerPrecisionConfig,
    _check_precision_config,
    _fp8_indexer_loss_error,
)
from dsa_precision.select import indexer_select

from .sparse_attention import sparse_backward, sparse_forward

__all__ = ["FusedIndexerSparseAttnFunc", "IndexerLossFn", "fused_indexer_sparse_attention"]

# (q_indexer, k_indexer, weights, topk_indices (B, S_q, K) int32) -> scalar loss; the indexer
# tensors are differentiable leaves in Megatron's layout.
IndexerLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _flat_topk(topk: torch.Tensor) -> torch.Tensor:
    """``(B, S_q, K)`` local key indices -> ``(S_q * B, K)`` rows of ``kv.reshape(S_k * B, D)``."""
    b = topk.shape[0]
    batch = torch.arange(b, device=topk.device, dtype=topk.dtype).view(b, 1, 1)
    flat = torch.where(topk >= 0, topk * b + batch, topk)
    return flat.transpose(0, 1).reshape(-1, topk.shape[-1]).contiguous()


class FusedIndexerSparseAttnFunc(torch.autograd.Function):
    """Indexer scoring + top-k + sparse MLA attention (+ BF16 indexer KL loss).

    Forward inputs, in order (backward returns one slot for each, ``None`` for non-tensors):
    ``query``, ``kv``, ``q_indexer``, ``k_indexer``, ``weights``, ``topk`` (int),
    ``softmax_scale`` (float), ``d_v`` (int), ``config`` (:class:`IndexerPrecisionConfig`: the
    scoring precision and the engine whose FP8 rules apply), ``loss_coeff`` (float),
    ``indexer_loss_fn`` (:data:`IndexerLossFn` or ``None``). Call it through
    :func:`fused_indexer_sparse_attention`, which checks them.

    Outputs: attention ``(S_q, B, N, d_v)``, indexer loss (float32 scalar, 0 without loss) and
    top-k indices ``(B, S_q, K)`` int32 (non-differentiable).
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        kv: torch.Tensor,
        q_indexer: torch.Tensor,
        k_indexer: torch.Tensor,
        weights: torch.Tensor,
        topk: int,
        softmax_scale: float,
        d_v: int,
        config: IndexerPrecisionConfig,
        loss_coeff: float,
        indexer_loss_fn: IndexerLossFn | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sq, b, n, d = query.shape
        skv = kv.shape[0]
        with torch.no_grad():
            picks = cast(  # without margins: the picks alone
                torch.Tensor,
                indexer_select(
                    q_indexer.transpose(0, 1),
                    k_indexer.transpose(0, 1),
                    weights.transpose(0, 1),
                    topk=topk,
                    config=config,
                ),
            )
        idx = _flat_topk(picks)
        q_flat = query.reshape(sq * b, n, d)
        kv_flat = kv.reshape(skv * b, d)
        out_flat, lse = sparse_forward(q_flat, kv_flat, idx, softmax_scale, d_v)

        grads: tuple[torch.Tensor | None, ...] = (None, None, None)
        loss = torch.zeros((), dtype=torch.float32, device=query.device)
        if loss_coeff > 0:
            leaves = [t.detach().requires_grad_() for t in (q_indexer, k_indexer, weights)]
            assert indexer_loss_fn is not None  # fused_indexer_sparse_attention checks it
            with torch.enable_grad():
                loss = indexer_loss_fn(leaves[0], leaves[1], leaves[2], picks)
                grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
            loss = loss.detach().float()
        ctx.save_for_backward(q_flat, kv_flat, idx, out_flat, lse, *grads)
        ctx.has_indexer_grads = loss_coeff > 0
        ctx.softmax_scale = softmax_scale
        ctx.shapes = (query.shape, kv.shape)
        ctx.mark_non_differentiable(picks)
        return out_flat.view(sq, b, n, d_v), loss, picks

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any,
        grad_out: torch.Tensor,
        grad_loss: torch.Tensor | None,
        _grad_picks: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q_flat, kv_flat, idx, out_flat, lse, *indexer_grads = ctx.saved_tensors
        query_shape, kv_shape = ctx.shapes
        dq, dkv = sparse_backward(
            q_flat, kv_flat, idx, out_flat, lse, grad_out.reshape(out_flat.shape), ctx.softmax_scale
        )
        if ctx.has_indexer_grads and grad_loss is not None:
            dq_i, dk_i, dw = (g * grad_loss for g in indexer_grads)
        else:
            dq_i = dk_i = dw = None
        # Slots: query, kv, q_indexer, k_indexer, weights, topk, softmax_scale, d_v, config,
        # loss_coeff, indexer_loss_fn.
        return (
            dq.view(query_shape),
            dkv.view(kv_shape),
            dq_i,
            dk_i,
            dw,
            None,
            None,
            None,
            None,
            None,
            None,
        )


@_takes_precision_config
def fused_indexer_sparse_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    q_indexer: torch.Tensor,
    k_indexer: torch.Tensor,
    weights: torch.Tensor,
    *,
    topk: int,
    softmax_scale: float,
    d_v: int,
    config: IndexerPrecisionConfig,
    loss_coeff: float = 0.0,
    indexer_loss_fn: IndexerLossFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, then run :class:`FusedIndexerSparseAttnFunc`.

    ``config`` gives the scoring precision and the engine profile whose FP8 quantization rules
    apply (the indexer tensors are preprocessed carriers: its ``rope_fp32`` has been applied
    upstream). Every argument is checked here (host facts only: types, shapes, devices).

    Returns ``(out (S_q, B, N, d_v), indexer_loss (), topk_indices (B, S_q, K) int32)``.
    The indexer KL loss needs BF16 scoring: FP8 with ``loss_coeff > 0`` raises.
    """
    config = _check_precision_config(config)
    tensors = dict(query=query, kv=kv, q_indexer=q_indexer, k_indexer=k_indexer, weights=weights)
    _check_same_device(**{name: _check_tensor(name, t) for name, t in tensors.items()})
    topk = _check_positive_int("topk", topk, high=_INT32_MAX)
    d_v = _check_positive_int("d_v", d_v)
    softmax_scale = _check_real("softmax_scale", softmax_scale)
    loss_coeff = _check_real("loss_coeff", loss_coeff, nonnegative=True)
    if query.ndim != 4 or kv.ndim != 3 or q_indexer.ndim != 4 or k_indexer.ndim != 3:
        raise ValueError(
            "expected query (S_q, B, N, D), kv (S_k, B, D), q_indexer (S_q, B, H, 128) and "
            f"k_indexer (S_k, B, 128); got {tuple(query.shape)}, {tuple(kv.shape)}, "
            f"{tuple(q_indexer.shape)}, {tuple(k_indexer.shape)}."
        )
    sq, b = query.shape[:2]
    if (
        tuple(q_indexer.shape[:2]) != (sq, b)
        or tuple(weights.shape) != (sq, b, q_indexer.shape[2])
        or tuple(kv.shape[:2]) != tuple(k_indexer.shape[:2])
        or kv.shape[1] != b
    ):
        raise ValueError(
            f"the tensors disagree: query {tuple(query.shape)} and q_indexer "
            f"{tuple(q_indexer.shape)} need the same (S_q, B), weights {tuple(weights.shape)} "
            f"must be (S_q, B, H), kv {tuple(kv.shape)} and k_indexer {tuple(k_indexer.shape)} "
            "the same (S_k, B): the picks index kv's rows."
        )
    if kv.shape[-1] != query.shape[-1] or d_v > kv.shape[-1]:
        raise ValueError(
            f"query and kv widths must match ({query.shape[-1]} vs {kv.shape[-1]}) and d_v={d_v} "
            "must not exceed it (values are kv's first d_v channels)."
        )
    if loss_coeff > 0 and config.fp8:
        raise ValueError(_fp8_indexer_loss_error("loss_coeff", loss_coeff) + ".")
    if loss_coeff > 0 and indexer_loss_fn is None:
        raise ValueError(f"loss_coeff={loss_coeff} needs an indexer_loss_fn.")
    if not torch.is_grad_enabled():
        loss_coeff = 0.0
    return FusedIndexerSparseAttnFunc.apply(
        query,
        kv,
        q_indexer,
        k_indexer,
        weights,
        topk,
        softmax_scale,
        d_v,
        config,
        loss_coeff,
        indexer_loss_fn,
    )
