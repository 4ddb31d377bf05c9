"""When the fused Triton preprocess + quantize kernel builds the FP8 operands.

The kernel runs only where it reproduces the torch reference bit for bit; every ``*_reason``
function here returns why it cannot (``None``: it can), so ``impl="auto"`` takes the kernel
exactly where the bytes are the same, and ``impl="triton"`` raises with the reason elsewhere.
Deciding imports no Triton.
"""

from __future__ import annotations

from typing import Literal

import torch

from .config import _QUANT_BLOCK, IndexerPrecisionConfig
from .devices import f32
from .engines import EngineProfile
from .hadamard import HAVE_FAST_HADAMARD
from .kernels import interpreting, triton_unavailable_reason
from .operands import _WEIGHT_DTYPES
from .preprocess import IndexerPreprocess, _check_layer_norm

__all__ = ["Impl"]

Impl = Literal["auto", "triton", "torch"]
_IMPLS = ("auto", "triton", "torch")
# Smallest float32 amax floor of the kernel (kernels.preprocess_quantize.MIN_AMAX_FLOOR; repeated
# here so that deciding does not import Triton).
_MIN_AMAX_FLOOR = 2.0**-100
# The fused kernel multiplies the folded weight by at most this many scalars after the descale.
_MAX_KERNEL_FOLD_SCALES = 3


def _device_reason(t: torch.Tensor) -> str | None:
    if interpreting():
        return None  # Triton's interpreter runs the kernel on CPU tensors (the exactness tests)
    if t.device.type != "cuda":
        return f"the tensors are on {t.device}; the fused kernel runs on CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return None


def _rule_reason(engine: EngineProfile) -> str | None:
    for name, rule in (("q_quant", engine.q_quant), ("k_quant", engine.k_quant)):
        floor32 = f32(rule.amax_floor)
        if not _MIN_AMAX_FLOOR <= floor32 < float("inf"):
            return f"{name}.amax_floor={rule.amax_floor!r} is below the fused kernel's 2**-100"
    return None


def _quantize_kernel_reason(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, engine: EngineProfile
) -> str | None:
    """Why the fused kernel cannot quantize these carriers bit-identically, or ``None``."""
    reason = _device_reason(q) or _rule_reason(engine)
    if reason:
        return reason
    if q.shape[-1] != _QUANT_BLOCK:
        return f"head_dim={q.shape[-1]}; the fused kernel quantizes {_QUANT_BLOCK}-wide vectors"
    if q.dtype not in _WEIGHT_DTYPES or k.dtype not in _WEIGHT_DTYPES:
        return f"carriers are {q.dtype}/{k.dtype}; the fused kernel takes BF16 or float32"
    if weights.dtype not in _WEIGHT_DTYPES:
        return f"weights are {weights.dtype}; the fused kernel takes BF16 or float32"
    return triton_unavailable_reason()


def _fused_unsupported_reason(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    *,
    config: IndexerPrecisionConfig,
) -> str | None:
    """Why the fused kernel cannot build these FP8 operands bit-identically, or ``None`` if it can."""
    if not config.fp8:
        return "the fused kernel builds FP8 operands; BF16 scoring only rounds (torch path)"
    reason = _device_reason(q_proj) or _rule_reason(config.engine)
    if reason:
        return reason
    if q_proj.ndim != 4 or k_proj.ndim != 3 or weights.ndim != 3:
        return "the fused kernel takes q [s, b, h, 128], k [s, b, 128] and weights [s, b, h]"
    if preprocess.head_dim != _QUANT_BLOCK or q_proj.shape[-1] != _QUANT_BLOCK:
        return f"head_dim={preprocess.head_dim}; the fused kernel quantizes 128-wide vectors"
    if q_proj.dtype not in _WEIGHT_DTYPES or k_proj.dtype != q_proj.dtype:
        return (
            f"projections are {q_proj.dtype}/{k_proj.dtype}; the fused kernel takes BF16 or "
            "float32, the same for q and k"
        )
    if weights.dtype not in _WEIGHT_DTYPES:
        return f"weights are {weights.dtype}; the fused kernel takes BF16 or float32"
    if not preprocess.rope_fp32 and not preprocess.exact_bf16_rope:
        return (
            "the model's BF16 RoPE is a fused kernel (apply_rope_fusion), whose bits the fused "
            "preprocess + quantize kernel does not reproduce"
        )
    if not preprocess.rope_fp32 and preprocess.rotate_activation and HAVE_FAST_HADAMARD:
        return (
            "fast_hadamard_transform is installed, so the reference BF16 Hadamard is that "
            "kernel's arithmetic, which the fused kernel does not reproduce bit for bit"
        )
    if preprocess.rope_fp32:
        try:
            _check_layer_norm(preprocess.k_norm)
        except TypeError as exc:
            return str(exc)
    return triton_unavailable_reason()


def _check_impl(impl: str, bf16_reason: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not an implementation; use one of {_IMPLS}.")
    if impl == "triton":
        raise RuntimeError(
            f"impl='triton' cannot build these operands: {bf16_reason}. Use impl='torch' or "
            "impl='auto'."
        )


def _use_kernel(impl: str, reason: str | None) -> bool:
    """Whether to run the fused kernel; an explicit ``impl="triton"`` that cannot run raises."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not an implementation; use one of {_IMPLS}.")
    if impl == "torch":
        return False
    if reason is not None and impl == "triton":
        raise RuntimeError(
            f"impl='triton' cannot build these operands: {reason}. Use impl='torch' (the "
            "reference, same bytes) or impl='auto'."
        )
    return reason is None
