"""vLLM's own indexer top-k kernels as oracles, loaded from its compiled ops library.

vLLM's wheel ships ``vllm/_C_stable_libtorch.abi3.so`` built on torch's stable ABI: it loads with
``torch.ops.load_library`` under another torch (2.11 on the test host) and registers, among
others, ``torch.ops._C.top_k_per_row_prefill``, ``top_k_per_row_decode``, ``persistent_topk``
and ``cooperative_topk``. How vLLM 0.33 calls them (``vllm/_custom_ops.py``,
``vllm/model_executor/layers/indexer_topk.py``, ``sparse_attn_indexer.py``): prefill rows go
through ``top_k_per_row_prefill`` on DeepGEMM's compressed logits (row starts 0, row ends
``ke - ks``); decode rows through ``SparseIndexerTopk``: ``cooperative_topk`` up to 64 rows,
then ``persistent_topk`` for top-k 512/1024/2048, else ``top_k_per_row_decode`` (SM90). Each
writes ``(rows, k)`` int32 request-relative key positions, ``-1`` past a short row.

:func:`load` loads the library named by ``DSA_VLLM_OPS`` (or a path); :data:`KERNELS` names a
function per kernel, each taking float32 ``logits (rows, W)`` and int32 ``lengths (rows,)`` and
returning ``(rows, k)`` int32. Nothing of vLLM's is in this repository (docs/gpu-validation.md,
"The engines' top-k").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

__all__ = [
    "COOPERATIVE_MAX_ROWS",
    "KERNELS",
    "OPS_ENV",
    "RADIX_TOPK",
    "WORKSPACE_BYTES",
    "applies",
    "decode_kernel",
    "load",
    "missing_reason",
    "rollout_topk",
    "run",
]

OPS_ENV = "DSA_VLLM_OPS"
# vLLM's RADIX_TOPK_WORKSPACE_SIZE (indexer_topk.py)
WORKSPACE_BYTES = 1024 * 1024
# cooperative_topk's row limit (AUTO_COOPERATIVE_MAX_ROWS) and the persistent / cooperative top-k
COOPERATIVE_MAX_ROWS = 64
RADIX_TOPK = (512, 1024, 2048)


def missing_reason() -> str | None:
    """Why the kernels cannot run here, or ``None``."""
    path = os.environ.get(OPS_ENV)
    if not path:
        return f"{OPS_ENV} names no vLLM ops library (vllm/_C_stable_libtorch.abi3.so)"
    if not os.path.isfile(path):
        return f"{OPS_ENV}={path} is not a file"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@functools.cache
def load(path: str | None = None) -> str:
    """Load vLLM's ops library once (``path``, default ``$DSA_VLLM_OPS``); returns the path."""
    path = path or os.environ.get(OPS_ENV)
    if not path:
        raise RuntimeError(f"set {OPS_ENV} to vLLM's vllm/_C_stable_libtorch.abi3.so")
    torch.ops.load_library(path)
    return path


def _out(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.full((logits.shape[0], k), -1, dtype=torch.int32, device=logits.device)


def _prefill(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    out = _out(logits, k)
    torch.ops._C.top_k_per_row_prefill(
        logits, torch.zeros_like(lengths), lengths, out, logits.shape[0], logits.stride(0),
        logits.stride(1), k,
    )  # fmt: skip
    return out


def _decode(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    out = _out(logits, k)
    seq_lens = lengths.view(-1, 1).contiguous()  # (B, next_n = 1)
    torch.ops._C.top_k_per_row_decode(
        logits, 1, seq_lens, out, logits.shape[0], logits.stride(0), logits.stride(1), k
    )
    return out


def _radix(name: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    def call(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
        out = _out(logits, k)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=logits.device)
        seq_lens = lengths.view(-1, 1).contiguous()
        max_len = int(lengths.max()) if lengths.numel() else 0
        getattr(torch.ops._C, name)(logits, seq_lens, out, workspace, k, max_len)
        return out

    return call


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "prefill": _prefill,
    "decode": _decode,
    "persistent": _radix("persistent_topk"),
    "cooperative": _radix("cooperative_topk"),
}


def applies(kernel: str, rows: int, k: int) -> str | None:
    """Why vLLM would not run ``kernel`` on ``rows`` rows of top-``k`` (``None``: it would)."""
    if kernel in ("persistent", "cooperative") and k not in RADIX_TOPK:
        return f"top-k {k} (it takes {RADIX_TOPK})"
    if kernel == "cooperative" and rows > COOPERATIVE_MAX_ROWS:
        return f"{rows} rows (at most {COOPERATIVE_MAX_ROWS})"
    return None


def run(kernel: str, logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``kernel``'s top-``k`` of float32 ``logits`` ``(rows, W)`` (contiguous rows) over each
    row's first ``lengths`` keys (int32): ``(rows, k)`` int32, ``-1`` padding."""
    load()
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("vLLM's top-k kernels read float32 logits with unit column stride.")
    return KERNELS[kernel](logits, lengths.to(torch.int32).contiguous(), k)


def decode_kernel(rows: int, k: int) -> str:
    """The kernel vLLM 0.33's ``SparseIndexerTopk`` picks on SM90 for ``rows`` decode rows
    (``_resolve_auto``): ``cooperative`` up to 64 rows, else ``persistent``, for top-k
    512/1024/2048; ``decode`` (per row) otherwise."""
    if k in RADIX_TOPK and rows <= COOPERATIVE_MAX_ROWS:
        return "cooperative"
    return "persistent" if k in RADIX_TOPK else "decode"


def rollout_topk(logits: list[torch.Tensor], k: int, prompt: int) -> list[torch.Tensor]:
    """The picks vLLM's kernels make for a batch of sequences generated together: per sequence
    ``logits`` ``(S, S)`` float32 (row ``t`` scores keys ``0 .. t``), rows ``< prompt`` through
    the prefill kernel (one call per sequence, as one request's prefill), rows from ``prompt``
    on as decode steps (one call per position over every sequence's row there, the kernel
    :func:`decode_kernel` names). Returns per sequence ``(S, k)`` int32, ``-1`` padding."""
    s = logits[0].shape[0]
    device = logits[0].device
    lengths = torch.arange(1, s + 1, dtype=torch.int32, device=device)
    out = [torch.full((s, k), -1, dtype=torch.int32, device=device) for _ in logits]
    for seq, picks in zip(logits, out, strict=True):
        if prompt:
            picks[:prompt] = run("prefill", seq[:prompt].contiguous(), lengths[:prompt], k)
    kernel = decode_kernel(len(logits), k)
    for t in range(prompt, s):
        rows = torch.stack([seq[t] for seq in logits])
        step = run(kernel, rows, lengths[t].repeat(len(logits)), k)
        for b, picks in enumerate(out):
            picks[t] = step[b]
    return out
