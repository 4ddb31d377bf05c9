"""Indexer operands from the projections: preprocessing and FP8 quantization, fused when possible.

:func:`prepare_indexer_operands` turns Megatron-layout projections into the
:class:`~dsa_precision.scoring.ScoringOperands` the scoring choke point consumes. It runs the fused
Triton kernel (:mod:`dsa_precision.kernels.preprocess_quantize`) when it can reproduce the torch
reference bit for bit, and the reference -- :class:`~dsa_precision.preprocess.IndexerPreprocess`
then :func:`~dsa_precision.scoring.prepare_scoring_operands` -- otherwise. Both give the same
bytes; the fused path reads the projections once and writes only the FP8 operands.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from .config import ScoringPrecision
from .hadamard import HAVE_FAST_HADAMARD
from .preprocess import IndexerPreprocess, _layer_norm_params, rope_tables, thd_token_freqs
from .quantize import DEFAULT_AMAX_FLOOR
from .scoring import ScoringOperands, prepare_scoring_operands

__all__ = ["Impl", "fused_unsupported_reason", "prepare_indexer_operands"]

Impl = Literal["auto", "triton", "torch"]
_IMPLS = ("auto", "triton", "torch")
_FUSED_HEAD_DIM = 128
# Smallest float32 amax floor of the kernel (kernels.preprocess_quantize.MIN_AMAX_FLOOR; repeated
# here so that deciding does not import Triton).
_MIN_AMAX_FLOOR = 2.0**-100
_PROJECTION_DTYPES = (torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run in its CPU interpreter (set before import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        from .kernels import preprocess_quantize  # noqa: F401
    except Exception as exc:  # a broken Triton install
        return f"the Triton kernel does not import ({exc})"
    return None


def fused_unsupported_reason(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    *,
    scoring_precision: ScoringPrecision | str,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
) -> str | None:
    """Why the fused kernel cannot build these operands bit-identically, or ``None`` if it can."""
    precision = ScoringPrecision.parse(scoring_precision)
    if precision is not ScoringPrecision.FP8:
        return "the fused kernel builds FP8 operands; BF16 scoring only rounds (torch path)"
    if _interpreting():
        pass  # Triton's interpreter runs the kernel on CPU tensors (the exactness tests)
    elif q_proj.device.type != "cuda":
        return f"the tensors are on {q_proj.device}; the fused kernel runs on CUDA"
    elif not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if q_proj.ndim != 4 or k_proj.ndim != 3 or weights.ndim != 3:
        return "the fused kernel takes q [s, b, h, 128], k [s, b, 128] and weights [s, b, h]"
    if preprocess.head_dim != _FUSED_HEAD_DIM or q_proj.shape[-1] != _FUSED_HEAD_DIM:
        return f"head_dim={preprocess.head_dim}; the fused kernel quantizes 128-wide vectors"
    if q_proj.dtype not in _PROJECTION_DTYPES or k_proj.dtype != q_proj.dtype:
        return (
            f"projections are {q_proj.dtype}/{k_proj.dtype}; the fused kernel takes BF16 or "
            "float32, the same for q and k"
        )
    if weights.dtype not in _PROJECTION_DTYPES:
        return f"weights are {weights.dtype}; the fused kernel takes BF16 or float32"
    if not preprocess.rope_fp32 and preprocess.rotate_activation and HAVE_FAST_HADAMARD:
        return (
            "fast_hadamard_transform is installed, so the reference BF16 Hadamard is that "
            "kernel's arithmetic, which the fused kernel does not reproduce bit for bit"
        )
    if preprocess.rope_fp32:
        try:
            _layer_norm_params(preprocess.k_norm)
        except TypeError as exc:
            return str(exc)
    floor32 = float(torch.tensor(float(amax_floor), dtype=torch.float32))
    if not _MIN_AMAX_FLOOR <= floor32 < float("inf"):
        return f"amax_floor={amax_floor!r} is below the fused kernel's 2**-100 (or not finite)"
    return _triton_reason()


def _reference(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    freqs: torch.Tensor,
    **kw,
) -> ScoringOperands:
    rope = kw.pop("rope")
    q, k = preprocess(q_proj, k_proj, freqs, **rope)
    return prepare_scoring_operands(
        q.transpose(0, 1), k.transpose(0, 1), weights.transpose(0, 1), **kw
    )


def _fused(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    freqs: torch.Tensor,
    *,
    sm_scale: float,
    amax_floor: float,
    mscale: float,
    cu_seqlens: torch.Tensor | None,
) -> ScoringOperands:
    from .kernels.preprocess_quantize import preprocess_quantize

    s, b, h, _ = q_proj.shape
    if k_proj.shape != (s, b, q_proj.shape[-1]) or weights.shape != (s, b, h):
        raise ValueError(
            f"expected k [{s}, {b}, 128] and weights [{s}, {b}, {h}] for q {tuple(q_proj.shape)}; "
            f"got k {tuple(k_proj.shape)}, weights {tuple(weights.shape)}."
        )
    if freqs.shape[-1] != preprocess.rope_dim:
        raise ValueError(
            f"freqs has rope width {freqs.shape[-1]}, expected rope_dim={preprocess.rope_dim}."
        )
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got q {tuple(q_proj.shape)}.")
        freqs = thd_token_freqs(freqs, cu_seqlens)
    if freqs.shape[0] < s:
        raise ValueError(f"freqs covers {freqs.shape[0]} positions, fewer than the {s} tokens.")
    math_dtype = torch.float32 if preprocess.rope_fp32 else q_proj.dtype
    cos, sin = rope_tables(freqs[:s], mscale, math_dtype)
    cos, sin = cos.reshape(s, -1), sin.reshape(s, -1)
    common = dict(
        interleaved=preprocess.rope_interleaved,
        hadamard=preprocess.rotate_activation,
        bf16_math=math_dtype == torch.bfloat16,
        amax_floor=amax_floor,
    )
    if preprocess.rope_fp32:
        k_in, layer_norm = k_proj, _layer_norm_params(preprocess.k_norm)
    else:  # the model's own LayerNorm, whose reduction order only the module reproduces
        k_in, layer_norm = preprocess.norm_key(k_proj), None
    q8, q_scale, w = preprocess_quantize(
        q_proj, cos, sin, weights=weights, sm_scale=sm_scale, **common
    )
    k8, k_scale, _ = preprocess_quantize(k_in, cos, sin, layer_norm=layer_norm, **common)
    return ScoringOperands(ScoringPrecision.FP8, q8, k8, w, q_scale, k_scale, 1.0)


@torch.no_grad()
def prepare_indexer_operands(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    freqs: torch.Tensor,
    *,
    scoring_precision: ScoringPrecision | str,
    sm_scale: float = 1.0,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
    mscale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> ScoringOperands:
    """Scoring operands of the indexer from its projections (no autograd: FP8 scoring has no
    indexer gradient, and BF16 operands are rounded copies).

    Args:
        preprocess: the indexer's :class:`~dsa_precision.preprocess.IndexerPreprocess`.
        q_proj: ``[s, b, h, 128]`` projected queries (BF16 in training).
        k_proj: ``[s, b, 128]`` projected keys.
        weights: ``[s, b, h]`` head weights (Megatron's BF16, or float32).
        freqs: ``[s, 1, 1, rope_dim]`` float32 RoPE angles (packed: per-sequence or per-token).
        scoring_precision: ``"fp8"`` or ``"bf16"``.
        sm_scale, amax_floor: as for :func:`dsa_precision.indexer_scores`.
        mscale: YaRN magnitude scale of the RoPE tables.
        cu_seqlens: ``[n + 1]`` cumulative lengths for packed THD input (``b == 1``).
        impl: ``"triton"`` (the fused kernel; raises ``RuntimeError`` with the reason when it
            cannot produce the reference bits), ``"torch"`` (the reference) or ``"auto"`` (the
            kernel when it can, else the reference).

    Returns:
        :class:`~dsa_precision.scoring.ScoringOperands` in BSHD (packed input: batch 1), the same
        bytes whichever path built them.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not an implementation; use one of {_IMPLS}.")
    precision = ScoringPrecision.parse(scoring_precision)
    reason = None
    if impl != "torch":
        reason = fused_unsupported_reason(
            preprocess,
            q_proj,
            k_proj,
            weights,
            scoring_precision=precision,
            amax_floor=amax_floor,
        )
        if reason is not None and impl == "triton":
            raise RuntimeError(
                f"impl='triton' cannot build these operands: {reason}. Use impl='torch' (the "
                "reference, same bytes) or impl='auto'."
            )
    if impl == "torch" or reason is not None:
        return _reference(
            preprocess,
            q_proj,
            k_proj,
            weights,
            freqs,
            rope=dict(mscale=mscale, cu_seqlens=cu_seqlens),
            scoring_precision=precision,
            sm_scale=sm_scale,
            amax_floor=amax_floor,
        )
    return _fused(
        preprocess,
        q_proj,
        k_proj,
        weights,
        freqs,
        sm_scale=float(sm_scale),
        amax_floor=float(amax_floor),
        mscale=mscale,
        cu_seqlens=cu_seqlens,
    )
