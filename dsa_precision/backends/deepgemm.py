"""The one place that calls DeepGEMM's MQA-logits kernel and says why it cannot run.

DeepGEMM is the kernel the inference engines score the FP8 indexer with on Hopper (vLLM, SGLang),
so ``backend="deepgemm"`` gives the engine's logits by construction. It is optional: the
standalone ``deep_gemm`` package, or the copy vLLM ships as ``vllm.third_party.deep_gemm``.
Importing this module loads nothing.

The package calls the kernel's *compressed* form, one launch for every query row of a call
(batch rows and packed sequences flattened, each row's key window ``[ks, ke)`` given by
``cu_seq_len_k_start`` / ``cu_seq_len_k_end``): logits ``(rows, max_seqlen_k)``, column ``j`` of
row ``i`` is key ``ks[i] + j``, written for ``j < ke[i] - ks[i]`` only; the rows lie
``align(max_seqlen_k, 256)`` floats apart in a buffer DeepGEMM allocates (``fp8_fp4_mqa_logits``
in ``csrc/apis/attention.hpp`` of DeepGEMM 54e2261). :func:`_window_logits` hands that buffer on
untouched, as a :class:`~dsa_precision.rows.WindowScores`: the top-k reads it in place, bounded by
each row's length, which is how vLLM's prefill path reads it (``sparse_attn_indexer.py``:
``fp8_fp4_mqa_logits(..., max_seqlen_k)``, then ``top_k_per_row_prefill`` with the row ends and
strides). Entry points, detected by feature
(pybind11 functions have no signature, so their parameter names are read from the docstring):

- ``fp8_fp4_mqa_logits((q, None), (k, k_scales), weights, ks, ke, clean_logits=False,
  max_seqlen_k=N)``: DeepGEMM 2.4-2.6 (2.6.1 is 54e2261); 2.8 (vLLM 0.31+) has no
  ``clean_logits`` and is called without it.
- ``fp8_mqa_logits(q, (k, k_scales), weights, ks, ke, clean_logits=False, max_seqlen_k=N)``: the
  legacy name, where it takes ``max_seqlen_k`` (2.2 and later; a wrapper of the first since 2.4).

DeepGEMM 2.0-2.1 (``fp8_mqa_logits`` without ``max_seqlen_k``) has no compressed form and is
reported, not called. Full causal scores (:func:`_causal_logits`) use the uncompressed form with
DeepGEMM's own cleaning where the entry point takes ``clean_logits``.

Determinism: the SM90 kernel writes every logit once, from one thread's fixed-order sum over
heads (no split over keys or heads, no atomics), so its logits are a function of the operands
whatever mode DeepGEMM is in. The package changes no DeepGEMM mode: DeepGEMM 2.8's
``use_deterministic_algorithms(bool)`` sets one process-wide flag, read only where DeepGEMM
chooses between algorithms of other kernels (its BF16 GEMMs and einsums take cuBLASLt when it is
off: ``csrc/apis/gemm.hpp`` ``bf16_gemm_nt``, ``csrc/apis/einsum.hpp``); its SM90 MQA-logits
path reads it nowhere (``fp8_fp4_mqa_logits`` in ``csrc/apis/attention.hpp``, then
``csrc/jit_kernels/impls/sm90_fp8_mqa_logits.hpp``, of vllm-project/DeepGEMM, the source of the
2.8.1 vLLM 0.33 vendors, whose kernel template in the wheel takes no such parameter). Setting it
would change an inference engine's own DeepGEMM GEMMs in the same process (colocated RL), and
2.8.1 has no getter to restore it by. 54e2261 has no such flag. See ``docs/numerics.md`` for the
kernel's arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..config import _FP8_HEAD_DIM, _FP8_N_HEADS, ScoringPrecision
from ..rows import WindowScores

__all__ = []

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
    name: str  # "deep_gemm.fp8_fp4_mqa_logits", ...
    q_pair: bool  # fp8_fp4_mqa_logits takes (q, q_scales); the legacy name takes q
    clean_logits_arg: bool  # takes clean_logits (all but DeepGEMM 2.8)
    module: Any = None  # the module fn came from (deep_gemm, vLLM's copy)


def _parameter_names(fn: Callable) -> str | None:
    """The parameter names of ``fn`` as text (its signature, else a pybind11 docstring)."""
    try:
        return " ".join(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pybind11 builtins have no signature
        return fn.__doc__ or None


def _resolve(module: Any, name: str) -> tuple[_EntryPoint | None, str | None]:
    reasons = []
    for attr, q_pair in (("fp8_fp4_mqa_logits", True), ("fp8_mqa_logits", False)):
        fn = getattr(module, attr, None)
        if fn is None:
            continue
        params = _parameter_names(fn)
        if params is None or "max_seqlen_k" not in params or "weights" not in params:
            reasons.append(
                f"{name}.{attr} takes no max_seqlen_k ({params or 'no signature'}); this "
                "package calls the compressed form (DeepGEMM 2.2 and later)"
            )
            continue
        entry = _EntryPoint(fn, f"{name}.{attr}", q_pair, "clean_logits" in params, module)
        return entry, None
    if not reasons:
        return None, f"{name} has neither fp8_fp4_mqa_logits nor fp8_mqa_logits"
    return None, "; ".join(reasons)


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
        assert error is not None  # _resolve gives an entry point or the reason
        errors.append(error)
    return None, f"DeepGEMM's MQA logits are not importable ({'; '.join(errors)}); {_INSTALL_HINT}"


def _deepgemm_available() -> bool:
    """Whether a DeepGEMM MQA-logits entry point imports."""
    return _import()[0] is not None


def _unavailable_reason() -> str | None:
    """Why no DeepGEMM MQA-logits entry point imports (each module tried, an install hint), or
    ``None`` when one does."""
    return _import()[1]


def _kernel_entry() -> _EntryPoint | None:
    """The resolved DeepGEMM entry point (function, name, calling convention), or ``None`` when
    DeepGEMM is not importable: what a caller of the raw kernel (``bench``) calls."""
    return _import()[0]


def _entry_point() -> str | None:
    """The function ``backend="deepgemm"`` calls (``"deep_gemm.fp8_fp4_mqa_logits"``, ...), or
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
    clean: bool = False,
) -> torch.Tensor:
    """The only call of DeepGEMM. ``max_seqlen_k > 0``: compressed, uncleaned logits;
    ``max_seqlen_k == 0`` (``clean`` only): ``(rows, S_k)`` logits, ``-inf`` outside the windows.
    DeepGEMM's modes are left as the caller set them (the module docstring says why)."""
    entry, reason = _import()
    if entry is None:
        raise ImportError(reason)
    extra = {"clean_logits": clean} if entry.clean_logits_arg else {}
    q_arg = (q, None) if entry.q_pair else q
    return entry.fn(q_arg, kv, weights, key_start, key_end, max_seqlen_k=max_seqlen_k, **extra)


def _window_logits(
    q: torch.Tensor,  # (rows, H, 128) float8_e4m3fn, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # (k (keys, 128) e4m3, k_descale (keys,) float32)
    weights: torch.Tensor,  # (rows, H) float32, q descale folded in, contiguous
    key_start: torch.Tensor,  # (rows,) int32, first key of each row's window
    key_end: torch.Tensor,  # (rows,) int32, one past its last key
    columns: int,  # >= every key_end - key_start
    counts: torch.Tensor | None = None,  # (rows,) int32 key_end - key_start, if the caller has it
) -> WindowScores:
    """One launch: the logits of every row against its window ``[key_start, key_end)``, as the
    kernel left them (``(rows, columns)``, a view of its padded buffer; no copy, no mask)."""
    logits = _launch(q, kv, weights, key_start, key_end, columns)
    try:  # WindowScores' own layout rule, the one the top-k reads by
        if logits.ndim != 2 or logits.shape[1] != columns:
            raise ValueError(f"expected {columns} columns")
        window = WindowScores(logits, key_end - key_start if counts is None else counts)
        window.rows_in_place()
    except ValueError as exc:
        raise RuntimeError(
            f"DeepGEMM returned logits of shape {tuple(logits.shape)} and strides "
            f"{logits.stride()}; expected row-major rows of one buffer, {columns} columns "
            f"(DeepGEMM 2.4-2.8's layout): {exc}"
        ) from exc
    return window


def _causal_logits(
    q: torch.Tensor,  # (S_q, H, 128) float8_e4m3fn, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # (k (S_k, 128) e4m3, k_descale (S_k,) float32)
    weights: torch.Tensor,  # (S_q, H) float32, q descale folded in, contiguous
    key_end: torch.Tensor,  # (S_q,) int32, one past each row's last key
) -> (
    torch.Tensor
):  # (S_q, S_k) float32 (row stride padded), column j is key j, -inf from key_end on
    """Logits of every row against keys ``[0, key_end)``, cleaned by DeepGEMM where the entry point
    takes ``clean_logits`` (one launch and DeepGEMM's cleaning kernel), else masked here."""
    entry = _import()[0]
    if entry is not None and entry.clean_logits_arg:
        return _launch(q, kv, weights, torch.zeros_like(key_end), key_end, 0, clean=True)
    return _window_logits(
        q, kv, weights, torch.zeros_like(key_end), key_end, kv[0].shape[0]
    ).masked()


def _mqa_logits_unsupported_reason(
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
    if head_dim != _FP8_HEAD_DIM or n_heads not in _FP8_N_HEADS:
        return f"{n_heads} heads of width {head_dim}; its SM90 kernel takes {_FP8_N_HEADS} x 128"
    return _import()[1]
