"""Megatron's ``dsa_kernel_backend="tilelang"`` beside the drop-ins.

A layer that owns its top-k (FP8 scoring, or the engine's picks replayed) hands Megatron its picks
through the index-share route (see :mod:`.attention`); Megatron's forward then runs its sparse
attention on them, and with ``dsa_kernel_backend="tilelang"`` that is TileLang's ``SparseMLA``
(megatron-core 0.19.2: ``dsa_kernels.run_fused_absorbed_sparse_attention`` ->
``dsa_tilelang_kernels`` -> ``ops.tilelang_dsa.fused_sparse_mla_absorbed``). That hook declines
(returns ``None``) for shapes its kernels are not built for, and Megatron then runs its PyTorch
attention without a word. With a dsa-precision field switched on, a layout TileLang would decline
is refused instead, when the config is validated (:func:`_tilelang_problems`), and the one
shape-dependent case, fewer keys than ``dsa_indexer_topk`` (picks narrower than a multiple of 64),
is met by padding the picks with ``-1`` (:func:`_tilelang_picks`), which ``SparseMLA`` masks.

The rules, from ``fused_sparse_mla_absorbed`` of megatron-core 0.19.2 (pinned against its source
by ``tests/megatron/test_kernel_backend.py``): BF16 query and key; the absorbed dims 512 + 64
(``kv_lora_rank`` 512, ``qk_pos_emb_head_dim`` 64: GLM-5, DeepSeek-V3.2); query heads per
tensor-parallel rank padded to ``max(heads, 16)``, which must be a power of two; a top-k width
that is a multiple of 64; and fused kernels on at all (``attention_backend`` not ``unfused``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.utils import _validate_dsa_kernel_backend_dependencies

__all__ = []

_TILELANG = "tilelang"
# TileLang's SparseMLA (megatron-core 0.19.2) is specialised for the absorbed layout
# query = key = [latent 512 | RoPE 64] = 576 lanes, value = the 512 latent lanes.
_SPARSE_MLA_LATENT = 512
_SPARSE_MLA_ROPE = 64
# It reads the picks in blocks of 64 (a narrower width is declined) ...
_SPARSE_MLA_TOPK_BLOCK = 64
# ... and pads the query heads to at least 16 (one head tile).
_SPARSE_MLA_MIN_HEADS = 16
_FIX = "or dsa_kernel_backend='none' (Megatron's PyTorch sparse attention)"


def _sparse_mla_heads_supported(heads: int) -> bool:
    """Whether TileLang's ``SparseMLA`` runs ``heads`` query heads (of one tensor-parallel rank):
    ``max(heads, 16)`` must be a power of two (megatron-core 0.19.2 pads to it, one KV group)."""
    padded = max(heads, _SPARSE_MLA_MIN_HEADS)
    return heads > 0 and padded & (padded - 1) == 0


def _tilelang_problems(config: Any) -> list[str]:
    """Why Megatron's TileLang sparse attention would not run the DSA layers of ``config`` (one
    line per field: its value and the fix); empty when it runs them. Checks tilelang itself
    (megatron-core's own dependency check: a CUDA device, its TileLang DSA kernels), then the
    layout rules of the module docstring."""
    problems = []
    try:
        _validate_dsa_kernel_backend_dependencies(config.dsa_kernel_backend)
    except ValueError as exc:
        problems.append(
            f"dsa_kernel_backend={config.dsa_kernel_backend!r}: {exc} (megatron-core's check); "
            f"install tilelang and run on a CUDA device, {_FIX}"
        )
    if not dsa_kernels.use_fused_dsa_kernels(config):
        problems.append(
            f"attention_backend={config.attention_backend!r}: Megatron's DSA runs no fused kernel "
            "with the unfused attention backend (dsa_kernels.use_fused_dsa_kernels), so TileLang "
            f"would not run; set attention_backend to AttnBackend.auto, {_FIX}"
        )
    if config.kv_lora_rank != _SPARSE_MLA_LATENT:
        problems.append(
            f"kv_lora_rank={config.kv_lora_rank!r}: TileLang's SparseMLA is built for a "
            f"{_SPARSE_MLA_LATENT}-lane latent (GLM-5, DeepSeek-V3.2); use {_SPARSE_MLA_LATENT}, "
            f"{_FIX}"
        )
    if config.qk_pos_emb_head_dim != _SPARSE_MLA_ROPE:
        problems.append(
            f"qk_pos_emb_head_dim={config.qk_pos_emb_head_dim!r}: TileLang's SparseMLA is built "
            f"for {_SPARSE_MLA_ROPE} RoPE lanes; use {_SPARSE_MLA_ROPE}, {_FIX}"
        )
    tp = config.tensor_model_parallel_size
    heads = config.num_attention_heads // tp
    if not _sparse_mla_heads_supported(heads):
        problems.append(
            f"num_attention_heads={config.num_attention_heads!r} ({heads} per tensor-parallel "
            f"rank, tensor_model_parallel_size={tp}): TileLang's SparseMLA pads a rank's heads "
            f"to max(heads, {_SPARSE_MLA_MIN_HEADS}) and runs only when that is a power of two; "
            f"use at most {_SPARSE_MLA_MIN_HEADS} or a power of two per rank, {_FIX}"
        )
    topk = config.dsa_indexer_topk
    if topk % _SPARSE_MLA_TOPK_BLOCK:
        problems.append(
            f"dsa_indexer_topk={topk!r}: TileLang's SparseMLA reads the picks in blocks of "
            f"{_SPARSE_MLA_TOPK_BLOCK}; use a multiple of {_SPARSE_MLA_TOPK_BLOCK}, {_FIX}"
        )
    if config.params_dtype != torch.bfloat16:
        problems.append(
            f"params_dtype={config.params_dtype!r}: TileLang's SparseMLA takes BF16 queries and "
            f"keys; use torch.bfloat16, {_FIX}"
        )
    return problems


def _tilelang_picks(
    topk: torch.Tensor, index_topk: int, query: torch.Tensor, layer_number: int
) -> torch.Tensor:
    """The owned picks ``(b, rows, k)`` int32 as TileLang's ``SparseMLA`` takes them: ``k`` is
    ``min(index_topk, keys)``, so with fewer keys than ``index_topk`` they are padded with ``-1``
    (masked by the kernel, as the unused slots already are) to ``index_topk``, a multiple of 64
    (:func:`_tilelang_problems`). ``RuntimeError`` for a non-BF16 ``query``, which it declines."""
    if query.dtype != torch.bfloat16:
        raise RuntimeError(
            f"DSA layer {layer_number}: dsa_kernel_backend='tilelang' runs TileLang's SparseMLA on "
            f"BF16 queries, and this query is {query.dtype}; run the layer in BF16 (bf16=True, "
            f"params_dtype=torch.bfloat16), {_FIX}."
        )
    width = topk.shape[-1]
    if width >= index_topk:
        return topk
    return torch.nn.functional.pad(topk, (0, index_topk - width), value=-1)
