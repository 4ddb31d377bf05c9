"""vLLM's indexer top-k -> :class:`~dsa_precision.picks.TopkPicks`: PR 49555's per-request
``indexer_topk`` output, NeMo-RL ``[T, L, K]`` payloads, and the 0.33 per-step
``topk_indices_buffer`` (layout and source: docs/capture.md)."""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..picks import TopkPicks, check_key_range
from .pack import as_request_rows, decode_base64, int_at_least, integer_array, pack_requests

__all__ = ["VllmStep", "decode_vllm_indexer_topk", "from_vllm", "from_vllm_steps"]


def decode_vllm_indexer_topk(
    payload: str | bytes, *, name: str = "vLLM indexer_topk"
) -> torch.Tensor:
    """vLLM's (PR 49555) ``indexer_topk``: base64 of ``.npy`` bytes -> ``(n, L, k)`` int32.

    The ``.npy`` is read without pickles, in its own byte order; its keys are checked to fit
    int32 before the cast. ``name`` names the payload in errors (the response)."""
    data = decode_base64(name, payload)
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError / OSError / EOFError for bad bytes
        raise ValueError(f"{name}: not .npy bytes ({' '.join(str(exc).split())[:160]}).") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: a .npz archive, not one .npy array.")
    rows = as_request_rows(name, array)
    check_key_range(name, rows, describe_row=lambda j: f"token {j}")
    return rows.to(torch.int32)


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
    if isinstance(steps, VllmStep) or not isinstance(steps, Sequence):
        raise TypeError(
            f"from_vllm_steps takes a sequence of VllmStep, got {type(steps).__name__}; wrap one "
            "step in a list."
        )
    pieces: dict[object, list[tuple[int, int, torch.Tensor]]] = {}
    layer_set: tuple[int, ...] | None = None
    for s, step in enumerate(steps):
        where = f"vLLM step {s}"
        if not isinstance(step, VllmStep):
            raise TypeError(f"{where}: expected a VllmStep, got {type(step).__name__}.")
        if not isinstance(step.buffers, Mapping) or not step.buffers:
            raise TypeError(f"{where}: buffers must map layer numbers to buffer copies.")
        layers = tuple(sorted(step.buffers))
        if layer_set is None:
            layer_set = layers
        elif layers != layer_set:
            raise ValueError(f"{where}: layers {list(layers)}, step 0 had {list(layer_set)}.")
        ids = list(step.request_ids)
        repeated = sorted({repr(r) for r in ids if ids.count(r) > 1})
        if repeated:
            raise ValueError(
                f"{where}: request id(s) {', '.join(repeated)} scheduled twice in one step; a "
                "step schedules each request once (request_ids must be the batch's requests)."
            )
        qsl = [int_at_least(f"{where} query_start_loc[{i}]", v, low=0)
               for i, v in enumerate(step.query_start_loc)]  # fmt: skip
        computed = [int_at_least(f"{where} num_computed_tokens[{i}]", v, low=0)
                    for i, v in enumerate(step.num_computed_tokens)]  # fmt: skip
        if len(qsl) != len(ids) + 1 or len(computed) != len(ids):
            raise ValueError(
                f"{where}: {len(ids)} requests need query_start_loc of {len(ids) + 1} and "
                f"num_computed_tokens of {len(ids)}; got {len(qsl)} and {len(computed)}."
            )
        if qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)):
            raise ValueError(
                f"{where}: query_start_loc {qsl[:8]}{'...' if len(qsl) > 8 else ''} must start at "
                "0 and never decrease (cumulative scheduled tokens per request)."
            )
        kept: list[int] | None = None
        if step.kept_rows is not None:
            kept = [int_at_least(f"{where} kept_rows[{i}]", v, low=0)
                    for i, v in enumerate(step.kept_rows)]  # fmt: skip
            if len(kept) != len(ids):
                raise ValueError(
                    f"{where}: kept_rows has {len(kept)} entries for {len(ids)} requests."
                )
        buffers = {}
        for n in layers:
            buf = integer_array(f"{where} layer {n} buffer", step.buffers[n], shape="(N, topk)")
            if buf.ndim != 2:
                raise TypeError(
                    f"{where} layer {n}: expected a 2-D buffer copy, got {tuple(buf.shape)}."
                )
            if buf.shape[0] < qsl[-1] or buf.shape[1] < topk:
                raise ValueError(
                    f"{where} layer {n}: buffer {tuple(buf.shape)} holds fewer than the "
                    f"step's {qsl[-1]} token rows x topk={topk}; copy topk_indices_buffer whole."
                )
            buffers[n] = buf[: qsl[-1], :topk]
        if (
            len({b.device for b in buffers.values()}) > 1
            or len({b.dtype for b in buffers.values()}) > 1
        ):
            raise ValueError(
                f"{where}: the layers' buffers differ in device or dtype; copy them alike."
            )
        stacked = torch.stack([buffers[n] for n in layers], dim=1)
        for i, r in enumerate(ids):
            rows = stacked[qsl[i] : qsl[i + 1]]
            if kept is not None:
                if kept[i] > rows.shape[0]:
                    raise ValueError(
                        f"{where} request {r!r}: kept_rows={kept[i]} but {rows.shape[0]} rows "
                        "were scheduled."
                    )
                rows = rows[: kept[i]]
            pieces.setdefault(r, []).append((computed[i], s, rows))
    if layer_set is None:
        raise ValueError("from_vllm_steps: no steps.")
    rows_by_request = {}
    for r, parts in pieces.items():
        parts.sort(key=lambda p: (p[0], p[1]))
        expect, last_step = 0, None
        for start, s, rows in parts:
            if start > expect:
                raise ValueError(
                    f"vllm request {r!r}: positions {expect}..{start - 1} have no rows (step {s} "
                    f"starts at {start}, the rows before end at {expect}); a prefix-cache hit "
                    "computes no rows for cached tokens: capture with prefix caching off, or "
                    "prepend the turn that computed them."
                )
            if start < expect:
                raise ValueError(
                    f"vllm request {r!r}: positions {start}..{min(expect, start + rows.shape[0]) - 1}"
                    f" have rows twice (steps {last_step} and {s}); a request's tokens are "
                    "computed once: check num_computed_tokens (and kept_rows after speculation)."
                )
            expect, last_step = start + rows.shape[0], s
        rows_by_request[r] = torch.cat([p[2] for p in parts])
    kw.setdefault("layer_numbers", list(layer_set))
    return pack_requests(rows_by_request, seq_lens, order=order, topk=topk, source="vllm", **kw)
