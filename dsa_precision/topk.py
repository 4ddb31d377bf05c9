"""Top-k key selection from indexer scores.

Selection rule (both backends, deterministic mode): among the valid keys of a row -- index below
the row's ``seq_len``, score neither ``-inf`` nor NaN -- take the ``k`` largest scores, ties toward
the lower key index. NaN scores (which :func:`dsa_precision.indexer_scores` produces for
non-finite q or k vectors) are never selected. Scores are ordered as cuDNN's radix top-k orders them: by their float32 bit
pattern, so ``+0.0`` ranks above ``-0.0`` (exact zeros are common: a key whose heads are all
ReLU-zero scores exactly 0). The selected indices come back in ascending order, padded with
``-1`` where a row has fewer than ``k`` valid keys.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import _cudnn
from ._checks import check_float_dtype, check_int_tensor, check_positive_int, check_tensor
from .quantize import DEFAULT_AMAX_FLOOR
from .scoring import DEFAULT_CHUNK_BYTES, ScoringOperands, _indexer_forward

__all__ = ["indexer_select", "indexer_topk"]

_SCORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKENDS = ("auto", "cudnn", "torch")
# Rows per torch-path chunk are bounded so the int64 sort keys stay under this many bytes.
_TORCH_TOPK_CHUNK_BYTES = 1 << 28
# Bytes per score element while a chunk is being selected: the float32 score plus cuDNN's radix
# top-k scratch (two int32 buffers per column: 8 bytes).
_SELECT_BYTES_PER_SCORE = 4 + 8


def _ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """Map float32 scores to int64 keys whose integer order is the float order (``-0 < +0``)."""
    bits = scores.to(torch.float32).view(torch.int32).to(torch.int64)
    # Negative floats: flip the magnitude bits so larger magnitude sorts lower.
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _compact_ascending(indices: torch.Tensor, valid: torch.Tensor, sk: int) -> torch.Tensor:
    """Valid indices in ascending order first, then ``-1`` padding."""
    keyed = torch.where(valid, indices, torch.full_like(indices, sk))
    keyed = keyed.sort(dim=-1).values
    return torch.where(keyed == sk, torch.full_like(keyed, -1), keyed)


def _torch_topk(scores: torch.Tensor, k: int, seq_lens: torch.Tensor, deterministic: bool):
    sk = scores.shape[-1]
    kk = min(k, sk)
    keys_valid = torch.arange(sk, device=scores.device) < seq_lens.unsqueeze(-1)
    keys_valid &= (scores != float("-inf")) & ~torch.isnan(scores)
    if deterministic:
        # One int64 per score: the ordered float key in the high 32 bits, the reversed key index
        # in the low 32, so torch.topk's largest-first order breaks ties toward lower indices.
        low = (2**32 - 1) - torch.arange(sk, device=scores.device, dtype=torch.int64)
        ranked = (_ordered_keys(scores) << 32) + low
        ranked = ranked.masked_fill_(~keys_valid, torch.iinfo(torch.int64).min)
    else:
        ranked = scores.to(torch.float32).masked_fill(~keys_valid, float("-inf"))
    picked = ranked.topk(kk, dim=-1, sorted=False).indices
    valid = keys_valid.gather(-1, picked)
    return _compact_ascending(picked, valid, sk)


def _cudnn_topk(scores: torch.Tensor, k: int, seq_lens: torch.Tensor, deterministic: bool):
    sk = scores.shape[-1]
    kk = min(k, sk)
    with _cudnn.device_scope(scores.device):
        result = _cudnn.dsa().indexer_top_k_wrapper(
            scores.contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            top_k=kk,
            next_n=1,
            return_val=True,
            deterministic=deterministic,
        )
    picked = result["indices"].to(torch.int64)
    values = result["values"]
    # cuDNN fills short rows with -1 but may pick -inf keys inside seq_len: those are not valid.
    valid = (picked >= 0) & (values != float("-inf"))
    out = _compact_ascending(picked.clamp_min(0), valid, sk)
    # The radix kernel orders NaN by its bits (usually above +inf). Rows that picked a NaN are
    # re-selected by the torch path, which never selects NaN (one small host sync per call).
    nan_rows = torch.isnan(values).any(dim=-1)
    if bool(nan_rows.any()):
        rows = nan_rows.nonzero().flatten()
        out[rows] = _torch_topk(scores[rows], k, seq_lens[rows], deterministic)
    return out


def indexer_topk(
    scores: torch.Tensor,
    k: int,
    *,
    seq_lens: torch.Tensor | None = None,
    deterministic: bool = True,
    backend: Literal["auto", "cudnn", "torch"] = "auto",
) -> torch.Tensor:
    """Select the top-``k`` keys of every score row.

    Arguments:
        scores: ``(..., S_k)`` float32 (or bf16/fp16) scores, ``-inf`` at masked keys, e.g.
            ``(B, S_q, S_k)`` from :func:`dsa_precision.indexer_scores`.
        k: keys per row, ``k >= 1``; rows with fewer valid keys are padded with ``-1``.
        seq_lens: optional ``scores.shape[:-1]`` integer tensor: keys ``>= seq_lens`` are not
            valid (in ``[0, S_k]``). Without it, validity is ``score != -inf``.
        deterministic: ties break toward the lower key index (default). ``False`` lets ties
            resolve arbitrarily (cuDNN's faster mode).
        backend: ``"cudnn"`` (SM90+ radix top-k, ``k <= 2048``), ``"torch"`` or ``"auto"``.
            Both select exactly the same set in deterministic mode.

    Returns:
        int32 ``(..., k)``: selected key indices in ascending order, then ``-1`` padding.
    """
    scores = check_tensor("scores", scores)
    check_float_dtype("scores", scores, _SCORE_DTYPES)
    if scores.ndim < 1:
        raise ValueError("scores must have a key dimension, got a 0-d tensor.")
    k = check_positive_int("k", k)
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not a top-k backend; use one of {_BACKENDS}.")
    lead, sk = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(lead.numel(), sk)
    if seq_lens is None:
        lens = torch.full((flat.shape[0],), sk, dtype=torch.int64, device=scores.device)
    else:
        check_int_tensor("seq_lens", seq_lens, ndim=check_tensor("seq_lens", seq_lens).ndim)
        if seq_lens.shape != lead:
            raise ValueError(
                f"seq_lens has shape {tuple(seq_lens.shape)}; expected one length per score row, "
                f"{tuple(lead)}."
            )
        if seq_lens.device != scores.device:
            raise ValueError(
                f"seq_lens is on {seq_lens.device} but scores on {scores.device}; move it."
            )
        lens = seq_lens.reshape(-1).to(torch.int64)
        if lens.numel() and bool(((lens < 0) | (lens > sk)).any()):
            raise ValueError(
                f"seq_lens must lie in [0, S_k={sk}]; got values in "
                f"[{int(lens.min())}, {int(lens.max())}]."
            )
    if flat.shape[0] == 0 or sk == 0:
        return torch.full((*lead, k), -1, dtype=torch.int32, device=scores.device)

    use_cudnn = backend == "cudnn"
    if backend != "torch":
        reason = _cudnn.topk_unsupported_reason(device=scores.device, k=k, dtype=scores.dtype)
        if reason is not None and backend == "cudnn":
            raise RuntimeError(
                f"backend='cudnn' cannot run this top-k: {reason}. Use backend='torch' or 'auto'."
            )
        use_cudnn = reason is None
    if use_cudnn:
        picked = _cudnn_topk(flat, k, lens, deterministic)
    else:
        rows_per_chunk = max(1, _TORCH_TOPK_CHUNK_BYTES // (16 * sk))
        picked = torch.cat(
            [
                _torch_topk(
                    flat[r : r + rows_per_chunk], k, lens[r : r + rows_per_chunk], deterministic
                )
                for r in range(0, flat.shape[0], rows_per_chunk)
            ]
        )
    if picked.shape[-1] < k:
        pad = torch.full(
            (picked.shape[0], k - picked.shape[-1]), -1, dtype=picked.dtype, device=picked.device
        )
        picked = torch.cat((picked, pad), dim=-1)
    return picked.to(torch.int32).reshape(*lead, k)


def indexer_select(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    weights: torch.Tensor | None,
    topk: int,
    *,
    scoring_precision: str,
    ratio: int = 1,
    sm_scale: float = 1.0,
    backend: Literal["auto", "cudnn", "torch"] = "auto",
    q_causal_offsets: torch.Tensor | int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    deterministic: bool = True,
    operands: ScoringOperands | None = None,
) -> torch.Tensor:
    """Score and select in one pass: the split top-k path.

    Arguments as for :func:`dsa_precision.indexer_scores` plus ``topk`` and ``deterministic``;
    ``operands`` (a :class:`dsa_precision.scoring.ScoringOperands`) replaces ``q``, ``k``,
    ``weights``. BSHD input is scored in row chunks and each chunk is reduced to its top-k right
    away, so the full ``(B, S_q, S_k)`` score matrix never exists; ``chunk_bytes`` bounds a
    chunk's whole working set (its float32 scores and the top-k scratch, 12 bytes per score).
    Packed input scores, then selects.

    Returns:
        int32 ``(B, S_q, topk)`` (packed: ``(T_q, topk)``), ascending, ``-1`` padded.
    """

    topk = check_positive_int("topk", topk)
    common = dict(
        scoring_precision=scoring_precision,
        ratio=ratio,
        sm_scale=sm_scale,
        backend=backend,
        q_causal_offsets=q_causal_offsets,
        amax_floor=amax_floor,
        chunk_bytes=check_positive_int("chunk_bytes", chunk_bytes),
        operands=operands,
    )
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        scores = _indexer_forward(
            q, k, weights, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **common
        )
        return indexer_topk(scores, topk, deterministic=deterministic)
    # The result is allocated once and each chunk's picks written into it (a list of chunks
    # concatenated at the end would hold the whole result twice).
    out: list[torch.Tensor] = []

    def on_chunk(row_start: int, scores: torch.Tensor) -> None:
        picks = indexer_topk(scores, topk, deterministic=deterministic)
        if not out:
            rows = (operands.q if operands is not None else q).shape[1]
            out.append(picks.new_empty((picks.shape[0], rows, topk)))
        out[0][:, row_start : row_start + picks.shape[1]] = picks

    # The scoring chunker budgets float32 scores (4 bytes each); scale the budget so that the
    # scores and the top-k scratch together stay within chunk_bytes.
    common["chunk_bytes"] = max(1, common["chunk_bytes"] * 4 // _SELECT_BYTES_PER_SCORE)
    _indexer_forward(q, k, weights, on_chunk=on_chunk, **common)
    if not out:  # no query rows
        ref = q if operands is None else operands.q
        return torch.full((ref.shape[0], 0, topk), -1, dtype=torch.int32, device=ref.device)
    return out[0]
