"""SGLang's ``return_indexer_topk`` (``/generate`` ``meta_info["indexer_topk"]``) ->
:class:`~dsa_precision.picks.TopkPicks` (layout and source: docs/capture.md)."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..picks import TopkPicks
from .pack import int_at_least, keyed, pack_requests

__all__ = ["decode_sglang_indexer_topk", "from_sglang"]


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
    layers = int_at_least("indexer_topk_num_layers", meta_info["indexer_topk_num_layers"], low=1)
    rows = int_at_least("num_rows", num_rows, low=0)
    if rows == 0 or raw.size % (rows * layers):
        raise ValueError(
            f"SGLang indexer_topk holds {raw.size} int32 values, not a whole number of "
            f"({rows} rows x {layers} layers) x k; num_rows must be len(tokens) - 1 of the "
            "request (minus its start offset)."
        )
    return torch.from_numpy(raw.astype(np.int32).reshape(rows, layers, -1))


def from_sglang(
    responses: Mapping[Any, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    *,
    order: Sequence[object] | None = None,
    **kw: Any,
) -> TopkPicks:
    """SGLang ``/generate`` responses (``return_indexer_topk=true``) -> :class:`~dsa_precision.picks.TopkPicks`.

    Each response's ``meta_info`` gives the rows (:func:`decode_sglang_indexer_topk`) and the
    training sequence, ``prompt_tokens + completion_tokens`` tokens; other arguments as
    :func:`pack_requests` (its ``layer_numbers`` default, ``1 .. L``, is SGLang's axis: every
    decoder layer, ``layer_id + 1``; sharing layers hold copies of their source, pass ``shared``
    to check and drop them).
    """
    ids, by_id = keyed("responses", responses)
    rows, lens = {}, {}
    for r in ids:
        response = by_id[r]
        meta = response.get("meta_info") if isinstance(response, Mapping) else None
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
