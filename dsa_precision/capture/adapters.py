"""The inference engines' top-k outputs -> the replay input of one packed micro-batch.

Every adapter ends in :func:`pack_requests`: per request, the engine's rows ``(n, L, k)``
(``n`` token rows from position ``first``, ``L`` layers, ``k`` slots, sequence-relative key
positions, ``-1`` padding) become ``{layer_number: (T, k) int32}`` plus ``cu_seqlens`` in the
order of the training micro-batch, with the checks of the replay path
(:meth:`TokenLayout.validate_indices`) and these: every request of the micro-batch accounted
for, each request's rows covering its training sequence, index-shared layers equal to their
source, and errors that name the request, the layer and the row. The layouts and their sources
are in docs/capture.md.

Needs neither megatron-core nor an engine; pure torch (numpy for the engines' wire formats).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from ..topk_layout import TokenLayout

__all__ = [
    "ReplayInput",
    "VllmStep",
    "decode_sglang_indexer_topk",
    "decode_vllm_indexer_topk",
    "from_sglang",
    "from_vllm",
    "from_vllm_steps",
    "pack_digests",
    "pack_requests",
]

LastRow = Literal["empty", "self"]
_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class ReplayInput:
    """One packed micro-batch's engine picks, ready for
    ``engine_topk(r.indices, cu_seqlens=r.cu_seqlens)``.

    Attributes:
        indices: layer number (1-based, Megatron's) -> ``(T, k)`` int32 sequence-relative key
            positions, ``-1`` padding.
        cu_seqlens: ``(n + 1,)`` int64 cumulative lengths of the ``n`` requests, in the order
            given (the micro-batch's packing order).
        request_ids: the ``n`` requests, in that order.
        engine_rows: ``(T,)`` bool: ``True`` where the row is the engine's (``False``: a row the
            engine never computed, i.e. a sequence's last token, filled as ``last_row`` says).
    """

    indices: dict[int, torch.Tensor]
    cu_seqlens: torch.Tensor
    request_ids: tuple[object, ...]
    engine_rows: torch.Tensor

    def describe_row(self, row: int) -> str:
        """``"request <id> token <position>"`` of a packed row."""
        cu = self.cu_seqlens.tolist()
        seq = next(i for i in range(len(cu) - 1) if cu[i] <= row < cu[i + 1])
        return f"request {self.request_ids[seq]!r} token {row - cu[seq]}"


def _as_rows(name: str, value: object) -> torch.Tensor:
    """An engine's per-request rows as a CPU/any-device ``(n, L, k)`` integer tensor."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a (n, L, k) integer array, got {type(value).__name__}.")
    if value.dtype not in _INT_DTYPES or value.ndim != 3:
        raise TypeError(
            f"{name}: expected a (n, L, k) int16/int32/int64 array (token rows, layers, top-k "
            f"slots), got {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}."
        )
    if value.shape[1] == 0 or value.shape[2] == 0:
        raise ValueError(f"{name}: {tuple(value.shape)} holds no layer or no top-k slot.")
    return value


def _int(name: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}.")
    return int(value)


def pack_requests(
    rows: Mapping[object, object] | Sequence[object],
    seq_lens: Mapping[object, int] | Sequence[int],
    *,
    order: Sequence[object] | None = None,
    first_rows: Mapping[object, int] | Sequence[int] | None = None,
    layer_numbers: Sequence[int] | None = None,
    shared: Mapping[int, int] | None = None,
    last_row: LastRow = "empty",
    future_keys: Literal["error", "drop"] = "error",
    topk: int | None = None,
    source: str = "engine",
    validate: bool = True,
) -> ReplayInput:
    """Per-request engine rows -> the replay input of one packed (THD) micro-batch.

    Args:
        rows: per request, ``(n, L, k)`` integer rows: row ``j`` holds the picks of the query at
            position ``first + j`` of that request, for the ``L`` layers of the engine's layer
            axis, sequence-relative positions, ``-1`` padding. A mapping (request id -> rows) or a
            sequence (ids ``0 .. n-1``).
        seq_lens: tokens of each request in the training micro-batch (same keys / order).
        order: the micro-batch's packing order of request ids (default: the order of ``rows``).
            Every request of ``order`` needs rows and a length, and every request given must be in
            ``order``.
        first_rows: position of each request's first row (default 0; vLLM's
            ``indexer_topk_prompt_start``).
        layer_numbers: the Megatron layer number (1-based) of each of the ``L`` engine layers
            (default ``1 .. L``: the engine's 0-based layer ids + 1).
        shared: ``{layer: source_layer}`` for index-sharing layers: checked equal to their source
            in every row, then dropped (Megatron's shared layers read the source's picks).
        last_row: the row of a sequence's last token when the engine returned none (it never ran
            that token: its output predicts past the sequence): ``"empty"`` (all ``-1``: attends
            to nothing) or ``"self"`` (its own position only, for kernels that need a key).
        future_keys: keys past a row's own position: ``"error"`` (the causal check), or
            ``"drop"`` them (set to ``-1``, padding moved last): for outputs whose short rows
            "select all" keys of the sequence and leave causality to the attention mask (exact:
            the attention never reads them). An explicit choice; never applied silently.
        topk: the consumer's ``dsa_indexer_topk``; ``k`` may not exceed it.
        source: names the engine output in errors.
        validate: check the data (causal range, duplicates, shared layers): a few reductions and
            one host synchronisation per layer. Shapes, coverage and request accounting are
            always checked (host-side).

    Returns:
        :class:`ReplayInput`.
    """
    if last_row not in ("empty", "self"):
        raise ValueError(f"last_row={last_row!r}: use 'empty' or 'self'.")
    if future_keys not in ("error", "drop"):
        raise ValueError(f"future_keys={future_keys!r}: use 'error' or 'drop'.")
    ids, per_request = _keyed("rows", rows)
    _, lens = _keyed("seq_lens", seq_lens)
    order = _accounted(source, "rows", per_request, lens, ids if order is None else order)
    firsts: dict[object, int] = {}
    if first_rows is not None:
        _, firsts = _keyed("first_rows", first_rows)
        unknown = [r for r in order if r not in firsts]
        if unknown:
            raise ValueError(f"first_rows has no entry for request(s) {unknown}.")
    tensors = {r: _as_rows(f"{source} request {r!r}", per_request[r]) for r in order}
    ref = order[0]
    n_layers, k = tensors[ref].shape[1:]
    for r in order:
        if tuple(tensors[r].shape[1:]) != (n_layers, k):
            raise ValueError(
                f"{source} request {r!r}: {tuple(tensors[r].shape[1:])} (layers, k) but request "
                f"{ref!r} has {(n_layers, k)}; one micro-batch has one layer set and one k."
            )
    if topk is not None and k > _int("topk", topk, low=1):
        raise ValueError(f"{source}: k={k} picks per token, more than topk={topk}.")
    numbers = list(range(1, n_layers + 1)) if layer_numbers is None else list(layer_numbers)
    if len(numbers) != n_layers or len(set(numbers)) != n_layers:
        raise ValueError(
            f"layer_numbers={numbers} must name each of the {n_layers} engine layers once."
        )
    for n in numbers:
        _int("layer number", n, low=1)
    shared = dict(shared or {})
    for layer, src in shared.items():
        if layer not in numbers or src not in numbers or src in shared:
            raise ValueError(
                f"shared={{{layer}: {src}}}: both must be engine layers ({numbers}) and the "
                "source a computing layer."
            )

    device = tensors[ref].device
    blocks, covered, lengths = [], [], []
    for r in order:
        t, s = tensors[r], _int(f"seq_lens[{r!r}]", lens[r], low=1)
        first = _int(f"first_rows[{r!r}]", firsts.get(r, 0), low=0)
        end = first + t.shape[0]
        if first > 0:
            raise ValueError(
                f"{source} request {r!r}: rows start at position {first}; positions 0..{first - 1}"
                " have no engine picks (a cached prefix, or a skipped prompt start). Replay needs "
                "every token's picks: pass the earlier turn's rows too (concatenated), or capture "
                "with prompt start 0 / prefix caching off."
            )
        if end not in (s - 1, s):
            raise ValueError(
                f"{source} request {r!r}: {t.shape[0]} rows from position {first} but the "
                f"training sequence has {s} tokens: expected {s - 1 - first} (every token but "
                f"the last, which the engine never runs) or {s - first}; the rows and the "
                "micro-batch's tokens are not the same sequence."
            )
        if t.device != device:
            raise ValueError(
                f"{source} request {r!r} is on {t.device}, request {ref!r} on {device}."
            )
        t = t.to(torch.int32)
        if future_keys == "drop":
            position = torch.arange(t.shape[0], device=device).view(-1, 1, 1)
            t = torch.where(t > position, -1, t)
            t = t.gather(-1, (t < 0).to(torch.int8).argsort(dim=-1, stable=True))  # pads last
        if end == s - 1:
            pad = torch.full((1, n_layers, k), -1, dtype=torch.int32, device=device)
            if last_row == "self":
                pad[0, :, 0] = s - 1
            t = torch.cat((t, pad))
        blocks.append(t)
        covered.append(torch.arange(s, device=device) < end)
        lengths.append(s)
    packed = torch.cat(blocks)  # (T, L, k)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    result = ReplayInput(
        indices={},
        cu_seqlens=cu,
        request_ids=order,
        engine_rows=torch.cat(covered),
    )
    layout = TokenLayout(cu_seqlens=cu)
    axis = {n: i for i, n in enumerate(numbers)}
    for n in numbers:
        if n in shared:
            continue
        idx = packed[:, axis[n]].contiguous()
        if validate:
            layout.validate_indices(
                f"{source} layer {n}", idx, topk=topk, describe_row=result.describe_row
            )
        result.indices[n] = idx
    if validate:
        for layer, src in shared.items():
            differs = (packed[:, axis[layer]] != packed[:, axis[src]]).any(-1)
            if bool(differs.any()):
                row = int(differs.nonzero()[0])
                raise ValueError(
                    f"{source} layer {layer}: row {row} ({result.describe_row(row)}) differs from "
                    f"its index-sharing source layer {src}; the engine's sharing is not "
                    "Megatron's (check dsa_indexer_topk_freq / skip offset against the engine's)."
                )
    return result


def _accounted(
    source: str, what: str, given: Mapping, lens: Mapping, order: Sequence[object]
) -> tuple[object, ...]:
    """Every request of the micro-batch (``order``) has its ``what`` and a length, and nothing
    else is given."""
    order = tuple(order)
    if not order:
        raise ValueError(f"{source}: no requests; a micro-batch packs at least one.")
    if len(set(order)) != len(order):
        raise ValueError(f"order lists a request twice: {list(order)}.")
    missing = [r for r in order if r not in given]
    if missing:
        raise ValueError(
            f"{source}: no {what} for request(s) {missing} of the micro-batch; every request the "
            "micro-batch packs needs the engine's rows (or drop it from the micro-batch)."
        )
    extra = [r for r in given if r not in set(order)]
    if extra:
        raise ValueError(
            f"{source}: {what} for request(s) {extra} that the micro-batch does not pack "
            f"(order={list(order)}); pass exactly the micro-batch's requests."
        )
    no_len = [r for r in order if r not in lens]
    if no_len:
        raise ValueError(f"seq_lens has no length for request(s) {no_len}.")
    return order


def _keyed(name: str, value: object) -> tuple[tuple[object, ...], dict[object, object]]:
    if isinstance(value, Mapping):
        return tuple(value), dict(value)
    if isinstance(value, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(value, str):
        items = list(value)
        return tuple(range(len(items))), dict(enumerate(items))
    raise TypeError(f"{name}: expected a mapping (request id -> value) or a sequence.")


def pack_digests(
    digests: Mapping[object, object] | Sequence[object],
    seq_lens: Mapping[object, int] | Sequence[int],
    *,
    order: Sequence[object] | None = None,
    layer_numbers: Sequence[int] | None = None,
    source: str = "engine",
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Per-request engine row digests ``(n, L)`` int64 (:func:`~.digest.digest_rows` of the rows
    :func:`pack_requests` would take) -> ``({layer_number: (T,) int64}, engine_rows (T,) bool)``
    in the micro-batch's packing order; the same request accounting and coverage checks (host
    only). A sequence's last token, never run by the engine, gets digest 0 and
    ``engine_rows = False``: pass ``engine_rows`` to :func:`~.digest.digest_mismatches`."""
    ids, given = _keyed("digests", digests)
    _, lens = _keyed("seq_lens", seq_lens)
    order = _accounted(source, "digests", given, lens, ids if order is None else order)
    blocks, covered = [], []
    n_layers = None
    for r in order:
        d = given[r]
        if isinstance(d, np.ndarray):
            d = torch.from_numpy(d)
        if not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or d.ndim != 2:
            raise TypeError(f"{source} request {r!r}: digests must be a (n, L) int64 tensor.")
        if n_layers is None:
            n_layers = d.shape[1]
        elif d.shape[1] != n_layers:
            raise ValueError(f"{source} request {r!r}: {d.shape[1]} layers, expected {n_layers}.")
        s = _int(f"seq_lens[{r!r}]", lens[r], low=1)
        if d.shape[0] not in (s - 1, s):
            raise ValueError(
                f"{source} request {r!r}: {d.shape[0]} digest rows but the training sequence has "
                f"{s} tokens: expected {s - 1} or {s}."
            )
        ran = d.shape[0]
        if ran == s - 1:
            d = torch.cat((d, d.new_zeros(1, n_layers)))
        blocks.append(d)
        covered.append(torch.arange(s, device=d.device) < ran)
    packed = torch.cat(blocks)
    numbers = list(range(1, n_layers + 1)) if layer_numbers is None else list(layer_numbers)
    if len(numbers) != n_layers or len(set(numbers)) != n_layers:
        raise ValueError(f"layer_numbers={numbers} must name each of the {n_layers} layers once.")
    return {n: packed[:, i].contiguous() for i, n in enumerate(numbers)}, torch.cat(covered)


# --- SGLang: /generate meta_info["indexer_topk"] ------------------------------------------------


def decode_sglang_indexer_topk(meta_info: Mapping[str, object], num_rows: int) -> torch.Tensor:
    """SGLang's ``meta_info["indexer_topk"]`` (base64 of little-endian int32) ->
    ``(num_rows, L, k)`` int32, ``L = meta_info["indexer_topk_num_layers"]``.

    ``num_rows`` is ``len(tokens) - 1`` for a whole request (prompt + output; the last token is
    never run).
    """
    for key in ("indexer_topk", "indexer_topk_num_layers"):
        if key not in meta_info:
            raise ValueError(
                f"SGLang meta_info has no {key!r}; start the server with "
                "--enable-return-indexer-topk and send return_indexer_topk=true."
            )
    raw = np.frombuffer(base64.b64decode(str(meta_info["indexer_topk"])), dtype="<i4")
    layers = _int("indexer_topk_num_layers", meta_info["indexer_topk_num_layers"], low=1)
    rows = _int("num_rows", num_rows, low=0)
    if rows == 0 or raw.size % (rows * layers):
        raise ValueError(
            f"SGLang indexer_topk holds {raw.size} int32 values, not a whole number of "
            f"({rows} rows x {layers} layers) x k; num_rows must be len(tokens) - 1 of the "
            "request (minus its start offset)."
        )
    return torch.from_numpy(raw.astype(np.int32).reshape(rows, layers, -1))


def from_sglang(
    responses: Mapping[object, Mapping] | Sequence[Mapping],
    *,
    order: Sequence[object] | None = None,
    **kw,
) -> ReplayInput:
    """SGLang ``/generate`` responses (``return_indexer_topk=true``) -> :class:`ReplayInput`.

    Each response's ``meta_info`` gives the rows (:func:`decode_sglang_indexer_topk`) and the
    training sequence, ``prompt_tokens + completion_tokens`` tokens; other arguments as
    :func:`pack_requests` (its ``layer_numbers`` default, ``1 .. L``, is SGLang's axis: every
    decoder layer, ``layer_id + 1``; sharing layers hold copies of their source, pass ``shared``
    to check and drop them).
    """
    ids, by_id = _keyed("responses", responses)
    rows, lens = {}, {}
    for r in ids:
        meta = by_id[r].get("meta_info") if isinstance(by_id[r], Mapping) else None
        if not isinstance(meta, Mapping):
            raise ValueError(f"SGLang response {r!r} has no meta_info dict.")
        try:
            tokens = int(meta["prompt_tokens"]) + int(meta["completion_tokens"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"SGLang response {r!r}: meta_info needs prompt_tokens and completion_tokens."
            ) from None
        rows[r] = decode_sglang_indexer_topk(meta, tokens - 1)
        lens[r] = tokens
    return pack_requests(rows, lens, order=order, source="sglang", **kw)


# --- vLLM: PR 49555 per-request output, and the 0.33 per-step buffer ----------------------------


def decode_vllm_indexer_topk(payload: str | bytes) -> torch.Tensor:
    """vLLM's (PR 49555) ``indexer_topk``: base64 of ``.npy`` bytes -> ``(n, L, k)`` int32."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError / OSError variants for bad bytes
        raise ValueError(f"vLLM indexer_topk is not base64 .npy bytes ({exc}).") from None
    return _as_rows("vLLM indexer_topk", array).to(torch.int32)


def from_vllm(
    rows: Mapping[object, object] | Sequence[object],
    seq_lens: Mapping[object, int] | Sequence[int],
    **kw,
) -> ReplayInput:
    """Per-request vLLM top-k ``(n, L, k)`` (PR 49555's ``indexer_topk``, decoded with
    :func:`decode_vllm_indexer_topk`, or a NeMo-RL ``[T, L, K]`` payload split per request) ->
    :class:`ReplayInput`. ``first_rows`` is the request's ``indexer_topk_prompt_start``; for a
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
    seq_lens: Mapping[object, int],
    *,
    topk: int,
    order: Sequence[object] | None = None,
    **kw,
) -> ReplayInput:
    """Reassemble per-step vLLM buffers into per-request rows, then :func:`pack_requests`.

    Each request's rows are stitched in position order across steps (chunked prefill, decode,
    speculative verification with ``kept_rows``); a gap (a prefix-cache hit computes no rows for
    the cached tokens) or an overlap is an error naming the request and the positions.
    ``topk``: the index top-k (the buffer's first ``topk`` columns are the picks).
    """
    topk = _int("topk", topk, low=1)
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
