"""The one place that imports nvidia-cudnn-frontend's DSA kernels and says why they cannot run.

Importing this module loads nothing: the cuDNN namespace is resolved on first use. The external
API subset used by the package is documented by :class:`CudnnDsaInterface`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..config import _FP8_HEAD_DIM, _FP8_N_HEADS, ScoringPrecision
from ..devices import _Lru

__all__ = ["CudnnDsaInterface", "dsa", "dsa_available", "dsa_unavailable_reason"]

# Head counts the SM90 BF16 indexer kernel packs (FP8: FP8_N_HEADS); one key head.
_CUDNN_BF16_N_HEADS = (16, 32, 64)
# cuDNN's radix top-k serves 0 < k <= 2048.
_CUDNN_TOPK_MAX_K = 2048
# Base address alignment (bytes) of the scores its class API binds (INPUT_ALIGN of 1.32).
_TOPK_INPUT_ALIGN = 32

_INSTALL_HINT = (
    "pip install 'nvidia-cudnn-frontend>=1.32,<1.33' (needs CUDA 12.8+ and the CuTe DSL)"
)


class CudnnDsaInterface(Protocol):
    """The subset of ``cudnn.DSA`` (nvidia-cudnn-frontend 1.32) this package calls."""

    def indexer_forward_wrapper(
        self,
        q: torch.Tensor,  # (B, S_q, H, 128) BF16 or E4M3 | THD (T_q, H, 128)
        k: torch.Tensor,  # (B, S_k, 1, 128) BF16 or E4M3 | THD (T_k, 1, 128)
        w: torch.Tensor,  # (B, S_q, H) BF16/FP32; FP32 pre-scaled by q_scale * sm_scale for fp8
        ratio: int = ...,
        sm_scale: float = ...,
        *,
        out: torch.Tensor | None = ...,  # (B, S_q, S_k) FP32, written in place
        cu_seqlens_q: torch.Tensor | None = ...,
        cu_seqlens_k: torch.Tensor | None = ...,
        max_seqlen_q: int | None = ...,
        max_seqlen_k: int | None = ...,
        q_causal_offsets: torch.Tensor | None = ...,
        precision: str = ...,  # "bf16" | "fp8" (SM90 per-128-vector descales)
        q_scale: torch.Tensor | None = ...,  # (B, S_q, H) FP32 descale
        k_scale: torch.Tensor | None = ...,  # (B, S_k, 1) FP32 descale
    ) -> Any: ...  # TupleDict(scores=(B, S_q, S_k) FP32, -inf where masked)

    def indexer_top_k_wrapper(
        self,
        input_values: torch.Tensor,  # (n_rows, S_k) FP32
        seq_lens: torch.Tensor,  # (n_rows,) INT32
        top_k: int,
        next_n: int = ...,
        return_val: bool = ...,
        *,
        deterministic: bool = ...,
    ) -> Any: ...  # TupleDict(indices=(n_rows, top_k) INT32, values=(n_rows, top_k))

    # The class behind indexer_top_k_wrapper, for caller-owned buffers (the package's top-k):
    #   plan = IndexerTopK(sample_input_values, sample_seq_lens, top_k, next_n=1,
    #                      return_val=True, deterministic=...)   # shapes, dtypes, device only
    #   plan.check_support() -> True (raises otherwise); plan.compile()
    #   plan.scratch_workspace_bytes() -> int
    #   plan.execute(input_values, seq_lens, out_indices=, out_values=, workspace=)
    #     input_values (n_rows, S_k) contiguous, 32-byte aligned; seq_lens (n_rows,) INT32
    #     contiguous; out_indices (n_rows, top_k) INT32, out_values (n_rows, top_k) in the
    #     input dtype, workspace uint8 of scratch_workspace_bytes(), all disjoint
    IndexerTopK: Callable[..., Any]

    def sparse_attention_backward_wrapper(
        self,
        q: torch.Tensor,  # (T, H, D) BF16, H padded to 64 on SM90
        kv: torch.Tensor,  # (T_k, D) BF16
        out: torch.Tensor,  # (T, H, D_v)
        dout: torch.Tensor,  # (T, H, D_v)
        lse: torch.Tensor,  # (T, H) FP32, natural-log LSE over the selected keys
        attn_sink: torch.Tensor,  # (H,) FP32
        topk_idxs: torch.Tensor,  # (T, K) INT32 global rows of kv
        softmax_scale: float | None = ...,
        topk_length: torch.Tensor | None = ...,  # (T,) INT32 valid prefix of each row
    ) -> Any: ...  # TupleDict(dq=(T, H, D), dkv=(T_k, D), d_sink=(H,))


class _Resolved:
    """``cudnn.DSA`` with each entry point looked up once: the lazy namespace re-imports the
    entry point's module on every attribute access (``importlib.import_module``, a measurable
    share of a launch's host time), so the first lookup of a name is kept as an attribute."""

    def __init__(self, namespace: Any) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:  # only for names not looked up yet
        value = getattr(self._namespace, name)
        setattr(self, name, value)
        return value


@functools.cache
def _import_dsa() -> tuple[Any, str | None]:
    try:
        from cudnn import DSA  # the lazy namespace; resolving symbols compiles nothing

        dsa = _Resolved(DSA)
        dsa.indexer_forward_wrapper  # noqa: B018 - imports the indexer module (CuTe DSL)
        dsa.indexer_top_k_wrapper  # noqa: B018
        dsa.IndexerTopK  # noqa: B018
    except Exception as exc:  # ImportError, or a broken CUDA / CuTe DSL install
        return (
            None,
            f"nvidia-cudnn-frontend's DSA kernels are not importable ({exc}); {_INSTALL_HINT}",
        )
    return dsa, None


def dsa_available() -> bool:
    """Whether nvidia-cudnn-frontend's DSA namespace imports."""
    return _import_dsa()[0] is not None


def dsa_unavailable_reason() -> str | None:
    """Why nvidia-cudnn-frontend's DSA namespace does not import (with an install hint)."""
    return _import_dsa()[1]


def dsa() -> CudnnDsaInterface:
    """The ``cudnn.DSA`` namespace; ``ImportError`` with an install hint when unavailable."""
    namespace, reason = _import_dsa()
    if namespace is None:
        raise ImportError(reason)
    return namespace


def _device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch (cuDNN's wrappers read the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the tensors are on {device}; cuDNN's DSA kernels run on CUDA devices"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return None


def _scoring_unsupported_reason(
    *,
    device: torch.device,
    precision: ScoringPrecision,
    n_heads: int,
    head_dim: int,
    n_kv_heads: int,
) -> str | None:
    """Why cuDNN's SM90 indexer forward cannot serve this call, or ``None`` if it can."""
    reason = _device_reason(device)
    if reason:
        return reason
    major, minor = torch.cuda.get_device_capability(device)
    if precision is ScoringPrecision.FP8 and major != 9:
        return (
            f"the device is SM{major}{minor}; cuDNN's per-128-vector FP8 indexer kernel is SM90 "
            "(Hopper) only"
        )
    if major < 9:
        return f"the device is SM{major}{minor}; cuDNN's DSA indexer needs SM90+"
    if head_dim != _FP8_HEAD_DIM:
        return f"head_dim={head_dim}; cuDNN's indexer kernel is built for head_dim=128"
    if n_kv_heads != 1:
        return f"k has {n_kv_heads} heads; cuDNN's SM90 indexer kernel takes one key head"
    heads = _FP8_N_HEADS if precision is ScoringPrecision.FP8 else _CUDNN_BF16_N_HEADS
    if major == 9 and n_heads not in heads:
        return f"n_heads={n_heads}; cuDNN's SM90 {precision.value} indexer kernel packs {heads}"
    _, reason = _import_dsa()
    return reason


def _topk_unsupported_reason(*, device: torch.device, k: int, dtype: torch.dtype) -> str | None:
    """Why cuDNN's radix top-k cannot serve this call, or ``None`` if it can."""
    reason = _device_reason(device)
    if reason:
        return reason
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the device is SM{major}{minor}; cuDNN's DSA top-k needs SM90+"
    if k > _CUDNN_TOPK_MAX_K:
        return f"k={k}; cuDNN's top-k serves k <= {_CUDNN_TOPK_MAX_K}"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"scores have dtype {dtype}; cuDNN's top-k takes float32/float16/bfloat16"
    _, reason = _import_dsa()
    return reason


# The hot path's checks. On a CUDA device the answers depend only on facts fixed for the process
# (CUDA availability, the device's architecture, whether cuDNN imports) and on the hashable
# arguments, so they are computed once; other devices are asked every time (cheap, and the tests'
# stand-ins of SM90 hardware change those answers).


_cuda_scoring_reason = functools.lru_cache(maxsize=256)(_scoring_unsupported_reason)
_cuda_topk_reason = functools.lru_cache(maxsize=256)(_topk_unsupported_reason)


def _scoring_reason(
    device: torch.device, precision: ScoringPrecision, n_heads: int, head_dim: int, n_kv_heads: int
) -> str | None:
    """:func:`_scoring_unsupported_reason`, remembered per CUDA device and arguments."""
    reason = _cuda_scoring_reason if device.type == "cuda" else _scoring_unsupported_reason
    return reason(
        device=device, precision=precision, n_heads=n_heads, head_dim=head_dim,
        n_kv_heads=n_kv_heads,
    )  # fmt: skip


def _topk_reason(device: torch.device, k: int, dtype: torch.dtype) -> str | None:
    """:func:`_topk_unsupported_reason`, remembered per CUDA device and arguments."""
    reason = _cuda_topk_reason if device.type == "cuda" else _topk_unsupported_reason
    return reason(device=device, k=k, dtype=dtype)


# cuDNN's top-k plans (IndexerTopK), checked and compiled once per class, device, dtype, shape,
# k and mode: what indexer_top_k_wrapper caches for itself, kept here so that the package's top-k
# can pass its own buffers to execute() (no staging, no per-call cache key of the wrapper).
_TOPK_PLANS = _Lru(256)


def _topk_plan(
    scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int, deterministic: bool
) -> Any:
    """The compiled ``IndexerTopK`` plan of ``scores`` ``(rows, S_k)`` (contiguous) and
    ``seq_lens`` ``(rows,)`` int32: ``top_k`` per row, values returned, one length per row
    (``next_n=1``), ties as ``deterministic`` asks; built once and reused (call it with ``scores``'
    device current)."""
    cls = dsa().IndexerTopK
    rows, cols = scores.shape
    key = (cls, scores.device, scores.dtype, rows, cols, top_k, deterministic)
    plan = _TOPK_PLANS.get(key)
    if plan is None:
        plan = cls(
            sample_input_values=scores, sample_seq_lens=seq_lens, top_k=top_k, next_n=1,
            return_val=True, deterministic=deterministic,
        )  # fmt: skip
        if not plan.check_support():  # raises with cuDNN's reason otherwise
            raise RuntimeError(f"cuDNN's IndexerTopK does not support {key[1:]}.")
        plan.compile()
        _TOPK_PLANS.put(key, plan)
    return plan
