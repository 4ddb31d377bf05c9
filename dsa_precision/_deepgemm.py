"""The one place that calls DeepGEMM's MQA-logits kernel and says why it cannot run.

DeepGEMM is the kernel the inference engines score the FP8 indexer with on Hopper (vLLM, SGLang),
so ``backend="deepgemm"`` gives the engine's logits by construction. It is optional: the
standalone ``deep_gemm`` package, or the copy vLLM ships as ``vllm.third_party.deep_gemm``.
Importing this module loads nothing.

The entry point is detected by feature, not by version string (pybind11 functions have no
signature, so their parameter names are read from the docstring):

- ``fp8_mqa_logits(q, (k, k_scales), weights, ks, ke, clean_logits)`` (DeepGEMM 2.0-2.6, a legacy
  wrapper since 2.4): called with ``clean_logits=True``; logits ``(S_q, S_k)``, column ``j`` is
  key ``j``, ``-inf`` outside ``[ks, ke)``.
- otherwise ``fp8_fp4_mqa_logits((q, None), (k, k_scales), weights, ks, ke, max_seqlen_k=...)``
  (the only name in DeepGEMM 2.8, which vLLM 0.31+ vendors; 2.4-2.6 also take
  ``clean_logits=False`` for this form): compressed logits ``(S_q, max_seqlen_k)``, column ``j``
  is key ``ks + j``, the tail past ``ke - ks`` not written.

Both run the same SM90 kernel (2.4-2.6 implement the legacy name as a call of the new one); the
functions below hand back one layout whichever entry point ran. See ``docs/numerics.md`` for the
kernel's arithmetic and the commits this was read from.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .config import FP8_HEAD_DIM, FP8_N_HEADS, ScoringPrecision

__all__ = [
    "causal_logits",
    "deepgemm_available",
    "entry_point",
    "mqa_logits_unsupported_reason",
    "window_logits",
]

# Tried in order: the standalone package, then vLLM's vendored copy.
_MODULES = ("deep_gemm", "vllm.third_party.deep_gemm")
_INSTALL_HINT = (
    "build DeepGEMM from https://github.com/deepseek-ai/DeepGEMM (python setup.py install; needs "
    "CUDA 12.8+ and an SM90 GPU) or install vLLM, which vendors it; docs/gpu-validation.md says how"
)


@dataclasses.dataclass(frozen=True)
class _EntryPoint:
    """A resolved DeepGEMM function and how to call it."""

    fn: Callable[..., torch.Tensor]
    name: str  # "deep_gemm.fp8_mqa_logits", ...
    compressed: bool  # fp8_fp4_mqa_logits with max_seqlen_k: window-local columns, tail unwritten
    clean_logits_arg: bool = False  # fp8_fp4_mqa_logits of 2.4-2.6 takes clean_logits=False too


def _parameter_names(fn: Callable) -> str | None:
    """The parameter names of ``fn`` as text (its signature, else a pybind11 docstring)."""
    try:
        return " ".join(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pybind11 builtins have no signature
        return fn.__doc__ or None


def _resolve(module: Any, name: str) -> tuple[_EntryPoint | None, str | None]:
    legacy = getattr(module, "fp8_mqa_logits", None)
    if legacy is not None:
        doc = legacy.__doc__ or ""
        if doc and "weights" not in doc:
            return None, f"{name}.fp8_mqa_logits has an unknown signature ({doc.splitlines()[0]})"
        return _EntryPoint(legacy, f"{name}.fp8_mqa_logits", compressed=False), None
    fn = getattr(module, "fp8_fp4_mqa_logits", None)
    if fn is None:
        return None, f"{name} has neither fp8_mqa_logits nor fp8_fp4_mqa_logits"
    params = _parameter_names(fn)
    if params is None or "max_seqlen_k" not in params:
        return None, (
            f"{name}.fp8_fp4_mqa_logits takes no max_seqlen_k ({params or 'no signature'}); "
            "this package calls it with max_seqlen_k (DeepGEMM 2.4 and later)"
        )
    entry = _EntryPoint(
        fn,
        f"{name}.fp8_fp4_mqa_logits",
        compressed=True,
        clean_logits_arg="clean_logits" in params,
    )
    return entry, None


@functools.cache
def _import() -> tuple[_EntryPoint | None, str | None]:
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken build (missing CUDA_HOME, ...)
            errors.append(f"{name}: {exc}")
            continue
        entry, error = _resolve(module, name)
        if entry is not None:
            return entry, None
        errors.append(error)
    return None, f"DeepGEMM's MQA logits are not importable ({'; '.join(errors)}); {_INSTALL_HINT}"


def deepgemm_available() -> bool:
    """Whether a DeepGEMM MQA-logits entry point imports."""
    return _import()[0] is not None


def entry_point() -> str | None:
    """The function ``backend="deepgemm"`` calls (``"deep_gemm.fp8_mqa_logits"``, ...), or
    ``None`` when DeepGEMM is not importable."""
    entry = _import()[0]
    return None if entry is None else entry.name


def _launch(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, bool]:
    """The only call of DeepGEMM: ``(logits, compressed)`` (layouts in the module docstring)."""
    entry, reason = _import()
    if entry is None:
        raise ImportError(reason)
    if not entry.compressed:
        return entry.fn(q, kv, weights, key_start, key_end, True), False
    extra = {"clean_logits": False} if entry.clean_logits_arg else {}
    logits = entry.fn(
        (q, None), kv, weights, key_start, key_end, max_seqlen_k=max_seqlen_k, **extra
    )
    return logits, True


def _mask_past(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``-inf`` in every column ``j >= counts[i]`` of row ``i``, in place."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    return logits.masked_fill_(cols >= counts.unsqueeze(1), float("-inf"))


def causal_logits(
    q: torch.Tensor,  # (S_q, H, 128) float8_e4m3fn, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # (k (S_k, 128) e4m3, k_descale (S_k,) float32)
    weights: torch.Tensor,  # (S_q, H) float32, q descale folded in, contiguous
    key_end: torch.Tensor,  # (S_q,) int32, one past each row's last key
) -> torch.Tensor:  # (S_q, S_k) float32, column j is key j, -inf from key_end on
    """Logits of every row against keys ``[0, key_end)``."""
    s_k = kv[0].shape[0]
    key_start = torch.zeros_like(key_end)
    logits, compressed = _launch(q, kv, weights, key_start, key_end, s_k)
    # Windows start at key 0, so both layouts agree; the compressed one leaves the tail unwritten.
    return _mask_past(logits, key_end) if compressed else logits


def window_logits(
    q: torch.Tensor,  # (S_q, H, 128) float8_e4m3fn, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # (k (S_k, 128) e4m3, k_descale (S_k,) float32)
    weights: torch.Tensor,  # (S_q, H) float32, q descale folded in, contiguous
    key_start: torch.Tensor,  # (S_q,) int32, first key of each row's window
    key_end: torch.Tensor,  # (S_q,) int32, one past its last key
    columns: int,  # >= every key_end - key_start
) -> torch.Tensor:  # (S_q, columns) float32, column j is key key_start + j, -inf past the window
    """Logits of every row against its window ``[key_start, key_end)``, window-local columns."""
    logits, compressed = _launch(q, kv, weights, key_start, key_end, columns)
    counts = key_end - key_start
    if not compressed:  # gather each window from the (S_q, S_k) logits
        cols = torch.arange(columns, device=logits.device)
        idx = (key_start.to(torch.int64).unsqueeze(1) + cols).clamp_(
            max=max(logits.shape[1] - 1, 0)
        )
        logits = logits.gather(1, idx)
    return _mask_past(logits[:, :columns], counts)


def mqa_logits_unsupported_reason(
    *, device: torch.device, precision: ScoringPrecision, n_heads: int, head_dim: int
) -> str | None:
    """Why DeepGEMM's MQA logits cannot serve this call, or ``None`` if they can."""
    if precision is not ScoringPrecision.FP8:
        return "DeepGEMM's MQA logits score FP8 operands only; use scoring_precision='fp8'"
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
