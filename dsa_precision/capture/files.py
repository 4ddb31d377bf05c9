"""Saved engine outputs -> the per-layer picks ``agree`` and replay read.

:func:`load_engine_output` returns what :func:`dsa_precision.megatron.load_topk` returns for a
replay file (``({layer_number: (T, k)}, {"cu_seqlens": ...})``), so ``agree`` can compare an
engine's own output with a training capture layer by layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .adapters import decode_vllm_indexer_topk, from_sglang, from_vllm

__all__ = ["ENGINE_FORMATS", "load_engine_output"]

ENGINE_FORMATS = ("sglang", "vllm")


def _records(path: Path) -> list[dict]:
    if path.suffix.lower() not in (".json", ".jsonl"):
        raise ValueError(
            f"{path}: engine outputs are .json or .jsonl responses, got {path.suffix!r}."
        )
    if not path.is_file():
        raise ValueError(f"{path}: no such file.")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            loaded = json.loads(text)
            records = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}).") from None
    if not records or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: expected one response object or a list of them.")
    return records


def _vllm_request(path: Path, i: int, record: Mapping) -> tuple[torch.Tensor, int]:
    body = record
    if "choices" in record:
        choices = record["choices"]
        if not isinstance(choices, list) or len(choices) != 1:
            raise ValueError(f"{path} response {i}: expected one choice (n=1) per response.")
        body = choices[0]
    usage = record.get("usage", record)
    try:
        tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        payload = body["indexer_topk"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path} response {i}: needs indexer_topk (base64 .npy) and usage.prompt_tokens / "
            "completion_tokens; serve with --enable-return-indexer-topk."
        ) from None
    return decode_vllm_indexer_topk(payload), tokens


def load_engine_output(
    path: str | Path, *, engine: str, **kw
) -> tuple[dict[int, torch.Tensor], dict[str, object]]:
    """The engine's per-layer picks of the responses saved in ``path``, packed in file order.

    Args:
        path: ``.json`` (one response or a list) or ``.jsonl`` (one per line). ``sglang``:
            ``/generate`` responses with ``meta_info.indexer_topk``; ``vllm``: OpenAI responses
            whose choice carries ``indexer_topk`` (PR 49555), with ``usage``.
        engine: ``"sglang"`` or ``"vllm"``.
        kw: :func:`~dsa_precision.capture.pack_requests` options (``shared``, ``layer_numbers``,
            ``last_row``, ``first_rows``, ``validate``...).

    Returns:
        ``({layer_number: (T, k) int32}, {"cu_seqlens": (n + 1,) int64})``.
    """
    if engine not in ENGINE_FORMATS:
        raise ValueError(f"engine={engine!r}: use one of {ENGINE_FORMATS}.")
    path = Path(path)
    records = _records(path)
    try:
        if engine == "sglang":
            out = from_sglang(records, **kw)
        else:
            rows, lens = {}, {}
            for i, record in enumerate(records):
                rows[i], lens[i] = _vllm_request(path, i, record)
            out = from_vllm(rows, lens, **kw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out.indices, {"cu_seqlens": out.cu_seqlens}
