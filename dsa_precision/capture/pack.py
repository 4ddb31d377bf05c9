"""Per-request engine rows -> one packed micro-batch's :class:`~dsa_precision.picks.TopkPicks`.

Every adapter (:mod:`.sglang`, :mod:`.vllm`) ends in :func:`pack_requests`: per request, the
engine's rows ``(n, L, k)`` (``n`` token rows from position ``first``, ``L`` layers, ``k`` slots,
sequence-relative key positions, ``-1`` padding) become ``{layer_number: (T, k) int32}`` plus
``cu_seqlens`` in the order of the training micro-batch, with the checks of the replay path
(:meth:`~dsa_precision.picks.TokenLayout.validate_indices`) and these: every request of the
micro-batch accounted for, each request's rows covering its training sequence, index-shared
layers equal to their source, and errors that name the request, the layer and the row. The
layouts and their sources are in docs/capture.md. Needs neither megatron-core nor an engine.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..picks import TokenLayout, TopkPicks, _check_key_range

__all__ = ["LastRow", "keyed", "pack_digests", "pack_requests"]

LastRow = Literal["empty", "self"]
_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


def _integer_array(name: str, value: object, *, shape: str) -> torch.Tensor:
    """An engine's integer array -- a tensor, or a NumPy array of a native or foreign byte order
    -- as a tensor; ``ValueError`` / ``TypeError`` naming ``name`` and the ``shape`` expected for
    anything else (object, float or bool arrays, lists, buffers). Values are not cast: a NumPy
    integer dtype torch lacks (uint16/32/64) becomes int64, checked to fit first."""
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
        if kind not in "iu":
            raise TypeError(
                f"{name}: expected a {shape} integer array, got a NumPy {value.dtype} array "
                f"{tuple(value.shape)}"
                f"{' (pickled objects are never read)' if kind == 'O' else ''}."
            )
        native = value.dtype.newbyteorder("=")
        if native in (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16),
                      np.dtype(np.int32), np.dtype(np.int64)):  # fmt: skip
            value = np.ascontiguousarray(value, dtype=native)
        else:  # uint16 / uint32 / uint64
            if value.size and int(value.max()) > np.iinfo(np.int64).max:
                raise ValueError(f"{name}: holds {int(value.max())}, beyond any key.")
            value = np.ascontiguousarray(value, dtype=np.int64)
        return torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a {shape} integer array, got {type(value).__name__}.")
    return value


def _as_request_rows(name: str, value: object) -> torch.Tensor:
    """An engine's per-request rows as a CPU/any-device ``(n, L, k)`` integer tensor; ``name``
    names them in errors."""
    value = _integer_array(name, value, shape="(n, L, k)")
    if value.dtype in (torch.int8, torch.uint8):
        value = value.to(torch.int16)  # exact; uint8's 255 stays 255
    if value.dtype not in _INT_DTYPES or value.ndim != 3:
        raise TypeError(
            f"{name}: expected a (n, L, k) int16/int32/int64 array (token rows, layers, top-k "
            f"slots), got {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}."
        )
    if value.shape[1] == 0 or value.shape[2] == 0:
        raise ValueError(f"{name}: {tuple(value.shape)} holds no layer or no top-k slot.")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} is on {value.device}; hold the engine's rows on the CPU or a GPU."
        )
    return value


def _decode_base64(name: str, payload: object) -> bytes:
    """The bytes of a base64 text, strictly (no stray characters, whole quanta)."""
    if not isinstance(payload, str | bytes):
        raise TypeError(
            f"{name}: expected a base64 string, got {type(payload).__name__} {str(payload)[:40]!r}."
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"{name}: not base64 ({exc}); the payload is damaged or truncated."
        ) from None


def _int_at_least(name: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}.")
    return int(value)


def pack_requests(
    rows: Mapping[Any, object] | Sequence[object],
    seq_lens: Mapping[Any, int] | Sequence[int],
    *,
    order: Sequence[object] | None = None,
    first_rows: Mapping[Any, int] | Sequence[int] | None = None,
    layer_numbers: Sequence[int] | None = None,
    shared: Mapping[int, int] | None = None,
    last_row: LastRow = "empty",
    future_keys: Literal["error", "drop"] = "error",
    topk: int | None = None,
    source: str = "engine",
    validate: bool = True,
) -> TopkPicks:
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
        :class:`~dsa_precision.picks.TopkPicks`: ``{layer_number: (T, k) int32}``
        sequence-relative picks in the micro-batch's packing order, its ``cu_seqlens`` ((n + 1,)
        int64), the ``request_ids`` in that order and ``engine_rows`` (``False`` where a row is
        a sequence's last token the engine never ran, filled as ``last_row`` says).
    """
    if last_row not in ("empty", "self"):
        raise ValueError(f"last_row={last_row!r}: use 'empty' or 'self'.")
    if future_keys not in ("error", "drop"):
        raise ValueError(f"future_keys={future_keys!r}: use 'error' or 'drop'.")
    ids, per_request = keyed("rows", rows)
    _, lens = keyed("seq_lens", seq_lens)
    order = _accounted(source, "rows", per_request, lens, ids if order is None else order)
    firsts: dict[object, object] = {}
    if first_rows is not None:
        _, firsts = keyed("first_rows", first_rows)
        unknown = [r for r in order if r not in firsts]
        if unknown:
            raise ValueError(f"first_rows has no entry for request(s) {unknown}.")
    tensors = {r: _as_request_rows(f"{source} request {r!r}", per_request[r]) for r in order}
    ref = order[0]
    n_layers, k = tensors[ref].shape[1:]
    for r in order:
        if tuple(tensors[r].shape[1:]) != (n_layers, k):
            raise ValueError(
                f"{source} request {r!r}: {tuple(tensors[r].shape[1:])} (layers, k) but request "
                f"{ref!r} has {(n_layers, k)}; one micro-batch has one layer set and one k."
            )
    if topk is not None and k > _int_at_least("topk", topk, low=1):
        raise ValueError(f"{source}: k={k} picks per token, more than topk={topk}.")
    numbers = list(range(1, n_layers + 1)) if layer_numbers is None else list(layer_numbers)
    if len(numbers) != n_layers or len(set(numbers)) != n_layers:
        raise ValueError(
            f"layer_numbers={numbers} must name each of the {n_layers} engine layers once."
        )
    for n in numbers:
        _int_at_least("layer number", n, low=1)
    if shared is not None and not isinstance(shared, Mapping):
        raise TypeError(
            f"shared={shared!r}: pass {{layer: source_layer}} for the index-sharing layers."
        )
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
        t, s = tensors[r], _int_at_least(f"seq_lens[{r!r}]", lens[r], low=1)
        first = _int_at_least(f"first_rows[{r!r}]", firsts.get(r, 0), low=0)
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
        if t.device.type == "cpu" or validate:  # in the rows' own dtype, before the cast

            def row_of(j: int, r: object = r, first: int = first) -> str:
                return f"request {r!r} token {first + j}"

            _check_key_range(f"{source} request {r!r}", t, describe_row=row_of)
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
    layout = TokenLayout(cu_seqlens=cu)
    indices: dict[int, torch.Tensor] = {}  # filled below, held by the result
    result = TopkPicks(indices, layout, engine_rows=torch.cat(covered), request_ids=order)
    axis = {n: i for i, n in enumerate(numbers)}
    for n in numbers:
        if n in shared:
            continue
        idx = packed[:, axis[n]].contiguous()
        if validate:
            layout.validate_indices(
                f"{source} layer {n}", idx, topk=topk, describe_row=result.describe_row
            )
        indices[n] = idx
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
    source: str,
    what: str,
    given: Mapping[object, object],
    lens: Mapping[object, object],
    order: Sequence[object],
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


def keyed(name: str, value: object) -> tuple[tuple[object, ...], dict[object, object]]:
    """``(ids, {id: value})`` of a mapping (request id -> value) or a sequence (ids 0..n-1)."""
    if isinstance(value, Mapping):
        return tuple(value), dict(value)
    if isinstance(value, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(value, str):
        items = list(value)
        return tuple(range(len(items))), dict(enumerate(items))
    raise TypeError(f"{name}: expected a mapping (request id -> value) or a sequence.")


def pack_digests(
    digests: Mapping[Any, object] | Sequence[object],
    seq_lens: Mapping[Any, int] | Sequence[int],
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
    ids, given = keyed("digests", digests)
    _, lens = keyed("seq_lens", seq_lens)
    order = _accounted(source, "digests", given, lens, ids if order is None else order)
    blocks, covered = [], []
    n_layers = None
    for r in order:
        d = _integer_array(f"{source} request {r!r} digests", given[r], shape="(n, L) int64")
        if d.dtype != torch.int64 or d.ndim != 2:
            raise TypeError(
                f"{source} request {r!r}: digests must be a (n, L) int64 tensor (digest_rows' "
                f"output), got {str(d.dtype).removeprefix('torch.')} {tuple(d.shape)}; digests of "
                "another width are other numbers."
            )
        if n_layers is None:
            n_layers = d.shape[1]
        elif d.shape[1] != n_layers:
            raise ValueError(f"{source} request {r!r}: {d.shape[1]} layers, expected {n_layers}.")
        s = _int_at_least(f"seq_lens[{r!r}]", lens[r], low=1)
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
    assert n_layers is not None  # set by the first request (there is at least one)
    numbers = list(range(1, n_layers + 1)) if layer_numbers is None else list(layer_numbers)
    if len(numbers) != n_layers or len(set(numbers)) != n_layers:
        raise ValueError(f"layer_numbers={numbers} must name each of the {n_layers} layers once.")
    return {n: packed[:, i].contiguous() for i, n in enumerate(numbers)}, torch.cat(covered)
