"""Capture: the inference engines' top-k outputs into replay, verify and ``agree``.

- :mod:`.adapters`: SGLang's ``return_indexer_topk``, vLLM's indexer top-k (PR 49555's
  per-request output, the 0.33 per-step buffer, NeMo-RL payloads) -> :class:`ReplayInput`
  (``{layer_number: (T, k) int32}`` + ``cu_seqlens``), checked against the micro-batch.
- :mod:`.compact`: compact storage / transfer of picks, decoded on the device.
- :mod:`.digest`: a 64-bit digest per row, to verify without moving the picks.
- :func:`load_engine_output`: a saved engine output file, for ``dsa-precision agree``.

Layouts and sources: docs/capture.md. Imports no Megatron.
"""

from .adapters import (
    ReplayInput,
    VllmStep,
    decode_sglang_indexer_topk,
    decode_vllm_indexer_topk,
    from_sglang,
    from_vllm,
    from_vllm_steps,
    pack_digests,
    pack_requests,
)
from .compact import FORMATS, CompactPicks, decode_picks, encode_picks
from .digest import digest_mismatches, digest_row_reference, digest_rows
from .files import ENGINE_FORMATS, load_engine_output

__all__ = [
    "ENGINE_FORMATS",
    "FORMATS",
    "CompactPicks",
    "ReplayInput",
    "VllmStep",
    "decode_picks",
    "decode_sglang_indexer_topk",
    "decode_vllm_indexer_topk",
    "digest_mismatches",
    "digest_row_reference",
    "digest_rows",
    "encode_picks",
    "from_sglang",
    "from_vllm",
    "from_vllm_steps",
    "load_engine_output",
    "pack_digests",
    "pack_requests",
]
