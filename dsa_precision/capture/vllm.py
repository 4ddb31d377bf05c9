"""vLLM's indexer top-k -> :class:`~dsa_precision.picks.TopkPicks`: PR 49555's per-request
``indexer_topk`` output, NeMo-RL ``[T, L, K]`` payloads, and the 0.33 per-step
``topk_indices_buffer`` (layout and source: docs/capture.md)."""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..picks import TopkPicks, _check_key_range
from .pack import _as_request_rows, _decode_base64, _int_at_least, _integer_array, pack_requests

__all__ = [
    "VllmStep",
    "check_vllm_engine_config",
    "decode_vllm_indexer_topk",
    "from_vllm",
    "from_vllm_steps",
    "merge_vllm_shardq_rows",
    "vllm_shared_layers",
]

# vLLM 0.34.0 ``model_executor/models/config.py``: the architectures whose start-up
# (``_set_deepseek_indexer_logits_dtype``) resolves ``indexer_logits_dtype="auto"`` to BF16 when
# ``mqa_logits_use_mx_scales()`` (a CUDA device of capability family 10.x, SM100/SM103); every
# other model, GLM-5's ``GlmMoeDsaForCausalLM`` among them, resolves "auto" to FP32 in the layer.
_VLLM_BF16_AUTO_ARCHITECTURES = frozenset(
    {
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "DeepseekV4ForConditionalGeneration",
        "DeepseekV41ForCausalLM",
    }
)
_ENGINE_CONFIG_KEYS = ("indexer_logits_dtype", "architecture", "device_capability")


def check_vllm_engine_config(engine_config: Mapping[str, Any]) -> str:
    """The indexer logits dtype a vLLM (0.34) run used, from its config; ``ValueError`` unless
    it is FP32, the only one the ``vllm`` profiles model.

    ``engine_config``: ``{"indexer_logits_dtype": "auto" | "float32" | "bfloat16",
    "architecture": "DeepseekV32ForCausalLM", "device_capability": (9, 0)}`` (the attention
    config's field as the engine printed it at start-up, the model's architecture, the GPU's
    compute capability; the last two matter only for ``"auto"``). vLLM releases before 0.34 have
    no such field and always score FP32 logits: ``{"indexer_logits_dtype": "float32"}``.

    BF16 logits are refused: they round each head-weighted score to 8 significant bits (on SM100
    the reduction itself runs in BF16 with BF16 head weights), which ties and reorders keys near
    the top-k boundary, so the engine's picks are not a top-k of the FP32 scores training
    computes; no profile models that, and an explicit ``bfloat16`` on SM90 is untested anywhere.
    Full replay (``dsa_indexer_topk_source="replay"``) takes the picks as they are and needs no
    check: leave ``engine_config`` out there.
    """
    if not isinstance(engine_config, Mapping):
        raise TypeError(
            f"engine_config={engine_config!r}: pass a mapping with the keys "
            f"{list(_ENGINE_CONFIG_KEYS)} (vLLM's attention_config.indexer_logits_dtype, the "
            "model's architecture, the GPU's (major, minor) compute capability)."
        )
    unknown = sorted(set(engine_config) - set(_ENGINE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"engine_config has unknown key(s) {unknown}; the keys are {list(_ENGINE_CONFIG_KEYS)}."
        )
    value = engine_config.get("indexer_logits_dtype", "auto")
    if value not in ("auto", "float32", "bfloat16"):
        raise ValueError(
            f"engine_config['indexer_logits_dtype']={value!r}: vLLM 0.34 takes 'auto', "
            "'float32' or 'bfloat16' (attention_config.indexer_logits_dtype)."
        )
    resolved = value
    if value == "auto":
        arch = engine_config.get("architecture")
        capability = engine_config.get("device_capability")
        if capability is not None and (
            not isinstance(capability, Sequence)
            or len(capability) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
        ):
            raise ValueError(
                f"engine_config['device_capability']={capability!r}: pass (major, minor), e.g. "
                "(9, 0) for an H100 / H200, (10, 0) for a B200."
            )
        if arch is not None and not isinstance(arch, str):
            raise TypeError(
                f"engine_config['architecture']={arch!r}: pass the model's architecture name, "
                "e.g. 'DeepseekV32ForCausalLM' (config.json's architectures[0])."
            )
        if arch is not None and arch not in _VLLM_BF16_AUTO_ARCHITECTURES:
            resolved = "float32"
        elif capability is not None and capability[0] != 10:
            resolved = "float32"
        elif arch is not None and capability is not None:
            resolved = "bfloat16"
        else:
            missing = "architecture" if arch is None else "device_capability"
            raise ValueError(
                f"engine_config: indexer_logits_dtype='auto' without {missing!r}: vLLM 0.34 "
                f"resolves 'auto' to bfloat16 for {sorted(_VLLM_BF16_AUTO_ARCHITECTURES)} on a "
                "device of capability 10.x (SM100) and to float32 otherwise; name the "
                f"{missing.replace('_', ' ')}, or the resolved value."
            )
    if resolved == "bfloat16":
        how = (
            "explicitly" if value == "bfloat16" else "as 'auto' resolves it for this model on SM100"
        )
        raise ValueError(
            f"the vLLM run scored BF16 indexer logits ({how}; engine_config={dict(engine_config)}): "
            "BF16 rounds every score to 8 significant bits, which ties and reorders keys at the "
            "top-k boundary, and no profile models it (the 'vllm' profiles are FP32 logits), so "
            "training's top-k and verify's agreement would differ from these picks on those "
            'rows. Serve with --attention-config \'{"indexer_logits_dtype": "float32"}\', or '
            "take the picks for full replay only (dsa_indexer_topk_source='replay') without "
            "engine_config."
        )
    return resolved


def vllm_shared_layers(skip_layer_ids: Iterable[int], num_layers: int) -> dict[int, int]:
    """vLLM's index-sharing layers as ``shared=`` of the adapters: ``{Megatron layer number:
    source layer number}``.

    ``skip_layer_ids``: 0-based layers that reuse top-k (vLLM 0.34's
    ``model_executor/models/utils.py::compute_skip_topk_layers(hf_config)``); each reads the
    buffer its closest preceding computing layer wrote (it builds no indexer). ``num_layers``:
    the model's ``num_hidden_layers``. Megatron numbers are vLLM's ids + 1.
    """
    num_layers = _int_at_least("num_layers", num_layers, low=1)
    skips = set()
    for i in skip_layer_ids:
        skips.add(_int_at_least("skip layer id", i, low=0))
    beyond = sorted(i for i in skips if i >= num_layers)
    if beyond:
        raise ValueError(f"skip layer ids {beyond} are not below num_layers={num_layers}.")
    shared, source = {}, None
    for i in range(num_layers):
        if i not in skips:
            source = i
        elif source is None:
            raise ValueError(
                f"skip layer id {i} has no computing layer before it; vLLM's first indexer "
                "layer computes its own top-k."
            )
        else:
            shared[i + 1] = source + 1
    return shared


def merge_vllm_shardq_rows(
    rank_buffers: Sequence[torch.Tensor],
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens_per_rank: Sequence[int] | np.ndarray | torch.Tensor,
    num_decode_tokens: int,
) -> torch.Tensor:
    """One layer's ``topk_indices_buffer`` copies of a vLLM 0.34 ShardQ step, one per TP rank
    (rank order), -> the step's rows in batch order, as :class:`VllmStep` takes them.

    Under ``sparse_mla_shard_q`` (a prefill step of >= ``sparse_mla_shard_q_min_tokens`` tokens
    after its decodes, TP > 1) rank ``r`` writes the step's ``num_decode_tokens`` decode rows in
    place, then only its own prefill tokens, compactly, in ascending order, from row
    ``num_decode_tokens``; nothing exchanges the top-k back. ``token_ids`` and
    ``num_tokens_per_rank`` are the step's ``ShardQMetadata`` fields (``zigzag_split``'s output:
    every rank's prefill token ids, relative to the first prefill token, grouped by rank). The
    decode rows are rank 0's.
    """
    d = _int_at_least("num_decode_tokens", num_decode_tokens, low=0)
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.int64).reshape(-1)
    counts = [_int_at_least(f"num_tokens_per_rank[{r}]", int(n), low=0)
              for r, n in enumerate(np.asarray(num_tokens_per_rank).reshape(-1))]  # fmt: skip
    if isinstance(rank_buffers, torch.Tensor) or not isinstance(rank_buffers, Sequence):
        raise TypeError("rank_buffers: pass a sequence of buffer copies, one per TP rank.")
    if len(rank_buffers) != len(counts) or not counts:
        raise ValueError(
            f"rank_buffers holds {len(rank_buffers)} copies for {len(counts)} ranks "
            "(num_tokens_per_rank); pass every TP rank's copy, in rank order."
        )
    n = sum(counts)
    if ids.numel() != n or not torch.equal(ids.sort().values, torch.arange(n)):
        raise ValueError(
            f"token_ids ({ids.numel()} ids) must be a permutation of 0..{n - 1} "
            f"(sum of num_tokens_per_rank={counts}); pass the step's ShardQMetadata fields."
        )
    bufs = []
    for r, (buf, count) in enumerate(zip(rank_buffers, counts, strict=True)):
        buf = _integer_array(f"rank {r} buffer", buf, shape="(N, topk)")
        if buf.ndim != 2 or buf.shape[0] < d + count:
            raise ValueError(
                f"rank {r} buffer {tuple(buf.shape)}: needs {d} decode + {count} own rows of a "
                "2-D (N, topk) copy of topk_indices_buffer."
            )
        bufs.append(buf)
    width = min(b.shape[1] for b in bufs)
    out = bufs[0].new_full((d + n, width), -1)
    out[:d] = bufs[0][:d, :width]
    start = 0
    for buf, count in zip(bufs, counts, strict=True):
        out[d + ids[start : start + count].to(out.device)] = buf[d : d + count, :width]
        start += count
    return out


def decode_vllm_indexer_topk(
    payload: str | bytes, *, name: str = "vLLM indexer_topk"
) -> torch.Tensor:
    """vLLM's (PR 49555) ``indexer_topk``: base64 of ``.npy`` bytes -> ``(n, L, k)`` int32.

    The ``.npy`` is read without pickles, in its own byte order; its keys are checked to fit
    int32 before the cast. ``name`` names the payload in errors (the response)."""
    data = _decode_base64(name, payload)
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError / OSError / EOFError for bad bytes
        raise ValueError(f"{name}: not .npy bytes ({' '.join(str(exc).split())[:160]}).") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: a .npz archive, not one .npy array.")
    rows = _as_request_rows(name, array)
    _check_key_range(name, rows, describe_row=lambda j: f"token {j}")
    return rows.to(torch.int32)


def from_vllm(
    rows: Mapping[Any, object] | Sequence[object],
    seq_lens: Mapping[Any, int] | Sequence[int],
    *,
    engine_config: Mapping[str, Any] | None = None,
    **kw: Any,
) -> TopkPicks:
    """Per-request vLLM top-k ``(n, L, k)`` (PR 49555's ``indexer_topk``, decoded with
    :func:`decode_vllm_indexer_topk`, or a NeMo-RL ``[T, L, K]`` payload split per request) ->
    :class:`~dsa_precision.picks.TopkPicks`. ``first_rows`` is the request's ``indexer_topk_prompt_start``; for a
    NeMo-RL payload, ``layer_numbers`` are its ``layer_ids`` + 1. ``engine_config``: checked by
    :func:`check_vllm_engine_config` first (picks for verify or tie replay; BF16 logits raise).
    Otherwise as :func:`pack_requests`."""
    if engine_config is not None:
        check_vllm_engine_config(engine_config)
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
    engine_config: Mapping[str, Any] | None = None,
    **kw: Any,
) -> TopkPicks:
    """Reassemble per-step vLLM buffers into per-request rows, then :func:`pack_requests`.

    Each request's rows are stitched in position order across steps (chunked prefill, decode,
    speculative verification with ``kept_rows``); a gap (a prefix-cache hit computes no rows for
    the cached tokens) or an overlap is an error naming the request and the positions.
    ``topk``: the index top-k (the buffer's first ``topk`` columns are the picks).
    ``engine_config``: checked by :func:`check_vllm_engine_config` first (BF16 logits raise).
    A ShardQ step's per-rank copies are merged first (:func:`merge_vllm_shardq_rows`).
    """
    if engine_config is not None:
        check_vllm_engine_config(engine_config)
    topk = _int_at_least("topk", topk, low=1)
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
        qsl = [_int_at_least(f"{where} query_start_loc[{i}]", v, low=0)
               for i, v in enumerate(step.query_start_loc)]  # fmt: skip
        computed = [_int_at_least(f"{where} num_computed_tokens[{i}]", v, low=0)
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
            kept = [_int_at_least(f"{where} kept_rows[{i}]", v, low=0)
                    for i, v in enumerate(step.kept_rows)]  # fmt: skip
            if len(kept) != len(ids):
                raise ValueError(
                    f"{where}: kept_rows has {len(kept)} entries for {len(ids)} requests."
                )
        buffers = {}
        for n in layers:
            buf = _integer_array(f"{where} layer {n} buffer", step.buffers[n], shape="(N, topk)")
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
