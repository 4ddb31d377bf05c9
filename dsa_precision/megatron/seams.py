"""The named seams through which Megatron's DSA scoring reaches the scoring choke point.

megatron-core 0.19's cuDNN DSA backend calls cuDNN's indexer kernel from several places (single
launch, chunked global rows, packed THD, context-parallel segments) and scores some row chunks
with a PyTorch ``bmm`` that upcasts its operands to FP32; its naive path scores in
``dsa._compute_index_scores``. None of these take a precision. :func:`install` replaces five
module attributes, once, after checking the megatron-core version and each target's signature:

==================  =====================================================================
seam                replaces
==================  =====================================================================
cudnn_namespace     ``dsa_cudnn_kernels._cudnn_dsa`` (the ``cudnn.DSA`` namespace): its
                    ``indexer_forward_wrapper`` goes through ``_indexer_forward``
global_rows         ``dsa_cudnn_kernels._compute_indexer_scores_chunk_with_global_rows``
naive_scores        ``dsa._compute_index_scores`` (the PyTorch backend and loss paths)
fused_attention     ``dsa_cudnn_kernels.run_fused_dsa_attention`` (full fusion) ->
                    :class:`dsa_precision.FusedIndexerSparseAttnFunc`
sparse_attention    ``dsa_cudnn_kernels.run_fused_absorbed_sparse_attention`` (split
                    path) -> built-in sparse attention when FlashMLA is missing
==================  =====================================================================

The seams act only inside :func:`precision_scope`, which ``PrecisionDSAttention.forward`` enters
with its layer's configuration. With the default configuration (or outside any scope) every seam
calls the original Megatron function with the original arguments, so stock behaviour is kept
byte for byte; the scoring calls are still counted (:mod:`dsa_precision.audit`). The one
exception is that without FlashMLA the attention seams run the built-in sparse attention where
Megatron would fail to import FlashMLA.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _cudnn
from ..audit import record_scoring_call, scoring_site
from ..config import IndexerPrecisionConfig, ScoringPrecision
from ..fused import _flat_topk, fused_indexer_sparse_attention
from ..scoring import _indexer_forward
from ..sparse_attention import _flash_mla_sparse_fwd, sparse_mla_attention

__all__ = ["SUPPORTED_MEGATRON_CORE", "install", "installed", "precision_scope", "uninstall"]

# Tested range: megatron-core 0.19.x (the seams name private functions of that release).
SUPPORTED_MEGATRON_CORE = ((0, 19), (0, 20))
# The seams pass calls through whole: Megatron chunks them itself.
_UNCHUNKED = 1 << 62

_ACTIVE: contextvars.ContextVar[IndexerPrecisionConfig | None] = contextvars.ContextVar(
    "dsa_precision_active", default=None
)
_ORIGINALS: dict[str, Any] = {}


@contextlib.contextmanager
def precision_scope(precision: IndexerPrecisionConfig) -> Iterator[None]:
    """Route the DSA scoring calls made inside the block with ``precision``."""
    token = _ACTIVE.set(precision)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _routing() -> IndexerPrecisionConfig | None:
    """The active configuration when it differs from Megatron's behaviour, else ``None``."""
    precision = _ACTIVE.get()
    return None if precision is None or precision == IndexerPrecisionConfig() else precision


def _modules():
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_cudnn_kernels

    return dsa, dsa_cudnn_kernels


# ---------------------------------------------------------------------------- cudnn_namespace


class _RoutedCudnnDSA:
    """``cudnn.DSA`` with ``indexer_forward_wrapper`` routed through ``_indexer_forward``."""

    _ROUTED_KWARGS = frozenset(
        {
            "sm_scale",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "max_seqlen_q",
            "max_seqlen_k",
            "q_causal_offsets",
        }
    )

    def __getattr__(self, name: str) -> Any:
        return getattr(_cudnn.dsa(), name)

    def indexer_forward_wrapper(self, q, k, w, ratio: int = 4, **kwargs: Any):
        precision = _routing()
        if precision is None:
            with scoring_site("split"):
                record_scoring_call("bf16", "cudnn")
            return _cudnn.dsa().indexer_forward_wrapper(q, k, w, ratio=ratio, **kwargs)
        unknown = set(kwargs) - self._ROUTED_KWARGS
        if unknown:
            raise NotImplementedError(
                f"dsa_precision cannot route indexer_forward_wrapper arguments {sorted(unknown)} "
                "at a non-default precision; this megatron-core call site is not supported."
            )
        with scoring_site("split"):
            scores = _indexer_forward(
                q,
                k,
                w,
                scoring_precision=precision.scoring_precision,
                ratio=ratio,
                sm_scale=kwargs.get("sm_scale", 1.0),
                backend="cudnn",
                q_causal_offsets=kwargs.get("q_causal_offsets"),
                cu_seqlens_q=kwargs.get("cu_seqlens_q"),
                cu_seqlens_k=kwargs.get("cu_seqlens_k"),
                max_seqlen_k=kwargs.get("max_seqlen_k"),
                chunk_bytes=_UNCHUNKED,
            )
        return {"scores": scores}


# -------------------------------------------------------------------------------- global_rows


def _global_rows(
    q_chunk_bshd: torch.Tensor,
    k_bshd: torch.Tensor,
    w_chunk_bsh: torch.Tensor,
    *,
    row_start: int,
    indexer_ratio: int,
    sm_scale: float,
    seq_lens: torch.Tensor | None = None,
    k_bdk: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of a query-row chunk at its global rows, in the active precision.

    Megatron's version upcasts the operands to FP32 and caches the FP32 key (``k_bdk``); an FP32
    carrier would then be scored in FP32. Here the operands go through the choke point, which
    rounds or quantizes them once; the FP32 key cache is ignored.
    """
    precision = _routing()
    if precision is None:
        with scoring_site("split"):
            record_scoring_call("bf16", "megatron")
        return _ORIGINALS["global_rows"](
            q_chunk_bshd,
            k_bshd,
            w_chunk_bsh,
            row_start=row_start,
            indexer_ratio=indexer_ratio,
            sm_scale=sm_scale,
            seq_lens=seq_lens,
            k_bdk=k_bdk,
            key_positions=key_positions,
        )
    sk = k_bshd.size(1)
    # With explicit per-row key counts the causal limit is theirs alone: push the causal
    # diagonal past the last key, then mask by seq_lens as Megatron does.
    offsets = row_start if seq_lens is None else sk * indexer_ratio
    with scoring_site("split"):
        scores = _indexer_forward(
            q_chunk_bshd,
            k_bshd,
            w_chunk_bsh,
            scoring_precision=precision.scoring_precision,
            ratio=indexer_ratio,
            sm_scale=sm_scale,
            q_causal_offsets=offsets,
            chunk_bytes=_UNCHUNKED,
        )
    if seq_lens is not None:
        lens = seq_lens.to(device=scores.device, dtype=torch.int64).clamp(max=sk)
        keys = torch.arange(sk, device=scores.device)
        scores.masked_fill_(keys.view(1, 1, sk) >= lens.view(1, -1, 1), float("-inf"))
    return scores


# ------------------------------------------------------------------------------- naive_scores


def _naive_scores(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, use_relu: bool = True
) -> torch.Tensor:
    """Megatron's PyTorch index scores ``[b, sq, sk]`` (unmasked) in the active precision.

    BF16: Megatron's own math on operands rounded to BF16 (differentiable, for the indexer loss).
    FP8: the choke point (no gradient: FP8 scoring has no indexer loss).
    """
    precision = _routing()
    original = _ORIGINALS["naive_scores"]
    if precision is None or precision.scoring_precision is ScoringPrecision.BF16:
        with scoring_site("naive"):
            record_scoring_call("bf16", "megatron")
    if precision is None:
        return original(q, weights, k, use_relu=use_relu)
    if precision.scoring_precision is ScoringPrecision.BF16:
        return original(q.to(torch.bfloat16), weights, k.to(torch.bfloat16), use_relu=use_relu)
    if not use_relu:
        raise ValueError(
            "dsa_indexer_scoring_relu=False cannot be scored in FP8 (the kernel applies ReLU)."
        )
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or weights.requires_grad):
        raise RuntimeError(
            "FP8 indexer scores have no gradient; the indexer loss needs "
            "dsa_indexer_scoring_precision='bf16'."
        )
    sk = k.size(0)
    with scoring_site("naive"):
        return _indexer_forward(
            q.transpose(0, 1),
            k.transpose(0, 1),
            weights.transpose(0, 1),
            scoring_precision=precision.scoring_precision,
            q_causal_offsets=sk,  # unmasked: the caller applies its own mask
            chunk_bytes=_UNCHUNKED,
        )


# ---------------------------------------------------------------------------- fused_attention


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.full((sq, sk), float("-inf"), device=device).triu_(1 + sk - sq)


def _fused_attention(**kw: Any):
    """Megatron's full-fusion hook, served by :class:`FusedIndexerSparseAttnFunc`.

    Runs the plain causal, absorbed-MLA case (no packing, no context parallelism) and declines
    the rest with ``None``: Megatron then takes its split path, whose scoring the other seams
    route. Megatron's own full fusion runs when the configuration is the default and FlashMLA is
    installed.
    """
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant import dsa

    precision = _routing()
    if precision is None and _flash_mla_sparse_fwd() is not None:
        return _ORIGINALS["fused_attention"](**kw)
    precision = precision or IndexerPrecisionConfig()
    query, key, config = kw["query"], kw["key"], kw["config"]
    plain_causal = kw["varlen_is_plain_causal"] or kw["varlen_starts"] is None
    supported = (
        kw["absorbed_mla"]
        and kw["value"] is None
        and kw["up_v_weight"] is not None
        and kw["attn_mask_type"] == AttnMaskType.causal
        and key.size(2) == 1
        and kw["cp_size"] == 1
        and kw["packed_seq_params"] is None
        and plain_causal
        and kw["key_positions"] is None
        and query.size(0) == key.size(0)
        and kw["use_relu"]
    )
    if not supported:
        return None
    loss_coeff = kw["loss_coeff"] if torch.is_grad_enabled() else 0.0
    d_v = int(config.kv_lora_rank)
    softmax_scale = kw["softmax_scale"]
    loss_fn = None
    if loss_coeff > 0:
        key_for_loss = key.detach()
        if query.size(2) > 1:
            key_for_loss = key_for_loss.expand(-1, -1, query.size(2), -1)

        def loss_fn(q_i, k_i, w_i, picks):
            scores = _ORIGINALS["naive_scores"](
                q_i.to(torch.bfloat16), w_i, k_i.to(torch.bfloat16), use_relu=True
            )
            return dsa.compute_dsa_indexer_loss(
                scores,
                picks.long(),
                query.detach(),
                key_for_loss,
                softmax_scale,
                loss_coeff,
                kw["sparse_loss"],
                kw["pg_collection"],
                mask=_causal_mask(query.size(0), key.size(0), query.device),
                query_valid_rows=kw["query_valid_rows"],
                calculate_per_token_loss=kw["calculate_per_token_loss"],
            )

    with scoring_site("fused"):
        out, loss, _ = fused_indexer_sparse_attention(
            query.contiguous(),
            key.squeeze(2).contiguous(),
            kw["q_indexer"],
            kw["k_indexer"],
            kw["indexer_weights"],
            topk=min(kw["indexer_topk"], key.size(0)),
            softmax_scale=softmax_scale,
            d_v=d_v,
            scoring_precision=precision.scoring_precision,
            loss_coeff=loss_coeff,
            indexer_loss_fn=loss_fn,
        )
    sq, b = query.shape[:2]
    out = torch.einsum("sbhc,hdc->sbhd", out, kw["up_v_weight"]).contiguous()
    return out.view(sq, b, -1), loss


# --------------------------------------------------------------------------- sparse_attention


def _sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    v_channels: int,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Megatron's split-path sparse attention: FlashMLA when installed, built-in otherwise."""
    if _flash_mla_sparse_fwd() is not None:
        return _ORIGINALS["sparse_attention"](
            query, key, topk_indices, softmax_scale, v_channels, topk_length
        )
    if query.ndim != 4 or key.ndim != 4 or topk_indices.ndim != 3 or key.size(2) != 1:
        return None
    sq, b, n, d = query.shape
    skv = key.size(0)
    idx = topk_indices.to(torch.int64)
    if topk_length is not None:
        slots = torch.arange(idx.shape[-1], device=idx.device)
        idx = idx.masked_fill(slots >= topk_length.to(idx.device).unsqueeze(-1), -1)
    out = sparse_mla_attention(
        query.reshape(sq * b, n, d),
        key.reshape(skv * b, d),
        _flat_topk(idx).to(torch.int32),
        softmax_scale,
        v_channels,
    )
    return out.view(sq, b, n, v_channels)


# ------------------------------------------------------------------------------ installation

# seam name -> (module attribute, replacement factory, expected parameter names or None)
_SEAMS: dict[str, tuple[str, str, Callable[[], Any], tuple[str, ...] | None]] = {
    "cudnn_namespace": ("dsa_cudnn_kernels", "_cudnn_dsa", _RoutedCudnnDSA, None),
    "global_rows": (
        "dsa_cudnn_kernels",
        "_compute_indexer_scores_chunk_with_global_rows",
        lambda: _global_rows,
        tuple(inspect.signature(_global_rows).parameters),
    ),
    "naive_scores": (
        "dsa",
        "_compute_index_scores",
        lambda: _naive_scores,
        ("q", "weights", "k", "use_relu"),
    ),
    "fused_attention": (
        "dsa_cudnn_kernels",
        "run_fused_dsa_attention",
        lambda: _fused_attention,
        None,
    ),
    "sparse_attention": (
        "dsa_cudnn_kernels",
        "run_fused_absorbed_sparse_attention",
        lambda: _sparse_attention,
        tuple(inspect.signature(_sparse_attention).parameters),
    ),
}
_FUSED_ATTENTION_KWARGS = (
    "config", "query", "key", "value", "up_v_weight", "q_indexer", "k_indexer",
    "indexer_weights", "indexer_topk", "softmax_scale", "loss_coeff", "sparse_loss",
    "calculate_per_token_loss", "absorbed_mla", "cp_size", "attn_mask_type", "packed_seq_params",
    "varlen_starts", "varlen_ends", "key_positions", "query_valid_rows", "varlen_is_plain_causal",
    "use_relu", "use_local_indexer_varlen", "single_packed_thd_sequence", "local_packed_cp_rank",
    "local_packed_cp_query_start", "local_packed_cp_query_len", "pg_collection",
)  # fmt: skip


def _check_version() -> None:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = None
    low, high = SUPPORTED_MEGATRON_CORE
    if major_minor is None or not low <= major_minor < high:
        raise RuntimeError(
            f"dsa_precision.megatron supports megatron-core {low[0]}.{low[1]}.x; found "
            f"{version}. Its seams name private functions of that release: pin "
            "'megatron-core>=0.19,<0.20' or upgrade dsa-precision."
        )


def installed() -> bool:
    """Whether :func:`install` has run (and :func:`uninstall` has not)."""
    return bool(_ORIGINALS)


def install() -> None:
    """Install the seams (idempotent). Call once before building a model with the precision
    modules; raises ``RuntimeError`` outside the tested megatron-core range or when a target
    function's signature differs from the one the seam replaces."""
    if installed():
        return
    _check_version()
    dsa, cudnn_kernels = _modules()
    modules = {"dsa": dsa, "dsa_cudnn_kernels": cudnn_kernels}
    for name, (module_name, attr, _, params) in _SEAMS.items():
        module = modules[module_name]
        if not hasattr(module, attr):
            raise RuntimeError(f"seam {name}: megatron-core has no {module_name}.{attr}.")
        target = getattr(module, attr)
        expected = _FUSED_ATTENTION_KWARGS if name == "fused_attention" else params
        if expected is not None and tuple(inspect.signature(target).parameters) != expected:
            raise RuntimeError(
                f"seam {name}: {module_name}.{attr} has parameters "
                f"{tuple(inspect.signature(target).parameters)}, expected {expected}; this "
                "megatron-core build is not the tested one."
            )
    for name, (module_name, attr, factory, _) in _SEAMS.items():
        module = modules[module_name]
        _ORIGINALS[name] = getattr(module, attr)
        setattr(module, attr, factory())


def uninstall() -> None:
    """Restore Megatron's original functions."""
    if not installed():
        return
    dsa, cudnn_kernels = _modules()
    modules = {"dsa": dsa, "dsa_cudnn_kernels": cudnn_kernels}
    for name, (module_name, attr, _, _) in _SEAMS.items():
        setattr(modules[module_name], attr, _ORIGINALS[name])
    _ORIGINALS.clear()
