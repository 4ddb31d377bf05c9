"""Capture: the inference engines' top-k outputs into replay, verify and ``agree``.

Every adapter returns a :class:`~dsa_precision.picks.TopkPicks` (``{layer_number: (T, k)
int32}`` with the packed layout), checked against the micro-batch:

- :mod:`.pack`: per-request rows -> one packed micro-batch (:func:`pack_requests`,
  :func:`pack_digests`);
- :mod:`.sglang`: SGLang's ``return_indexer_topk``;
- :mod:`.vllm`: vLLM's indexer top-k (PR 49555's per-request output, the 0.33 per-step buffer,
  NeMo-RL payloads);
- :mod:`.compact`: compact storage / transfer of picks, decoded on the device;
- :mod:`.digest`: a 64-bit digest per row, to verify without moving the picks;
- :mod:`.ties`: the engine's picks of its boundary-tied rows only, with every row's digest
  (:func:`engine_tie_rows` in the engine, :func:`pack_tie_rows` for ``replay_ties``);
- :mod:`.files`: replay files (:func:`save_picks`, :func:`load_picks`) and saved engine outputs
  (:func:`load_engine_output`), for ``dsa-precision agree``.

Layouts and sources: docs/capture.md. Imports no Megatron.
"""

from typing import TYPE_CHECKING, NoReturn

from ..picks import TokenLayout, TopkPicks
from .compact import FORMATS, CompactPicks, decode_picks, encode_picks
from .digest import digest_mismatches, digest_row_reference, digest_rows
from .files import ENGINE_FORMATS, load_engine_output, load_picks, save_picks
from .pack import pack_digests, pack_requests
from .sglang import decode_sglang_indexer_topk, from_sglang
from .ties import TieRows, engine_tie_rows, pack_tie_rows
from .vllm import (
    VllmStep,
    check_vllm_engine_config,
    decode_vllm_indexer_topk,
    from_vllm,
    from_vllm_steps,
    merge_vllm_shardq_rows,
    vllm_shared_layers,
)

__all__ = [
    "ENGINE_FORMATS",
    "FORMATS",
    "CompactPicks",
    "TieRows",
    "TokenLayout",
    "TopkPicks",
    "VllmStep",
    "check_vllm_engine_config",
    "decode_picks",
    "decode_sglang_indexer_topk",
    "decode_vllm_indexer_topk",
    "digest_mismatches",
    "digest_row_reference",
    "digest_rows",
    "encode_picks",
    "engine_tie_rows",
    "from_sglang",
    "from_vllm",
    "from_vllm_steps",
    "load_engine_output",
    "load_picks",
    "merge_vllm_shardq_rows",
    "pack_digests",
    "pack_requests",
    "pack_tie_rows",
    "save_picks",
    "vllm_shared_layers",
]


# Hidden from the type checker: a name that is gone stays an error there, not Any.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> NoReturn:
        if name == "ReplayInput":
            raise AttributeError(
                "dsa_precision.capture.ReplayInput is gone; the adapters return "
                "dsa_precision.picks.TopkPicks (.indices, .cu_seqlens, .request_ids, .engine_rows)."
            )
        raise AttributeError(f"module 'dsa_precision.capture' has no attribute {name!r}")
