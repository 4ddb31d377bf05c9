"""LMDeploy 0.18.0's own indexer top-k kernels as oracles (not yet run on a GPU).

LMDeploy's DSA indexer on CUDA (``lmdeploy/pytorch/backends/cuda/nsa.py``,
``TritonNSAIndexFP8Impl._select_topk``; GLM-5 and DeepSeek-V3.2 build it with ``fill=-1``)
selects from DeepGEMM's float32 logits, prefill (``fp8_fp4_mqa_logits`` with ``max_seqlen_k``:
column ``j`` is the request's key ``j``) and decode (``fp8_fp4_paged_mqa_logits``: column ``j``
is position ``j``) alike, with one of two kernels:

- ``tilelang``: ``lmdeploy/pytorch/kernels/cuda/sparse_index_topk.py`` ``sparse_index_topk(
  scores, q_seqlens, kv_seqlens, k, fill=-1, descending=True, sorted=False)``, a TileLang byte-
  radix select, for top-k 512 and 2048 (``is_sparse_index_topk_supported``) whenever TileLang
  imports (LMDeploy pins tilelang 0.1.11). Row ``i`` reads ``scores[i, :min(kv_seqlens[i], W)]``;
  a row of at most ``k`` keys returns ``0 .. len-1``. The keys above the threshold and then those
  equal to it are written at ``atomic_add`` positions: which tied keys fill the last slots is
  the order the threads reach the counter ("Tie order is intentionally unspecified").
- ``bitonic``: ``bitonic_topk.py`` ``bitonic_topk(scores, q_seqlens, kv_seqlens, k, fill=-1,
  descending=True)`` (Triton, sorted output), for any other top-k or without TileLang: blocks of
  ``k`` keys bitonic-sorted, then merged; a fixed sorting network, so its choice among tied keys
  is deterministic but not the lower key. It also writes ``fill`` for a selected key whose score
  is ``<= -1e6`` (its ``threshold``).

Both files run unmodified from :data:`~.loader.ENV_VAR`; the only stand-in is
``lmdeploy.pytorch.kernels.cuda.utils.get_device_props`` (``bitonic_topk`` sizes its persistent
grid with the SM count: the result does not depend on it). Triton's interpreter runs
``bitonic`` on the CPU (tests/interpreter); ``tilelang`` needs a GPU and TileLang.

:func:`run` has :func:`.vllm_topk.run`'s contract: float32 ``logits (rows, W)``, int32
``lengths (rows,)``, returns ``(rows, k)`` int32 request-relative keys, ``-1`` padding.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types
from collections.abc import Callable
from pathlib import Path

import torch

from .loader import ENV_VAR, load_module, package, roots, scoped_modules, sha256

__all__ = [
    "FILES",
    "FILL",
    "KERNELS",
    "KNOWN_SHA256",
    "TILELANG_TOPK",
    "applies",
    "kernel_files",
    "lmdeploy_kernel",
    "missing_reason",
    "run",
    "source",
]

_CUDA = "lmdeploy/pytorch/kernels/cuda"
FILES: dict[str, str] = {
    "tilelang": f"{_CUDA}/sparse_index_topk.py",
    "bitonic": f"{_CUDA}/bitonic_topk.py",
}
# SHA-256 of the files as the wheel lmdeploy-0.18.0-cp312-cp312-manylinux_2_28_x86_64 ships them.
KNOWN_SHA256: dict[str, str] = {
    "tilelang": "fb7d68d211778b6294c2788363aad6cb12540d7408893ee74150e9ed6454b733",
    "bitonic": "f8d8ef98b0282d63cf023aa804f8a90ec73c1ce3f058b10abf81e9f883533b31",
}
# TritonNSAIndexFP8Impl's fill (the models pass -1) and the TileLang kernel's top-k values.
FILL = -1
TILELANG_TOPK = (512, 2048)


def kernel_files(kernel: str, root: str | os.PathLike | None = None) -> Path | None:
    """``kernel``'s file under the first root holding it, or ``None``."""
    for r in roots(root):
        path = r / FILES[kernel]
        if path.is_file():
            return path
    return None


def missing_reason(kernel: str = "tilelang", root: str | os.PathLike | None = None) -> str | None:
    """Why ``kernel`` cannot run here, or ``None``. ``bitonic`` runs on the CPU under Triton's
    interpreter; ``tilelang`` needs TileLang and a CUDA device."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; use one of {sorted(KERNELS)}")
    if kernel_files(kernel, root) is None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_VAR)
        if not where:
            return f"{ENV_VAR} is not set (docs/gpu-validation.md: the engines' top-k)"
        return f"{where} holds no {FILES[kernel]}"
    if kernel == "tilelang":
        if importlib.util.find_spec("tilelang") is None:
            return "TileLang is not installed (LMDeploy 0.18 pins tilelang 0.1.11)"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (and not under Triton's interpreter, TRITON_INTERPRET=1)"
    return None


def _device_props(device: int | None = None) -> dict[str, int]:
    """``get_device_props`` as ``bitonic_topk`` reads it: the SM count (on the CPU, any)."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else device
        return {
            "multi_processor_count": torch.cuda.get_device_properties(index).multi_processor_count
        }
    return {"multi_processor_count": 4}


def _stubs(cuda_dir: Path) -> dict[str, types.ModuleType]:
    pkg = "lmdeploy.pytorch.kernels.cuda"
    return {
        "lmdeploy": package("lmdeploy"),
        "lmdeploy.pytorch": package("lmdeploy.pytorch"),
        "lmdeploy.pytorch.kernels": package("lmdeploy.pytorch.kernels"),
        pkg: package(pkg, cuda_dir),
        f"{pkg}.utils": package(f"{pkg}.utils", get_device_props=_device_props),
    }


@functools.cache
def _load(path: Path, kernel: str) -> tuple[types.ModuleType, dict[str, types.ModuleType]]:
    stubs = _stubs(path.parent)
    name = f"lmdeploy.pytorch.kernels.cuda.{path.stem}"
    return load_module(path, name, stubs), stubs


def source(kernel: str, root: str | os.PathLike | None = None) -> str:
    """The release ``kernel``'s file is (by its SHA-256) and the hash's first 12 digits."""
    path = kernel_files(kernel, root)
    if path is None:
        raise RuntimeError(f"LMDeploy's {kernel} top-k cannot run: {missing_reason(kernel, root)}.")
    digest = sha256(path)
    release = "lmdeploy 0.18.0" if digest == KNOWN_SHA256[kernel] else "unknown release"
    return f"{release} (sha256 {digest[:12]})"


def _call(kernel: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    entry = {"tilelang": "sparse_index_topk", "bitonic": "bitonic_topk"}[kernel]

    def call(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
        path = kernel_files(kernel)
        if path is None:
            raise RuntimeError(f"LMDeploy's {kernel} top-k cannot run: {missing_reason(kernel)}.")
        module, stubs = _load(path, kernel)
        q_seqlens = torch.ones_like(lengths)  # unused: one kv length per score row
        kwargs = {"sorted": False} if kernel == "tilelang" else {}
        with scoped_modules(stubs):  # bitonic_topk imports get_device_props when it runs
            return getattr(module, entry)(
                logits, q_seqlens, lengths, k, fill=FILL, descending=True, **kwargs
            )

    return call


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "tilelang": _call("tilelang"),
    "bitonic": _call("bitonic"),
}


def lmdeploy_kernel(k: int) -> str:
    """The kernel LMDeploy 0.18 selects with for top-``k`` when TileLang imports
    (``_get_sparse_index_topk``): ``tilelang`` for 512 and 2048, else ``bitonic``."""
    return "tilelang" if k in TILELANG_TOPK else "bitonic"


def applies(kernel: str, rows: int, k: int) -> str | None:
    """Why LMDeploy would not run ``kernel`` on ``rows`` rows of top-``k`` (``None``: it would)."""
    if kernel == "tilelang" and k not in TILELANG_TOPK:
        return f"top-k {k} (it takes {TILELANG_TOPK})"
    if kernel == "bitonic" and k & (k - 1):
        return f"top-k {k} (tl.arange needs a power of two)"
    return None


def run(kernel: str, logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``kernel``'s top-``k`` of float32 ``logits`` ``(rows, W)`` over each row's first
    ``lengths`` keys (int32): ``(rows, k)`` int32, ``-1`` padding."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("LMDeploy's top-k kernels read float32 logits with unit column stride.")
    return KERNELS[kernel](logits, lengths.to(torch.int32).contiguous(), k)
