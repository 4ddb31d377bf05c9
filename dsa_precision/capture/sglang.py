"""SGLang's ``return_indexer_topk`` (``/generate`` ``meta_info["indexer_topk"]``) ->
:class:`~dsa_precision.picks.TopkPicks` (layout and source: docs/capture.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..picks import TopkPicks
from .pack import _decode_base64, _int_at_least, keyed, pack_requests

__all__ = ["decode_sglang_indexer_topk", "from_sglang"]


def decode_sglang_indexer_topk(
    meta_info: Mapping[str, object],
    num_rows: int,
    *,
    topk: int | None = None,
    name: str = "SGLang indexer_topk",
) -> torch.Tensor:
    """SGLang's ``meta_info["indexer_topk"]`` (base64 of little-endian int32) ->
    ``(num_rows, L, k)`` int32, ``L = meta_info["indexer_topk_num_layers"]``.

    ``num_rows`` is ``len(tokens) - 1`` for a whole request (prompt + output; the last token is
    never run). ``topk``: SGLang's ``index_topk`` when known (the consumer's
    ``dsa_indexer_topk``): the payload must then hold exactly ``num_rows x L x topk`` values, so
    a wrong token count is named as one instead of changing ``k``. ``name`` names the payload in
    errors (the response).
    """
    if not isinstance(meta_info, Mapping):
        raise TypeError(f"{name}: meta_info must be a JSON object, got {type(meta_info).__name__}.")
    for key in ("indexer_topk", "indexer_topk_num_layers"):
        if key not in meta_info:
            raise ValueError(
                f"{name}: meta_info has no {key!r}; start the server with "
                "--enable-return-indexer-topk and send return_indexer_topk=true."
            )
    data = _decode_base64(f"{name} indexer_topk", meta_info["indexer_topk"])
    if len(data) % 4:
        raise ValueError(
            f"{name}: indexer_topk decodes to {len(data)} bytes, not whole int32 values; the "
            "payload is truncated or damaged."
        )
    raw = np.frombuffer(data, dtype="<i4")
    layers = _int_at_least(
        f"{name} indexer_topk_num_layers", meta_info["indexer_topk_num_layers"], low=1
    )
    rows = _int_at_least(f"{name} num_rows", num_rows, low=1)
    if topk is not None:
        k = _int_at_least("topk", topk, low=1)
        if raw.size != rows * layers * k:
            implied = raw.size / (layers * k)
            raise ValueError(
                f"{name}: indexer_topk holds {raw.size} int32 values, {implied:g} rows of "
                f"{layers} layers x topk={k}, but the request's token count gives {rows} rows "
                "(prompt_tokens + completion_tokens - 1): the token count and the payload are "
                "not the same request (or the engine's index_topk is not topk)."
            )
    elif raw.size % (rows * layers):
        raise ValueError(
            f"{name}: indexer_topk holds {raw.size} int32 values, not a whole number of "
            f"({rows} rows x {layers} layers) x k: the request's token count (prompt_tokens + "
            "completion_tokens - 1 rows) does not match the payload."
        )
    return torch.from_numpy(raw.astype(np.int32).reshape(rows, layers, -1))


def from_sglang(
    responses: Mapping[Any, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    *,
    order: Sequence[object] | None = None,
    **kw: Any,
) -> TopkPicks:
    """SGLang ``/generate`` responses (``return_indexer_topk=true``) ->
    :class:`~dsa_precision.picks.TopkPicks`.

    Each response's ``meta_info`` gives the rows (:func:`decode_sglang_indexer_topk`, with
    ``topk`` when given) and the training sequence, ``prompt_tokens + completion_tokens``
    tokens; other arguments as :func:`~dsa_precision.capture.pack_requests` (its
    ``layer_numbers`` default, ``1 .. L``, is SGLang's axis: every decoder layer,
    ``layer_id + 1``; sharing layers hold copies of their source, pass ``shared`` to check and
    drop them).
    """
    ids, by_id = keyed("responses", responses)
    rows, lens = {}, {}
    for r in ids:
        name = f"SGLang response {r!r}"
        response = by_id[r]
        meta = response.get("meta_info") if isinstance(response, Mapping) else None
        if not isinstance(meta, Mapping):
            got = type(response).__name__ if not isinstance(response, Mapping) else "no meta_info"
            raise ValueError(f"{name} has no meta_info object ({got}).")
        try:
            prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        except KeyError:
            raise ValueError(
                f"{name}: meta_info needs prompt_tokens and completion_tokens."
            ) from None
        tokens = _int_at_least(f"{name} prompt_tokens", prompt, low=0) + _int_at_least(
            f"{name} completion_tokens", completion, low=0
        )
        if tokens < 2:
            raise ValueError(f"{name}: {tokens} tokens; a request with top-k rows has at least 2.")
        rows[r] = decode_sglang_indexer_topk(meta, tokens - 1, topk=kw.get("topk"), name=name)
        lens[r] = tokens
    return pack_requests(rows, lens, order=order, source="sglang", **kw)
