"""``bench --megatron``: Megatron Core's own indexer top-k on each ``dsa_kernel_backend`` beside
the package's FP8 top-k, at the same ``S`` and ``H`` and on the same projections.

Megatron's rows call megatron-core 0.19.2 as its ``DSAttention.forward`` does, on its BF16
operands (``[S, B, H, D]`` queries, ``[S, B, D]`` keys, ``[S, B, H]`` head weights, from Megatron's
BF16 preprocessing as the package reproduces it bit for bit), causal:

- ``none``: its PyTorch path, ``dsa.fused_qk_topk_naive`` (``S x B x H x S`` float32 scores;
  skipped when four of those would not fit in 80 % of the free device memory);
- ``cudnn``: its cuDNN BF16 indexer, ``dsa_kernels.run_fused_qk_topk`` with
  ``dsa_kernel_backend="cudnn"`` (the indexer half of its fused path; FlashMLA, the other half,
  is not timed here and not needed);
- ``tilelang``: its TileLang lightning indexer through the same hook with
  ``dsa_kernel_backend="tilelang"`` (needs tilelang; megatron-core's own check says what is
  missing).

Each row also gives the members it shares with the package's BF16 selection of the same
operands (a check that it selected what it should, before its time is read). A row whose library
is absent, or whose hook declines the layout (Megatron would fall back to its PyTorch path), is
kept with the reason instead of a time. The package's rows: ``indexer_select`` on the FP8
operands (cuDNN, and DeepGEMM where it imports), and end to end from the projections.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch

from .bench_config import _MEGATRON_BACKENDS

__all__ = []

_BLOCK_SIZE = 8192  # DSAttention.forward's fused_indexer_block_size default
# S x B x H x S float32 tensors budgeted for Megatron's PyTorch indexer (scores, ReLU, weighted,
# and one of slack: not measured)
_NAIVE_COPIES = 4


def _unavailable(backend: str, device: str) -> str | None:
    """Why Megatron's ``backend`` indexer cannot run here (``None``: it can)."""
    if backend == "none":
        return None
    if device != "cuda":
        return f"dsa_kernel_backend={backend!r} needs a CUDA device"
    from megatron.core import utils

    if backend == "tilelang":
        missing = utils._missing_tilelang_dsa_kernel_dependencies()
        return f"missing {', '.join(missing)} (megatron-core's check)" if missing else None
    from ..backends import cudnn

    return None if cudnn.dsa_available() else cudnn.dsa_unavailable_reason()


def _naive_too_large(seq: int, batch: int, heads: int, device: str) -> str | None:
    need = _NAIVE_COPIES * seq * batch * heads * seq * 4
    if device != "cuda" or need <= 0.8 * torch.cuda.mem_get_info()[0]:
        return None
    return (
        f"Megatron's PyTorch indexer needs about {_NAIVE_COPIES} x S x B x H x S float32 scores "
        f"({need / 2**30:.0f} GiB), more than 80 % of the free device memory"
    )


def _megatron_topk(backend: str, q, k, w, topk: int, seq: int) -> Callable[[], Any]:
    """Megatron's top-k call for ``backend``: returns its ``[B, S, topk]`` picks, or ``None``
    where its hook declines."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.experimental_attention_variant import (
        dsa,
        dsa_kernels,
        dsa_masking,
    )

    starts, ends = dsa_masking.build_fused_indexer_varlen_bounds(
        sq=seq, skv=seq, device=q.device, mask=None, varlen_starts=None, varlen_ends=None,
        key_positions=None,
    )  # fmt: skip
    if backend == "none":

        def naive() -> Any:
            return dsa.fused_qk_topk_naive(
                q, k, w, topk, varlen_starts=starts, varlen_ends=ends, use_relu=True
            )[1]

        return naive
    # The two fields Megatron's backend hub reads (dsa_kernels._load_backend, use_fused_dsa_kernels).
    hub = types.SimpleNamespace(dsa_kernel_backend=backend, attention_backend=AttnBackend.auto)

    def fused() -> Any:
        out = dsa_kernels.run_fused_qk_topk(
            hub, q, k, w, topk, starts, ends, block_size=_BLOCK_SIZE
        )
        return None if out is None else out[0]

    return fused


def _measure_megatron(
    timer: Callable[[Callable[[], Any]], float], work: Any, topk: int, batch: int, device: str
) -> dict[str, Any]:
    """One ``(S, H)`` case of ``--megatron`` (``work``: the bench's workload of it)."""
    from ..agreement import topk_agreement
    from ..backends import deepgemm
    from ..select import indexer_select

    seq, heads = work.seq, work.heads
    q16, k16 = work.pre16(work.q, work.k, work.freqs)  # Megatron's BF16 preprocessing
    w16 = work.w16
    ops16, ops8 = work.prep(False), work.prep(True)
    # the package's BF16 picks of the same operands
    reference = cast(torch.Tensor, indexer_select(ops16, topk=topk))
    t: dict[str, float] = {"prep_bf16": timer(lambda: work.prep(False))}
    rows: dict[str, dict[str, Any]] = {}
    for backend in _MEGATRON_BACKENDS:
        reason = _unavailable(backend, device)
        if reason is None and backend == "none":
            reason = _naive_too_large(seq, batch, heads, device)
        if reason is not None:
            rows[backend] = {"skipped": reason}
            continue
        call = _megatron_topk(backend, q16, k16, w16, topk, seq)
        picks = call()
        if picks is None:
            rows[backend] = {
                "skipped": "Megatron's hook declined this layout (its forward would fall back "
                "to the PyTorch indexer)"
            }
            continue
        agreement = topk_agreement(picks.to(reference.dtype), reference).as_dict()
        ms = timer(call)
        rows[backend] = {
            "ms": ms,
            "e2e_ms": t["prep_bf16"] + ms,
            "member_agreement": agreement["member_agreement"],
        }
        del picks
    t["select_fp8"] = timer(lambda: indexer_select(ops8, topk=topk, backend="cudnn"))
    t["e2e_fp8"] = timer(lambda: indexer_select(work.prep(True), topk=topk, backend="cudnn"))
    if deepgemm._kernel_entry() is not None and batch == 1:
        t["select_fp8_dg"] = timer(lambda: indexer_select(ops8, topk=topk, backend="deepgemm"))
        t["e2e_fp8_dg"] = timer(
            lambda: indexer_select(work.prep(True), topk=topk, backend="deepgemm")
        )
    fastest = min(t.get("e2e_fp8_dg", t["e2e_fp8"]), t["e2e_fp8"])
    for row in rows.values():
        if "e2e_ms" in row:
            row["vs_fp8"] = row["e2e_ms"] / fastest  # Megatron end to end / the package's FP8
    return {"seq": seq, "heads": heads, "batch": batch, "times_ms": t, "megatron": rows}
