"""vLLM's indexer top-k -> :class:`~dsa_precision.picks.TopkPicks`: PR 49555's per-request
``indexer_topk`` output, NeMo-RL ``[T, L, K]`` payloads, and the 0.33 per-step
``topk_indices_buffer`` (layout and source: docs/capture.md)."""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..picks import TopkPicks
from .pack import as_request_rows, int_at_least, pack_requests

__all__ = ["VllmStep", "decode_vllm_indexer_topk", "from_vllm", "from_vllm_steps"]


def decode_vllm_indexer_topk(payload: str | bytes) -> torch.Tensor:
    """vLLM's (PR 49555) ``indexer_topk``: base64 of ``.npy`` bytes -> ``(n, L, k)`` int32."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError / OSError variants for bad bytes
        raise ValueError(f"vLLM indexer_topk is not base64 .npy bytes ({exc}).") from None
    return as_request_rows("vLLM indexer_topk", array).to(torch.int32)


def from_vllm(
    rows: Mapping[Any, object] | Sequence[object],
    seq_lens: Mapping[Any, int] | Sequence[int],
    **kw: Any,
) -> TopkPicks:
    """Per-request vLLM top-k ``(n, L, k)`` (PR 49555's ``indexer_topk``, decoded with
    :func:`decode_vllm_indexer_topk`, or a NeMo-RL ``[T, L, K]`` payload split per request) ->
    :class:`~dsa_precision.picks.TopkPicks`. ``first_rows`` is the request's ``indexer_topk_prompt_start``; for a
    NeMo-RL payload, ``layer_numbers`` are its ``layer_ids`` + 1. As :func:`pack_requests`."""
    return pack_requests(rows, seq_lens, source="vllm", **kw)


@dataclasses.dataclass(frozen=True)
class VllmStep:
    """One vLLM 0.33 model step as a hook sees it (``sparse_attn_indexer``'s return value).

    Attributes:
        request_ids: the step's scheduled requests, in the batch's order (decodes first).
        query_start_loc: ``(R + 1,)`` cumulative scheduled tokens per request (the attention
            metadata's ``query_start_loc``): request ``i`` owns buffer rows
            ``query_start_loc[i] : query_start_loc[i + 1]``.
        num_computed_tokens: ``(R,)`` position of each request's first scheduled token (its
            computed tokens before this step, prefix-cache hits included).
        buffers: layer number -> ``(>= N, >= k)`` int32 copy of ``topk_indices_buffer`` after that
            layer's indexer (one buffer is shared by every layer and overwritten: copy it in the
            hook, per layer), request-relative positions, ``-1`` fill.
        kept_rows: ``(R,)`` leading rows of each request to keep (speculative decoding: the
            accepted draft tokens + 1; the rows of rejected drafts are dropped). Default: all.
    """

    request_ids: Sequence[object]
    query_start_loc: Sequence[int]
    num_computed_tokens: Sequence[int]
    buffers: Mapping[int, torch.Tensor]
    kept_rows: Sequence[int] | None = None


def from_vllm_steps(
    steps: Sequence[VllmStep],
    seq_lens: Mapping[Any, int],
    *,
    topk: int,
    order: Sequence[object] | None = None,
    **kw: Any,
) -> TopkPicks:
    """Reassemble per-step vLLM buffers into per-request rows, then :func:`pack_requests`.

    Each request's rows are stitched in position order across steps (chunked prefill, decode,
    speculative verification with ``kept_rows``); a gap (a prefix-cache hit computes no rows for
    the cached tokens) or an overlap is an error naming the request and the positions.
    ``topk``: the index top-k (the buffer's first ``topk`` columns are the picks).
    """
    topk = int_at_least("topk", topk, low=1)
    pieces: dict[object, list[tuple[int, torch.Tensor]]] = {}
    layer_set: tuple[int, ...] | None = None
    for s, step in enumerate(steps):
        layers = tuple(sorted(step.buffers))
        if layer_set is None:
            layer_set = layers
        elif layers != layer_set:
            raise ValueError(f"vLLM step {s}: layers {list(layers)}, step 0 had {list(layer_set)}.")
        qsl = [int(v) for v in step.query_start_loc]
        if len(qsl) != len(step.request_ids) + 1 or len(step.num_computed_tokens) != len(
            step.request_ids
        ):
            raise ValueError(
                f"vLLM step {s}: {len(step.request_ids)} requests need query_start_loc of "
                f"{len(step.request_ids) + 1} and num_computed_tokens of {len(step.request_ids)}."
            )
        for n in layers:
            buf = step.buffers[n]
            if not isinstance(buf, torch.Tensor) or buf.ndim != 2:
                raise TypeError(f"vLLM step {s} layer {n}: expected a 2-D buffer copy.")
            if buf.shape[0] < qsl[-1] or buf.shape[1] < topk:
                raise ValueError(
                    f"vLLM step {s} layer {n}: buffer {tuple(buf.shape)} holds fewer than the "
                    f"step's {qsl[-1]} token rows x topk={topk}; copy topk_indices_buffer whole."
                )
        stacked = torch.stack([step.buffers[n][: qsl[-1], :topk] for n in layers], dim=1)
        for i, r in enumerate(step.request_ids):
            rows = stacked[qsl[i] : qsl[i + 1]]
            if step.kept_rows is not None:
                kept = int(step.kept_rows[i])
                if not 0 <= kept <= rows.shape[0]:
                    raise ValueError(
                        f"vLLM step {s} request {r!r}: kept_rows={kept} but {rows.shape[0]} rows "
                        "were scheduled."
                    )
                rows = rows[:kept]
            pieces.setdefault(r, []).append((int(step.num_computed_tokens[i]), rows))
    if layer_set is None:
        raise ValueError("from_vllm_steps: no steps.")
    rows_by_request = {}
    for r, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        expect = 0
        for start, rows in parts:
            if start != expect:
                what = "no rows" if start > expect else "rows twice"
                raise ValueError(
                    f"vllm request {r!r}: positions {min(start, expect)}..{max(start, expect) - 1} "
                    f"have {what} (a step starts at {start}, the rows before end at {expect}); "
                    "a prefix-cache hit computes no rows for cached tokens: capture with prefix "
                    "caching off, or prepend the turn that computed them."
                )
            expect = start + rows.shape[0]
        rows_by_request[r] = torch.cat([p[1] for p in parts])
    kw.setdefault("layer_numbers", list(layer_set))
    return pack_requests(rows_by_request, seq_lens, order=order, topk=topk, source="vllm", **kw)
