"""SGLang 0.5.23's own indexer top-k kernels as oracles (not yet run on a GPU).

What SGLang 0.5.23 runs on Hopper (``srt/layers/attention/dsa/dsa_topk_backend.py``,
``DSATopKBackend.topk_transform``, with its defaults: ``--dsa-topk-backend sgl-kernel``,
``SGLANG_DSA_FUSE_TOPK=1``, ``SGLANG_OPT_USE_TOPK_V2=1``):

- **decode** (``TopkTransformMethod.PAGED``, no ``row_starts``): the DeepSeek-V4 "top-k v2" JIT
  CUDA kernel, ``sglang/kernels/ops/attention/dsv4/topk.py`` ``topk_transform_paged_v2(scores,
  seq_lens, page_table, out, page_size, plan)`` (``csrc/deepseek_v4/topk_v2.cuh``
  ``TopKKernel::transform_paged``) with the per-forward ``plan_topk_v2(seq_lens)``. Row ``b``
  selects among ``scores[b, :seq_lens[b]]``; the oracle passes no page table, which makes the
  kernel write the raw selected positions (``TopKMode::INDICES``: the same selection, only the
  output transform compiled out).
- **prefill, ragged** (``TopkTransformMethod.RAGGED``: an FP8 KV cache with a
  ``flashmla_sparse`` / ``flashmla_sparse_q8`` / ``triton_sparse_mla`` prefill): the same v2 kernel
  through ``topk_transform_ragged_v2(scores, seq_lens, out_offsets=, out_indices=, row_starts=)``
  (``TopKKernel::transform_ragged``): row ``i`` selects among ``scores[i, ks : ks + seq_lens[i]]``
  and writes ``position + out_offsets[i]``. The oracle passes ``ks = 0`` and offsets ``0`` (one
  request: DeepGEMM's logits start at the request's first key). It writes the <= 3 columns ahead
  of an unaligned window into ``scores``: the oracle gives it a copy.
- **prefill, paged** (the other prefill configurations, among them ``flashmla_kv`` with an FP8 KV
  cache, Hopper's automatic choice): sgl-kernel 0.4.10's compiled ``fast_topk_transform_fused``
  (``torch.ops.sgl_kernel.fast_topk_transform_fused(score, lengths, dst_page_table,
  src_page_table, cu_seqlens_q, row_starts)``, top-k 2048 only). SGLang does not build it through
  its JIT (the JIT's ``legacy_radix_topk.cuh`` serves only ``topk_v1``, top-k <= 1024, DeepSeek-V4).
  The wheel's ``sgl_kernel/sm90/common_ops.abi3.so`` is abi3 for Python only: it links libtorch's
  C++ symbols (``at::``, ``c10::``; none of torch's stable ABI) of torch 2.14.1 (the wheel's pin)
  and CUDA 13, so :func:`missing_reason` refuses it under any other torch minor release.

How ties are broken, as far as the code reads: v2 finds the threshold bin with a coarse fp16
histogram, collects its candidates, then ranks them by ``(value desc, index asc)`` when there
are at most 128 (the lower key wins an exact tie) and by a 4-round exact radix select with
``atomicAdd`` write positions when there are more (an exact tie is taken in atomic order); long
rows of small batches take cluster kernels (``SUPPORT_CLUSTER`` on SM90) whose merge the oracle
measures rather than reads. sgl-kernel's ``fast_topk_transform_fused`` is a radix select with
atomics as well (its source is not in the wheel).

The v2 kernel is loaded like the fused indexer's (:mod:`.engine_kernels`): SGLang's wrapper
``dsv4/topk.py`` (with ``dsv4/candidate_table.py`` and ``dsv4/utils.py`` it imports) and its JIT
utilities (``utils/occupancy.py``, whose cluster probe sizes the persistent cluster path, among
them) run unmodified from :data:`~.loader.ENV_VAR`, compiled by SGLang's own build code less
its cache (:class:`~.sglang_jit.SglangJit`) and loaded by apache-tvm-ffi.

:func:`run` has :func:`.vllm_topk.run`'s contract: float32 ``logits (rows, W)``, int32
``lengths (rows,)``, returns ``(rows, k)`` int32 request-relative keys, ``-1`` padding.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from pathlib import Path

import torch

from .loader import ENV_VAR, load_module, roots, scoped_modules, sha256
from .sglang_jit import (
    SGLANG_COMMON_HEADERS,
    SGLANG_JIT,
    SGLANG_JIT_PY,
    SGLANG_KERNELS,
    SglangJit,
    sglang_stubs,
    sglang_toolchain_reason,
)

__all__ = [
    "FILES",
    "KERNELS",
    "LEGACY_TOPK",
    "OPS_ENV",
    "OPS_TORCH",
    "applies",
    "build",
    "kernel_files",
    "missing_reason",
    "run",
]

_DSV4 = f"{SGLANG_KERNELS}/ops/attention/dsv4"
# The v2 top-k's files, relative to a root of DSA_ENGINE_KERNELS (the first is the entry module):
# the wrapper and the two modules it imports, SGLang's JIT utilities (the occupancy probe's module
# is imported by _jit_topk_v2_module when it runs), the two CUDA sources and the headers they
# include from the wheel's jit/include/sgl_kernel.
FILES: tuple[str, ...] = (
    f"{_DSV4}/topk.py",
    f"{_DSV4}/candidate_table.py",
    f"{_DSV4}/utils.py",
    *(f"{SGLANG_JIT}/utils/{name}.py" for name in SGLANG_JIT_PY),
    f"{SGLANG_JIT}/utils/occupancy.py",
    f"{SGLANG_JIT}/csrc/deepseek_v4/topk_v2.cuh",
    f"{SGLANG_JIT}/csrc/occupancy/cluster_probe.cuh",
    *(
        f"{SGLANG_JIT}/include/sgl_kernel/{name}"
        for name in sorted((*SGLANG_COMMON_HEADERS, "runtime.cuh", "deepseek_v4/topk_impl.cuh"))
    ),
)
# sgl-kernel 0.4.10's compiled ops library (sgl_kernel/sm90/common_ops.abi3.so), and the torch
# release it was built against (sglang-kernel 0.4.10 pins torch==2.14.1).
OPS_ENV = "DSA_SGL_KERNEL_OPS"
OPS_TORCH = "2.14"
# fast_topk_transform_fused's only top-k (sgl_kernel/top_k.py asserts it).
LEGACY_TOPK = 2048
# The v2 kernel's top-k range (TopKConfig::kMaxTopK) and its score-stride alignment (floats).
_V2_MAX_TOPK = 2048
_ALIGN = 4


def kernel_files(root: str | os.PathLike | None = None) -> tuple[Path, ...] | None:
    """The v2 top-k's files under the first root holding all of them, or ``None``."""
    for r in roots(root):
        paths = tuple(r / f for f in FILES)
        if all(p.is_file() for p in paths):
            return paths
    return None


def missing_reason(kernel: str = "decode", root: str | os.PathLike | None = None) -> str | None:
    """Why ``kernel`` cannot run here, or ``None``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; use one of {sorted(KERNELS)}")
    if kernel == "prefill-paged":
        path = os.environ.get(OPS_ENV)
        if not path:
            return f"{OPS_ENV} names no sgl-kernel ops library (sgl_kernel/sm90/common_ops.abi3.so)"
        if not os.path.isfile(path):
            return f"{OPS_ENV}={path} is not a file"
        if not torch.__version__.startswith(OPS_TORCH + "."):
            return (
                f"sgl-kernel 0.4.10's ops library links torch {OPS_TORCH}'s C++ symbols (no stable "
                f"ABI); this is torch {torch.__version__}"
            )
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None
    if kernel_files(root) is None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_VAR)
        if not where:
            return f"{ENV_VAR} is not set (docs/gpu-validation.md: the engines' top-k)"
        return (
            f"{where} holds no SGLang 0.5.23 top-k v2 files ({FILES[0]} and {len(FILES) - 1} more)"
        )
    return sglang_toolchain_reason()


@functools.cache
def _load(files: tuple[Path, ...]) -> types.SimpleNamespace:
    """SGLang's ``dsv4/topk.py`` and the JIT utilities it reaches, loaded unmodified with the
    stand-ins of :func:`~.sglang_jit.sglang_stubs` (plus ``sglang.srt.utils.is_xpu``: no)."""
    root = files[0].parents[5]  # the folder holding sglang/
    stubs = sglang_stubs(root)
    stubs["sglang.srt.utils"].__dict__["is_xpu"] = lambda: False
    jit = SglangJit.load(lambda rel: root / rel, stubs, " ".join(sha256(p) for p in files))
    modules = jit.m
    # What sglang/kernels/jit/utils/__init__.py and compile/__init__.py export to these files
    # beyond what SglangJit.load exports.
    stubs["sglang.kernels.jit.utils"].__dict__["is_hip_runtime"] = modules["common"].is_hip_runtime
    stubs["sglang.kernels.jit.utils.compile"].__dict__["load_jit"] = jit.load_jit
    occupancy = "sglang.kernels.jit.utils.occupancy"
    stubs[occupancy] = load_module(root / SGLANG_JIT / "utils/occupancy.py", occupancy, stubs)
    stubs["sglang.kernels.jit.utils"].__dict__["occupancy"] = stubs[occupancy]
    name = "sglang.kernels.ops.attention.dsv4.topk"
    topk = load_module(root / f"{_DSV4}/topk.py", name, stubs)
    return types.SimpleNamespace(topk=topk, jit=jit, arch=modules["arch"], stubs=stubs)


def _module(root: str | os.PathLike | None = None) -> types.SimpleNamespace:
    files = kernel_files(root)
    if files is None:
        raise RuntimeError(f"SGLang's top-k cannot run: {missing_reason('decode', root)}.")
    return _load(files)


def build(capability: tuple[int, int] | None = None, root: str | os.PathLike | None = None):
    """Build (or find) SGLang's v2 top-k module through SGLang's own JIT code without running a
    top-k; the shared libraries. ``capability``: compile for that SM (``(9, 0)``: ``sm_90a``)
    instead of the local GPU's. Building for an SM with programmatic dependent launch (9.0 and
    up) runs SGLang's cluster-occupancy probe, which needs that GPU."""
    ns = _module(root)
    with scoped_modules(ns.stubs):  # the wrapper imports the occupancy probe when it builds
        return ns.jit.build(ns.arch, capability, ns.topk._jit_topk_v2_module)


def _aligned(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with a row stride that is a multiple of 4 floats (v2 loads 16 bytes at a time;
    DeepGEMM's logits have one): itself, or a copy padded with ``-inf`` past the last column."""
    if logits.stride(0) % _ALIGN == 0:
        return logits
    rows, width = logits.shape
    padded = logits.new_full((rows, -(-width // _ALIGN) * _ALIGN), float("-inf"))
    padded[:, :width] = logits
    return padded[:, :width]


def _decode(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    ns = _module()
    out = logits.new_empty((logits.shape[0], k), dtype=torch.int32)
    with scoped_modules(ns.stubs):
        plan = ns.topk.plan_topk_v2(lengths)  # DSAMetadata.topk_v2_plan, once per forward
        ns.topk.topk_transform_paged_v2(_aligned(logits), lengths, None, out, 1, plan)
    return out


def _prefill(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    ns = _module()
    out = logits.new_empty((logits.shape[0], k), dtype=torch.int32)
    zeros = torch.zeros_like(lengths)
    scores = _aligned(logits.clone())  # the kernel masks columns ahead of a window in place
    with scoped_modules(ns.stubs):
        ns.topk.topk_transform_ragged_v2(
            scores, lengths, out_offsets=zeros, out_indices=out, row_starts=zeros
        )
    return out


@functools.cache
def _load_ops(path: str) -> str:
    torch.ops.load_library(path)
    return path


def _prefill_paged(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``fast_topk_transform_fused`` as SGLang's PAGED extend calls it for one request: its
    page-size-1 table row is the identity (the output is the key), ``cu_seqlens_q = [0, rows]``,
    ``row_starts`` the request's first key (0)."""
    path = os.environ.get(OPS_ENV)
    if not path:
        raise RuntimeError(f"set {OPS_ENV} to sgl-kernel's sgl_kernel/sm90/common_ops.abi3.so")
    _load_ops(path)
    rows, width = logits.shape
    dst = logits.new_empty((rows, k), dtype=torch.int32)
    device = logits.device
    src = torch.arange(width, dtype=torch.int32, device=device).view(1, width)
    cu_seqlens_q = torch.tensor([0, rows], dtype=torch.int32, device=device)
    torch.ops.sgl_kernel.fast_topk_transform_fused(
        logits, lengths, dst, src, cu_seqlens_q, torch.zeros_like(lengths)
    )
    return dst


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "decode": _decode,
    "prefill": _prefill,
    "prefill-paged": _prefill_paged,
}


def applies(kernel: str, rows: int, k: int) -> str | None:
    """Why SGLang would not run ``kernel`` on ``rows`` rows of top-``k`` (``None``: it would)."""
    if kernel == "prefill-paged" and k != LEGACY_TOPK:
        return f"top-k {k} (it takes {LEGACY_TOPK} only)"
    if kernel in ("decode", "prefill") and not 0 < k <= _V2_MAX_TOPK:
        return f"top-k {k} (it takes 1..{_V2_MAX_TOPK})"
    return None


def run(kernel: str, logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``kernel``'s top-``k`` of float32 ``logits`` ``(rows, W)`` over each row's first
    ``lengths`` keys (int32, non-negative): ``(rows, k)`` int32, ``-1`` padding."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("SGLang's top-k kernels read float32 logits with unit column stride.")
    return KERNELS[kernel](logits, lengths.to(torch.int32).contiguous(), k)
