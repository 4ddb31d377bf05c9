"""Score and select in one pass: the indexer's top-k without the full score matrix.

Query rows are scored in chunks and each chunk is reduced to its top-k right away, so at most one
chunk of scores exists; ``chunk_bytes`` bounds a chunk's working set (its float32 scores and the
radix top-k scratch, 12 bytes per score). By default (``chunk_bytes=None``) the budget is
:data:`_DEFAULT_CHUNK_BYTES` (4 GiB): a call whose whole working set fits (S = 16384 at B = 1)
runs as one launch of each kernel, a larger one in 4 GiB chunks. Fewer, larger chunks are faster
on the H200: every extra chunk costs about 0.1 ms at S = 16384, and at S = 32768-131072 the FP8
path runs 1.1-1.5x faster end to end with 4 GiB chunks than with 1 GiB ones
(docs/benchmarks.md). Chunks keep their global causal rows, so the result is bit-identical to
scoring everything at once and selecting. No step waits for the host.

With ``backend="deepgemm"`` each chunk is one DeepGEMM launch (batch rows flattened into key
windows) whose logits the top-k reads where the kernel wrote them, bounded by each row's length:
no mask, no copy. A chunk's logits take ``align(S_k, 256)`` floats per row.

- :func:`indexer_select`: BSHD, ``(B, S_q, topk)``.
- :func:`indexer_select_varlen`: packed THD, ``(T_q, topk)`` with sequence-local key indices.

``margins=True`` also returns each row's margin, its ``topk``-th minus its ``(topk + 1)``-th
largest score (how close the row's boundary is to a tie), read from the same chunk of scores
after its one selection: the smallest score among the picks minus the largest score among the
row's other valid keys (one reduction; no second top-k, no rescoring). The picks are those of the
call without ``margins``, bit for bit; the margin is NaN for a row with fewer than ``topk + 1``
valid keys (or fewer than ``topk`` picks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import _INT32_MAX, _check_bool, _check_positive_int, _takes_precision_config
from .config import IndexerPrecisionConfig
from .devices import _to_device
from .operands import ScoringOperands
from .prepare import _as_scoring_operands
from .rows import (
    _causal_offsets,
    _check_varlen_args,
    _constant_key_counts,
    _constant_offsets,
    _varlen_row_slice,
    _varlen_windows,
    causal_key_counts,
)
from .scoring import (
    Backend,
    _bshd_scores,
    _deepgemm_select_input,
    _resolve_scoring_backend,
    _thd_scores,
)
from .ties import selection_margins
from .topk import _resolve_topk_backend, _select_rows

__all__ = ["indexer_select", "indexer_select_varlen"]

# Working-set budget of one chunk by default: the extra memory of a call is at most this plus
# the chunk's picks (docs/benchmarks.md, "Peak extra memory").
_DEFAULT_CHUNK_BYTES = 4 << 30
# Bytes per score while a chunk is selected: the float32 score plus cuDNN's radix top-k scratch.
_SELECT_BYTES_PER_SCORE = 4 + 8
# Chunks start on multiples of this many rows when the budget allows, and of the kernel's query
# tile otherwise.
_CHUNK_ROW_ALIGNMENT = 512
_CHUNK_ROW_MIN_ALIGNMENT = 8


def _chunk_rows(budget: int | None, rows: int, bytes_per_row: int) -> int:
    """Query rows per chunk: the whole call when it fits in ``budget`` (``None``:
    :data:`_DEFAULT_CHUNK_BYTES`), else as many as fit, aligned to whole kernel tiles."""
    budget = _DEFAULT_CHUNK_BYTES if budget is None else budget
    if rows * bytes_per_row <= budget:
        return max(rows, 1)
    n = budget // max(bytes_per_row, 1)
    for align in (_CHUNK_ROW_ALIGNMENT, _CHUNK_ROW_MIN_ALIGNMENT):
        if n >= align:
            return n // align * align
    return _CHUNK_ROW_MIN_ALIGNMENT


def _topk_backend(requested: str) -> str:
    """The top-k backend asked for with a scoring backend: the same kernel family when named
    (``"cudnn"``, ``"torch"``), else ``"auto"`` (``"auto"`` decides for each kernel on its own;
    DeepGEMM has no top-k): an ``"auto"`` call scored by cuDNN still selects with the torch top-k
    where cuDNN's cannot (``k > 2048``)."""
    return {"cudnn": "cudnn", "torch": "torch"}.get(requested, "auto")


def _buffer(n: int, backend: str, device: torch.device) -> torch.Tensor | None:
    """One score buffer reused by every chunk (the kernel writes into it); DeepGEMM allocates."""
    return None if backend == "deepgemm" else torch.empty(n, dtype=torch.float32, device=device)


def _window_topk_backend(scores: torch.Tensor, topk: int) -> str:
    """The top-k backend of DeepGEMM's logits ``(rows, padded width)``: cuDNN's where it can
    select them, else torch (what ``indexer_topk(backend="auto")`` decides)."""
    k = min(topk, max(scores.shape[-1], 1))
    return _resolve_topk_backend("auto", device=scores.device, k=k, dtype=scores.dtype)


def _picks(shape: tuple[int, ...], chunked: bool, device: torch.device) -> torch.Tensor | None:
    """The result of a chunked call (every row is written by its chunk); ``None`` for one chunk,
    whose top-k output is returned as it is."""
    return torch.empty(shape, dtype=torch.int32, device=device) if chunked else None


def _margins(scores: torch.Tensor, lens: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """float32 ``(rows,)``: each row's ``k``-th minus ``(k + 1)``-th score, from the scores
    ``(rows, >= S_k)`` the picks ``(rows, k)`` were selected from
    (:func:`dsa_precision.ties.selection_margins` over the row's ``lens`` columns). NaN where a
    row has fewer than ``k`` picks or no further valid key. The scores are read, never written
    (DeepGEMM's logits included)."""
    margins = selection_margins(scores, picks, lens)
    return margins.masked_fill_(~(picks >= 0).all(-1), float("nan"))


def _margin_rows(
    shape: tuple[int, ...], chunked: bool, device: torch.device
) -> torch.Tensor | None:
    """The margins of a chunked call with ``margins`` (``None`` otherwise)."""
    return torch.empty(shape, dtype=torch.float32, device=device) if chunked else None


def _nan_margins(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)


def _int_offset(q_causal_offsets: torch.Tensor | int | None) -> int | None:
    """The Python int of an int (or ``None``: 0) offset, already checked; ``None`` for a tensor."""
    if q_causal_offsets is None:
        return 0
    return None if isinstance(q_causal_offsets, torch.Tensor) else int(q_causal_offsets)


def _with_margins(
    picks: torch.Tensor, margins: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return picks if margins is None else (picks, margins)


def _select_chunks(
    chunk_scores: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, str]],
    lead: tuple[int, ...],
    rows: int,
    step: int,
    topk: int,
    deterministic: bool,
    margins: bool,
    device: torch.device,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop of both layouts: query rows ``[r0, r1)`` in chunks of ``step``, each
    scored by ``chunk_scores(r0, r1)`` -> ``(scores (n, >= W) float32, lens (n,), top-k
    backend)`` with ``n = prod(lead) * (r1 - r0)`` rows, batch-major, then selected (and its
    margins read) before the next chunk is scored. Returns int32 ``(*lead, rows, topk)`` (with
    ``margins``: and float32 ``(*lead, rows)``); a single chunk's top-k output as it is."""
    chunked = step < rows
    out = _picks((*lead, rows, topk), chunked, device)
    out_margins = _margin_rows((*lead, rows), margins and chunked, device)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        scores, lens, row_backend = chunk_scores(r0, r1)
        picks = _select_rows(scores, topk, lens, deterministic, row_backend)
        gaps = _margins(scores, lens, picks).view(*lead, r1 - r0) if margins else None
        picks = picks.view(*lead, r1 - r0, topk)
        if out is None:
            return _with_margins(picks, gaps)
        out[..., r0:r1, :] = picks
        if gaps is not None:
            assert out_margins is not None  # chunked, with margins
            out_margins[..., r0:r1] = gaps
        del scores, lens, picks, gaps  # DeepGEMM: free this chunk's logits before the next launch
    assert out is not None  # chunked: one chunk returned in the loop
    return _with_margins(out, out_margins)


@_takes_precision_config
def indexer_select(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    topk: int,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    chunk_bytes: int | None = None,
    deterministic: bool = True,
    margins: bool = False,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Top-``topk`` keys of every query row, scored and selected chunk by chunk.

    Arguments as for :func:`dsa_precision.indexer_scores` (operands, or carriers with their
    ``config``), plus ``topk``, ``chunk_bytes`` (``None``: :data:`_DEFAULT_CHUNK_BYTES`, 4 GiB;
    see the module docstring) and ``deterministic`` (see :func:`dsa_precision.indexer_topk`).
    ``backend`` (``None``: the operands', their config's ``scoring_backend``) chooses both
    kernels: ``"cudnn"`` scores and selects with cuDNN, ``"torch"`` with the references,
    ``"deepgemm"`` scores with DeepGEMM (one launch per chunk) and selects with cuDNN when it
    can, reading DeepGEMM's logits in place; ``"auto"`` scores as
    :attr:`IndexerPrecisionConfig.scoring_backend` describes (DeepGEMM first for FP8 operands
    where it is installed and serves the call, else cuDNN, else the torch reference) and selects
    with cuDNN's top-k where it can, else torch's.
    ``margins``: also return each row's margin (see the module docstring).

    Returns:
        int32 ``(B, S_q, topk)``: each row's keys ascending, ``-1`` in unused slots; with
        ``margins``, ``(picks, margins)``, margins float32 ``(B, S_q)``.
    """
    topk = _check_positive_int("topk", topk, high=_INT32_MAX)
    ratio = _check_positive_int("ratio", ratio, high=_INT32_MAX)
    if chunk_bytes is not None:
        chunk_bytes = _check_positive_int("chunk_bytes", chunk_bytes)
    deterministic = _check_bool("deterministic", deterministic)
    validate = _check_bool("validate", validate)
    ops = _as_scoring_operands(
        q, k, weights, config=config, sm_scale=sm_scale, entry="indexer_select"
    )
    b, sq, _, _ = ops.q.shape
    sk = ops.k.shape[1]
    device = ops.device
    offsets = _causal_offsets(q_causal_offsets, b, device, "batch row", rows=sq, validate=validate)
    requested = ops.backend if backend is None else backend
    backend = _resolve_scoring_backend(requested, ops)
    margins = _check_bool("margins", margins)
    if sq == 0 or sk == 0:
        empty = torch.full((b, sq, topk), -1, dtype=torch.int32, device=device)
        return _with_margins(empty, _nan_margins((b, sq), device) if margins else None)
    # Checked once for every chunk: the operands (validate), the top-k's backend (every chunk's
    # scores are float32 rows of S_k keys), the offsets (in range with all S_q rows added).
    if validate:
        ops.check_finite()
    if backend != "deepgemm":
        topk_backend = _resolve_topk_backend(
            _topk_backend(requested), device=device, k=min(topk, sk), dtype=torch.float32
        )
    start = _int_offset(q_causal_offsets)  # a Python int offset: shared constant tensors
    step = _chunk_rows(chunk_bytes, sq, b * sk * _SELECT_BYTES_PER_SCORE)
    buf = _buffer(b * min(step, sq) * sk, backend, device)

    def chunk_scores(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        part = ops.rows(r0, r1)
        # Each row's visible keys: the top-k's lengths, and DeepGEMM's windows.
        if start is None:
            lens = causal_key_counts(offsets, r0, r1 - r0, ratio, sk).view(-1)
        else:
            lens = _constant_key_counts(start, b, r0, r1 - r0, ratio, sk, device)
        if backend == "deepgemm":  # DeepGEMM's logits in place, each row bounded by its length
            # The buffer's rows (the window itself is not kept: its logits go with the scores).
            scores = _deepgemm_select_input(part, offsets, ratio, counts=lens).rows_in_place()
            return scores, lens, _window_topk_backend(scores, topk)
        if r0 == 0:
            part_offsets = offsets
        elif start is None:
            part_offsets = offsets + r0
        else:
            part_offsets = _constant_offsets(start + r0, b, device)
        assert buf is not None  # allocated for every backend but DeepGEMM
        part_out = buf[: b * (r1 - r0) * sk].view(b, r1 - r0, sk)
        scores = _bshd_scores(part, part_offsets, ratio, backend, part_out)
        return scores.view(b * (r1 - r0), sk), lens, topk_backend

    return _select_chunks(chunk_scores, (b,), sq, step, topk, deterministic, margins, device)


@_takes_precision_config
def indexer_select_varlen(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    topk: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    chunk_bytes: int | None = None,
    deterministic: bool = True,
    margins: bool = False,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_select` for packed (THD) sequences.

    Arguments as for :func:`dsa_precision.indexer_scores_varlen` plus ``topk``, ``chunk_bytes``,
    ``deterministic`` and ``margins``; ``backend`` chooses both kernels as for
    :func:`indexer_select`. A chunk of packed rows is scored as a THD launch of its own: the
    sequences it cuts get adjusted ``cu_seqlens_q`` and causal offsets, computed on the device.

    Returns:
        int32 ``(T_q, topk)``: sequence-local key indices (the engines' layout), ascending,
        ``-1`` in unused slots; with ``margins``, ``(picks, margins)``, margins float32 ``(T_q,)``.
    """
    topk = _check_positive_int("topk", topk, high=_INT32_MAX)
    ratio = _check_positive_int("ratio", ratio, high=_INT32_MAX)
    if chunk_bytes is not None:
        chunk_bytes = _check_positive_int("chunk_bytes", chunk_bytes)
    deterministic = _check_bool("deterministic", deterministic)
    validate = _check_bool("validate", validate)
    if not isinstance(q, ScoringOperands) and isinstance(q, torch.Tensor) and q.ndim == 3:
        q = q.unsqueeze(0)
        k = None if k is None else k.reshape(1, k.shape[0], k.shape[-1])
        weights = None if weights is None else weights.unsqueeze(0)
    ops = _as_scoring_operands(
        q, k, weights, config=config, sm_scale=sm_scale, entry="indexer_select_varlen"
    )
    tq, tk = ops.q.shape[1], ops.k.shape[1]
    # The caller's lengths (each chunk's are derived from them).
    _check_varlen_args(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device=ops.device, total_q=tq,
        total_k=tk, validate=validate,
    )  # fmt: skip
    n_seq = cu_seqlens_q.numel() - 1
    offsets = _causal_offsets(
        q_causal_offsets, n_seq, ops.device, "packed sequence", rows=max_seqlen_q, validate=validate
    )
    cu_q = _to_device(cu_seqlens_q, ops.device, torch.int32)
    cu_k = _to_device(cu_seqlens_k, ops.device, torch.int32)
    requested = ops.backend if backend is None else backend
    backend = _resolve_scoring_backend(requested, ops)
    margins = _check_bool("margins", margins)
    if tq == 0 or max_seqlen_k == 0:
        empty = torch.full((tq, topk), -1, dtype=torch.int32, device=ops.device)
        return _with_margins(empty, _nan_margins((tq,), ops.device) if margins else None)
    # Checked once for every chunk (as in indexer_select); a chunk's lengths and offsets are
    # derived from the caller's, checked above.
    if validate:
        ops.check_finite()
    if backend != "deepgemm":
        topk_backend = _resolve_topk_backend(
            _topk_backend(requested), device=ops.device, k=min(topk, max_seqlen_k),
            dtype=torch.float32,
        )  # fmt: skip
    step = _chunk_rows(chunk_bytes, tq, max_seqlen_k * _SELECT_BYTES_PER_SCORE)
    buf = _buffer(min(step, tq) * max_seqlen_k, backend, ops.device)

    def chunk_scores(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        part = ops.rows(r0, r1)
        if step >= tq:  # one chunk: the caller's lengths and offsets as they are (no slice)
            cu_chunk, off_chunk = cu_q, offsets
        else:  # int32 offsets: within int32, as the caller's offsets were checked to be
            cu_chunk, off_chunk = _varlen_row_slice(cu_q, offsets, r0, r1)
            off_chunk = off_chunk.to(torch.int32)
        # Each row's key window: DeepGEMM's ks / ke, and the top-k's lengths (one launch on CUDA).
        windows = _varlen_windows(cu_chunk, cu_k, off_chunk, ratio, r1 - r0)
        if backend == "deepgemm":  # DeepGEMM's logits in place, each row bounded by its length
            varlen = (cu_chunk, cu_k, max_seqlen_k)
            window = _deepgemm_select_input(part, off_chunk, ratio, varlen=varlen, windows=windows)
            # The window is not kept: its logits go with the scores.
            scores = window.rows_in_place()
            return scores, windows.counts, _window_topk_backend(scores, topk)
        assert buf is not None  # allocated for every backend but DeepGEMM
        scores = _thd_scores(
            part, cu_chunk, cu_k, min(max_seqlen_q, r1 - r0), max_seqlen_k, off_chunk, ratio,
            backend, buf[: (r1 - r0) * max_seqlen_k].view(r1 - r0, max_seqlen_k),
        )  # fmt: skip
        return scores, windows.counts, topk_backend

    return _select_chunks(chunk_scores, (), tq, step, topk, deterministic, margins, ops.device)
