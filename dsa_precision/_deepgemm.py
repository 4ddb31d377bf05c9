"""The one place that imports DeepGEMM's ``fp8_mqa_logits`` and says why it cannot run.

DeepGEMM is the kernel the inference engines score the FP8 indexer with on Hopper (vLLM, SGLang),
so ``backend="deepgemm"`` gives the engine's logits by construction. It is optional: the
standalone ``deep_gemm`` package, or the copy vLLM ships as ``vllm.third_party.deep_gemm``.
Importing this module loads nothing.

The API is detected by feature, not by version string (pybind11 functions have no signature, so
the parameter names are read from the docstring). Every variant up to 2.6 takes the first five
arguments positionally, ``(q, (k, k_scales), weights, cu_seq_len_k_start, cu_seq_len_k_end)``,
then ``clean_logits=True``. DeepGEMM 2.8 (vendored by vLLM 0.31+) dropped that legacy name; its
``fp8_fp4_mqa_logits`` requires ``max_seqlen_k`` and returns compressed, uncleaned logits, so such
a build is reported as unusable rather than called. ``max_seqlen_k`` (compressed output, 2.2+)
is never used here. See ``docs/numerics.md`` for the kernel's arithmetic and the commits this was read from.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from .config import FP8_HEAD_DIM, FP8_N_HEADS, ScoringPrecision

__all__ = ["deepgemm_available", "fp8_mqa_logits", "mqa_logits_unsupported_reason"]

# Tried in order: the standalone package, then vLLM's vendored copy.
_MODULES = ("deep_gemm", "vllm.third_party.deep_gemm")
_INSTALL_HINT = (
    "build DeepGEMM from https://github.com/deepseek-ai/DeepGEMM (python setup.py install; needs "
    "CUDA 12.8+ and an SM90 GPU) or install vLLM, which vendors it; docs/gpu-validation.md says how"
)


@functools.cache
def _import() -> tuple[Any, str | None]:
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken build (missing CUDA_HOME, ...)
            errors.append(f"{name}: {exc}")
            continue
        fn = getattr(module, "fp8_mqa_logits", None)
        if fn is None:
            if hasattr(module, "fp8_fp4_mqa_logits"):  # DeepGEMM 2.8+: the alias is gone
                errors.append(
                    f"{name} has only fp8_fp4_mqa_logits (DeepGEMM 2.8+, whose logits are "
                    "compressed and uncleaned: max_seqlen_k is required), which this package "
                    "does not call yet; use a DeepGEMM 2.0-2.6 build"
                )
            else:
                errors.append(f"{name} has no fp8_mqa_logits")
            continue
        doc = fn.__doc__ or ""
        if doc and "weights" not in doc:
            errors.append(f"{name}.fp8_mqa_logits has an unknown signature ({doc.splitlines()[0]})")
            continue
        return fn, None
    return (
        None,
        f"DeepGEMM's fp8_mqa_logits is not importable ({'; '.join(errors)}); {_INSTALL_HINT}",
    )


def deepgemm_available() -> bool:
    """Whether DeepGEMM's ``fp8_mqa_logits`` imports."""
    return _import()[0] is not None


def fp8_mqa_logits(
    q: torch.Tensor,  # (S_q, H, 128) float8_e4m3fn, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # (k (S_k, 128) e4m3, k_descale (S_k,) float32)
    weights: torch.Tensor,  # (S_q, H) float32, q descale folded in, contiguous
    key_start: torch.Tensor,  # (S_q,) int32, first key of each row's window
    key_end: torch.Tensor,  # (S_q,) int32, one past its last key
) -> torch.Tensor:  # (S_q, S_k) float32, -inf outside [key_start, key_end)
    fn, reason = _import()
    if fn is None:
        raise ImportError(reason)
    return fn(q, kv, weights, key_start, key_end, True)


def mqa_logits_unsupported_reason(
    *, device: torch.device, precision: ScoringPrecision, n_heads: int, head_dim: int
) -> str | None:
    """Why DeepGEMM's ``fp8_mqa_logits`` cannot serve this call, or ``None`` if it can."""
    if precision is not ScoringPrecision.FP8:
        return "DeepGEMM's fp8_mqa_logits scores FP8 operands only; use scoring_precision='fp8'"
    if device.type != "cuda":
        return f"the tensors are on {device}; DeepGEMM runs on CUDA devices"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"the device is SM{major}{minor}; this package uses DeepGEMM's SM90 kernel"
    if head_dim != FP8_HEAD_DIM or n_heads not in FP8_N_HEADS:
        return f"{n_heads} heads of width {head_dim}; its SM90 kernel takes {FP8_N_HEADS} x 128"
    return _import()[1]
