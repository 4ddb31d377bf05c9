"""Synthetic engine outputs laid out as the engines' sources produce them (docs/capture.md): the known picks they are built from, SGLang responses and vLLM payloads."""

import base64
import io

import numpy as np
import torch

from dsa_precision.capture import (
    VllmStep,
)

K = 8


def causal_picks(seq: int, k: int = K, seed: int = 0) -> torch.Tensor:
    """``(seq, k)`` int32: row ``i`` holds min(k, i + 1) distinct keys in ``[0, i]`` in a random
    order, ``-1`` after them (the engines' top-k of a causal row)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(seq):
        n = min(k, i + 1)
        keys = torch.randperm(i + 1, generator=g)[:n]
        rows.append(torch.cat((keys, torch.full((k - n,), -1))))
    return torch.stack(rows).to(torch.int32)


def engine_rows(seq: int, layers: int, seed: int, freq: int = 1) -> torch.Tensor:
    """``(seq, layers, k)``: every layer its own picks; with ``freq=2``, SGLang's sharing: layer
    ids 2, 4, ... (0-based) copy layer id - 1 (test_return_indexer_topk.py)."""
    out = torch.stack([causal_picks(seq, seed=seed * 100 + n) for n in range(layers)], dim=1)
    if freq == 2:
        for n in range(2, layers, 2):
            out[:, n] = out[:, n - 1]
    return out


def sglang_response(full: torch.Tensor, completion: int = 3) -> dict:
    """A /generate response: rows of every token but the last, base64 little-endian int32."""
    rows = full[:-1].numpy().astype("<i4")
    return {
        "text": "...",
        "meta_info": {
            "prompt_tokens": full.shape[0] - completion,
            "completion_tokens": completion,
            "indexer_topk": base64.b64encode(rows.tobytes()).decode("ascii"),
            "indexer_topk_num_layers": full.shape[1],
        },
    }


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array.astype(np.int32))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def vllm_step(requests, starts, lengths, full, stale=7, kept=None):
    """One step's buffer as sparse_attn_indexer leaves it: rows of the scheduled tokens in batch
    order (query_start_loc), then stale rows from earlier, larger steps."""
    qsl = np.cumsum([0, *lengths]).tolist()
    buffers = {}
    for n in (1, 2):
        rows = [
            full[r][s : s + ln, n - 1] for r, s, ln in zip(requests, starts, lengths, strict=True)
        ]
        stale_rows = torch.full((stale, K + 4), 12345, dtype=torch.int32)  # wider, stale
        body = torch.nn.functional.pad(torch.cat(rows), (0, 4), value=-1)
        buffers[n] = torch.cat((body, stale_rows))
    return VllmStep(requests, qsl, starts, buffers, kept_rows=kept)
