"""Indexer scoring: :class:`~dsa_precision.ScoringOperands` in, float32 scores out.

    score[b, s, t] = sum_h relu(q[b, s, h] . k[b, t]) * w[b, s, h] * (sm_scale | k_descale[b, t])

with ``-inf`` at every key ``t >= limit(b, s)`` (the causal rows of :mod:`dsa_precision.rows`).

- :func:`indexer_scores`: BSHD, ``(B, S_q, S_k)``.
- :func:`indexer_scores_varlen`: packed THD, ``(T_q, max_seqlen_k)`` with sequence-local keys.

With ``clean=False`` both return a :class:`~dsa_precision.rows.WindowScores` instead: the scores
valid up to each row's causal limit, the rest as the kernel left them, and those limits (on
DeepGEMM its uncleaned call and nothing more; :func:`~dsa_precision.indexer_topk` reads it).

Both take prepared operands, or q / k / weights carriers, which they prepare first
(:func:`~dsa_precision.prepare_scoring_operands`: the fused Triton kernel for FP8 on CUDA). The
precision is the operands'; this module only chooses a kernel, and calls each in one place:
``_cudnn_scores`` (cuDNN's SM90 indexer, BF16 or FP8), ``_deepgemm_scores`` (DeepGEMM's MQA
logits, the engines' kernel: one launch per call, batch rows flattened into key windows) and
``_reference_scores`` (exact, float64, any device); :func:`_deepgemm_select_input` hands
DeepGEMM's logits to the top-k unmasked, with each row's length. :func:`_bshd_scores` and
:func:`_thd_scores` are the entry points past their checks (for :mod:`dsa_precision.select`,
which checks once per call, not once per chunk).
Nothing here waits for the host: lengths are Python ints, offsets stay on the device, and the
data-dependent checks run only with ``validate=True``.
"""

from __future__ import annotations

import warnings
from typing import Literal, TypedDict, Unpack, cast, overload

import torch
from typing_extensions import deprecated

from .audit import _record_scoring_call
from .backends import cudnn, deepgemm
from .checks import (
    _INT32_MAX,
    _check_bool,
    _check_positive_int,
    _check_tensor,
    _takes_precision_config,
)
from .config import (
    _FP8_HEAD_DIM,
    _FP8_N_HEADS,
    _SCORING_BACKENDS,
    IndexerPrecisionConfig,
    ScoringPrecision,
)
from .devices import _to_device
from .operands import ScoringOperands
from .prepare import _as_scoring_operands
from .rows import (
    WindowScores,
    _causal_offsets,
    _check_varlen_args,
    _constant_offsets,
    _varlen_key_counts,
    _varlen_windows,
    _VarlenWindows,
    causal_key_counts,
)

__all__ = [
    "Backend",
    "ResolvedBackend",
    "indexer_scores",
    "indexer_scores_varlen",
    "indexer_window_scores",
    "indexer_window_scores_varlen",
]

Backend = Literal["auto", "cudnn", "deepgemm", "torch"]
# A backend once resolved for the operands (resolve_scoring_backend).
ResolvedBackend = Literal["cudnn", "deepgemm", "torch"]

# Bytes of working memory per score element of the torch reference: a float64 accumulator and a
# float64 per-head product beside the float32 result.
_REFERENCE_BYTES_PER_SCORE = 20
_REFERENCE_CHUNK_BYTES = 1 << 28
# cuDNN binds tensors whose base address is 16-byte aligned.
_ALIGN_BYTES = 16


# ------------------------------------------------------------------------------------ helpers


@overload
def _aligned(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _aligned(t: None) -> None: ...
@overload
def _aligned(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous with a 16-byte aligned base (a row slice may start anywhere)."""
    if t is None:
        return None
    if t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    """``out`` must be a contiguous float32 tensor of ``shape`` on the operands' device."""
    if out is None:
        return
    _check_tensor("out", out)
    if (
        tuple(out.shape) != shape
        or out.dtype != torch.float32
        or not out.is_contiguous()
        or out.device != device
    ):
        raise ValueError(
            f"out must be a contiguous float32 tensor of shape {shape} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}."
        )


def _empty_scores(
    out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The scores of a call with no query rows or no keys (``out`` itself when given)."""
    if out is not None:
        return out.fill_(float("-inf"))
    return torch.full(shape, float("-inf"), dtype=torch.float32, device=device)


def _resolve_scoring_backend(
    backend: str, ops: ScoringOperands, *, writes_out: bool = False
) -> ResolvedBackend:
    """``"cudnn"``, ``"deepgemm"`` or ``"torch"`` for ``ops``; an explicit kernel backend that
    cannot run raises ``RuntimeError`` with the reason (it never falls back).

    ``"auto"`` takes the fastest exact kernel that can serve the call: DeepGEMM's MQA logits
    (the engines' own FP8 kernel) for FP8 operands when DeepGEMM is installed and supports the
    shape and the call does not write into ``out`` (``writes_out``), else cuDNN's SM90 kernel,
    else the torch reference in the same precision. The backends' logits are not bitwise the
    same (their FP8 accumulation orders differ; docs/numerics.md, section 7): the audit records
    which one ran (:func:`dsa_precision.scoring_calls`), and a pinned ``backend`` gives the same
    bits whatever else is installed."""
    if backend not in _SCORING_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a scoring backend; use one of {_SCORING_BACKENDS}."
        )
    _, _, h, d = ops.q.shape
    if ops.precision is ScoringPrecision.FP8 and (d != _FP8_HEAD_DIM or h not in _FP8_N_HEADS):
        raise ValueError(
            f"FP8 operands have {h} heads of width {d}; FP8 scoring takes {_FP8_N_HEADS[0]} or "
            f"{_FP8_N_HEADS[1]} heads of width {_FP8_HEAD_DIM}. Use scoring_precision='bf16'."
        )
    if backend == "torch":
        return "torch"
    if backend == "deepgemm" or (
        backend == "auto" and ops.precision is ScoringPrecision.FP8 and not writes_out
    ):
        reason = deepgemm._mqa_logits_unsupported_reason(
            device=ops.device, precision=ops.precision, n_heads=h, head_dim=d
        )
        if reason is None:
            return "deepgemm"
        if backend == "deepgemm":
            raise RuntimeError(f"backend='deepgemm' cannot score this call: {reason}.")
    reason = cudnn._scoring_reason(ops.device, ops.precision, h, d, 1)
    if reason is None:
        return "cudnn"
    if backend == "cudnn":
        raise RuntimeError(
            f"backend='cudnn' cannot score this call: {reason}. Use backend='torch' (the "
            "reference, same precision) or backend='auto'."
        )
    return "torch"


# ---------------------------------------------------------------------------- the kernels


class _ThdArgs(TypedDict, total=False):
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _cudnn_scores(
    ops: ScoringOperands,
    offsets: torch.Tensor,
    ratio: int,
    out: torch.Tensor | None,
    **thd: Unpack[_ThdArgs],
) -> torch.Tensor:
    """One cuDNN ``indexer_forward_wrapper`` launch: the only call of that kernel in the package.

    BSHD: ``ops`` as is. THD (``thd`` holds cu_seqlens and max lengths): batch 1, flattened.
    """
    q, k, w = ops.q, ops.k.unsqueeze(2), ops.weights
    qs, ks = ops.q_descale, None if ops.k_descale is None else ops.k_descale.unsqueeze(-1)
    if thd:
        q, k, w = q[0], k[0], w[0]
        qs, ks = (None, None) if qs is None or ks is None else (qs[0], ks[0])
    with cudnn._device_scope(q.device):
        return cudnn.dsa().indexer_forward_wrapper(
            _aligned(q),
            _aligned(k),
            _aligned(w),
            ratio=ratio,
            sm_scale=ops.sm_scale,
            out=out,
            q_causal_offsets=offsets,
            precision=ops.precision.value,
            q_scale=_aligned(qs),
            k_scale=_aligned(ks),
            **thd,
        )["scores"]


def _deepgemm_scores(
    ops: ScoringOperands,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    columns: int,
    counts: torch.Tensor,
) -> WindowScores:
    """One DeepGEMM launch for every query row of ``ops`` (with the ``B = 1`` scores of
    :func:`indexer_scores`, the only DeepGEMM call here): batch rows flattened, row
    ``b * S_q + s`` against its window ``[key_start, key_end)`` of the flattened keys
    ``(B * S_k,)``, ``counts = key_end - key_start``; the logits as the kernel left them (no
    copy, no mask)."""
    b, sq, h, d = ops.q.shape
    assert ops.k_descale is not None  # DeepGEMM scores FP8 operands only
    q = _aligned(ops.q.reshape(b * sq, h, d))
    kv = (_aligned(ops.k.reshape(-1, d)), _aligned(ops.k_descale.reshape(-1)))
    w = _aligned(ops.weights.reshape(b * sq, h))
    start = key_start.to(torch.int32).contiguous()
    end = key_end.to(torch.int32).contiguous()
    with cudnn._device_scope(ops.device):
        return deepgemm._window_logits(q, kv, w, start, end, columns, counts)


def _deepgemm_causal_windows(
    ops: ScoringOperands, offsets: torch.Tensor, ratio: int, counts: torch.Tensor | None = None
) -> WindowScores:
    """BSHD: each row ``(b, s)`` against keys ``[0, limit(b, s))`` of batch row ``b``; column ``j``
    is key ``j``. With ``seq_lens=counts`` the top-k reads the logits in place. ``counts``: the
    ``(B * S_q,)`` int32 limits, when the caller has them (shared constants of an int offset);
    at ``B = 1`` the windows are then built by no launch."""
    b, sq = ops.q.shape[:2]
    sk = ops.k.shape[1]
    if counts is None:
        counts = causal_key_counts(offsets, 0, sq, ratio, sk).view(-1)
    if b == 1:  # windows [0, count): the shared zeros, and the counts themselves as their ends
        return _deepgemm_scores(ops, _constant_offsets(0, sq, ops.device), counts, sk, counts)
    start = torch.arange(b * sq, device=ops.device).div_(sq, rounding_mode="floor").mul_(sk)
    return _deepgemm_scores(ops, start, start + counts, sk, counts)


def _deepgemm_varlen_windows(
    ops: ScoringOperands,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    offsets: torch.Tensor,
    ratio: int,
    max_seqlen_k: int,
    windows: _VarlenWindows | None = None,
) -> WindowScores:
    """THD: each packed row against its sequence's keys up to its causal limit, sequence-local
    columns. ``windows``: the rows' :func:`~dsa_precision.rows._varlen_windows`, when the caller
    has them (else built here: one launch on CUDA)."""
    if windows is None:
        windows = _varlen_windows(cu_q, cu_k, offsets, ratio, ops.q.shape[1])
    return _deepgemm_scores(ops, windows.start, windows.end, max_seqlen_k, windows.counts)


def _deepgemm_select_input(
    ops: ScoringOperands,
    offsets: torch.Tensor,
    ratio: int,
    *,
    varlen: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    counts: torch.Tensor | None = None,
    windows: _VarlenWindows | None = None,
) -> WindowScores:
    """The top-k's input on ``backend="deepgemm"`` (for :mod:`dsa_precision.select`, which has
    checked the arguments and, with ``validate``, the operands): DeepGEMM's uncleaned logits of
    ``ops`` and each row's length, BSHD or, with ``varlen = (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_k)``, packed. The caller has resolved the backend to DeepGEMM. ``counts`` (BSHD):
    the rows' causal key counts if the caller has them (read only; BSHD then reads no offsets);
    ``windows`` (THD): the rows' :func:`~dsa_precision.rows._varlen_windows` likewise."""
    _record_scoring_call(ops.precision.value, "deepgemm")
    if varlen is None:
        return _deepgemm_causal_windows(ops, offsets, ratio, counts)
    cu_q, cu_k, max_seqlen_k = varlen
    return _deepgemm_varlen_windows(ops, cu_q, cu_k, offsets, ratio, max_seqlen_k, windows)


def _reference_scores(
    ops: ScoringOperands, offsets: torch.Tensor, ratio: int, out: torch.Tensor
) -> torch.Tensor:
    """Exact scores into ``out`` ``(B, S_q, S_k)``, in row chunks that bound float64 memory.

    Products of BF16 or E4M3 values are exact in float64 and so are their sums over ``D``
    (unless the magnitudes span more than ~2**29), so the result does not depend on chunking,
    batch split or device; heads are summed in a fixed order and the float64 total is rounded to
    float32 once. A non-finite query row, head weight, key or key descale scores NaN (before the
    causal mask), so non-finite operands never become selectable scores.
    """
    b, sq, h, _ = ops.q.shape
    sk = ops.k.shape[1]
    k64 = ops.k.to(torch.float64).transpose(1, 2)  # (B, D, S_k), exact
    scale = None if ops.k_descale is None else ops.k_descale.to(torch.float64).unsqueeze(1)
    # A non-finite key (or key descale) scores NaN, never +-inf or a ReLU-clipped 0, so that it
    # can never be selected; likewise a non-finite query row or head weight, below.
    bad_keys = ~torch.isfinite(k64).all(1)
    if scale is not None:
        bad_keys |= ~torch.isfinite(scale[:, 0])
    step = max(1, _REFERENCE_CHUNK_BYTES // max(1, b * sk * _REFERENCE_BYTES_PER_SCORE))
    keys = torch.arange(sk, device=ops.device)
    for r0 in range(0, sq, step):
        r1 = min(r0 + step, sq)
        q64 = ops.q[:, r0:r1].to(torch.float64)
        w64 = ops.weights[:, r0:r1].to(torch.float64)
        acc = torch.zeros(b, r1 - r0, sk, dtype=torch.float64, device=ops.device)
        for head in range(h):
            dots = torch.bmm(q64[:, :, head], k64)
            acc.add_(dots.clamp_min_(0.0).mul_(w64[:, :, head, None]))
        acc = acc.mul_(ops.sm_scale) if scale is None else acc.mul_(scale)
        bad_rows = ~(torch.isfinite(q64).all(-1).all(-1) & torch.isfinite(w64).all(-1))
        acc.masked_fill_(bad_rows.unsqueeze(-1) | bad_keys.unsqueeze(1), float("nan"))
        limits = causal_key_counts(offsets, r0, r1 - r0, ratio, sk)
        out[:, r0:r1] = acc.to(torch.float32).masked_fill_(
            keys >= limits.unsqueeze(-1), float("-inf")
        )
    return out


_BSHD, _THD = "indexer_scores", "indexer_scores_varlen"


def _operands(ops: object, entry: str) -> ScoringOperands:
    """``ops`` if prepared operands, else ``TypeError`` naming the preparing step."""
    if not isinstance(ops, ScoringOperands):
        raise TypeError(
            f"{entry}() takes prepared ScoringOperands, got {type(ops).__name__}; build them with "
            "dsa_precision.prepare_scoring_operands(q, k, weights, config=...)."
        )
    return ops


def _warn_clean(entry: str, replacement: str) -> None:
    warnings.warn(
        f"{entry}(..., clean=False) is deprecated: call dsa_precision.{replacement}(operands, "
        "...), which returns the WindowScores.",
        DeprecationWarning,
        stacklevel=4,  # the caller of the public entry (through its keyword-check wrapper)
    )


# ------------------------------------------------------------------------------------- BSHD


@overload
def indexer_scores(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: Literal[True] = True,
) -> torch.Tensor: ...
@overload
@deprecated(
    "indexer_scores(..., clean=False) is deprecated: call indexer_window_scores(operands, ...)"
)
def indexer_scores(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: Literal[False],
) -> WindowScores: ...
@_takes_precision_config
def indexer_scores(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: bool = True,
) -> torch.Tensor | WindowScores:
    """Lightning-indexer scores of BSHD operands (see the module docstring for the math).

    Arguments:
        q: :class:`~dsa_precision.ScoringOperands`, or ``(B, S_q, H, 128)`` preprocessed queries
            (bfloat16 or an FP32 carrier), prepared with ``k``, ``weights``, ``config`` and
            ``sm_scale`` by :func:`~dsa_precision.prepare_scoring_operands`.
        k: ``(B, S_k, 128)`` keys (carriers only).
        weights: ``(B, S_q, H)`` head weights, already scaled by ``H**-0.5 * D**-0.5``
            (carriers only).
        config: the :class:`~dsa_precision.IndexerPrecisionConfig` whose scoring precision and
            engine (FP8 quantization rules) prepare the carriers; with operands, optional (they
            carry their precision; a different one raises).
        sm_scale: extra score scale (carriers only; 1.0 for Megatron).
        ratio: key compression ratio of the causal mask (1: one key per token).
        q_causal_offsets: global index of each batch row's query 0: an int or a ``(B,)`` integer
            tensor (0 by default).
        backend: ``None`` (default): the operands' kernel, i.e. their config's
            ``scoring_backend``; else, for this call, ``"cudnn"`` (SM90 kernel), ``"deepgemm"``
            (DeepGEMM's MQA logits, FP8 only), ``"torch"`` (exact reference, any device) or
            ``"auto"`` (the fastest that can serve the call: DeepGEMM for FP8 when installed and
            ``out`` is not given, else cuDNN, else torch). An explicit kernel backend that cannot
            run raises.
        out: optional contiguous float32 ``(B, S_q, S_k)`` to write into (cuDNN, torch).
        validate: check the data too (offsets in range before their int32 cast, finite
            operands); this synchronises with the host, so it is off by default.
        clean: ``-inf`` at every key past a row's causal limit (default). ``False`` returns a
            :class:`~dsa_precision.rows.WindowScores`: the same scores up to each row's limit,
            past it whatever the kernel left there, and the limits, ``(B, S_q)`` int32. On
            DeepGEMM that is its uncleaned call and nothing else (no cleaning kernel, no mask);
            cuDNN and torch write ``-inf`` there anyway.

    Returns:
        float32 ``(B, S_q, S_k)`` with ``-inf`` at every key ``t >= limit(b, s)``: cuDNN's own
        output buffer (or ``out``), never a copy. DeepGEMM: its own buffer, whose rows are padded
        (a strided view; one launch for all batch rows, ``-inf`` written by DeepGEMM's cleaning
        at ``B = 1`` and by one mask of the unwritten tails otherwise). With ``clean=False``, a
        :class:`~dsa_precision.rows.WindowScores` of those scores.
    """
    ops = _as_scoring_operands(q, k, weights, config=config, sm_scale=sm_scale, entry=_BSHD)
    if not _check_bool("clean", clean):  # a truthy "False" would return the other type
        _warn_clean(_BSHD, "indexer_window_scores")
    return _bshd_call(ops, ratio, q_causal_offsets, backend, out, validate, clean)


def indexer_window_scores(
    ops: ScoringOperands,
    *,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
) -> WindowScores:
    """:func:`indexer_scores` of prepared operands without the cleaning past each row's causal
    limit: a :class:`~dsa_precision.rows.WindowScores`, the scores ``(B, S_q, S_k)`` float32
    (up to each row's limit the same as :func:`indexer_scores`', past it whatever the kernel
    left there) and the limits ``(B, S_q)`` int32, what :func:`~dsa_precision.indexer_topk` reads
    in place. On DeepGEMM that is its uncleaned call and nothing else (no cleaning kernel, no
    mask); cuDNN and torch write ``-inf`` there anyway. Arguments as for
    :func:`indexer_scores`."""
    return cast(
        WindowScores,
        _bshd_call(_operands(ops, "indexer_window_scores"), ratio, q_causal_offsets, backend,
                   out, validate, False),
    )  # fmt: skip


def _bshd_call(
    ops: ScoringOperands,
    ratio: int,
    q_causal_offsets: torch.Tensor | int | None,
    backend: Backend | None,
    out: torch.Tensor | None,
    validate: bool,
    clean: bool,
) -> torch.Tensor | WindowScores:
    """The body of :func:`indexer_scores` and :func:`indexer_window_scores`."""
    ratio = _check_positive_int("ratio", ratio, high=_INT32_MAX)
    validate = _check_bool("validate", validate)  # a truthy "no" would read the data
    b, sq, _, _ = ops.q.shape
    sk = ops.k.shape[1]
    offsets = _causal_offsets(
        q_causal_offsets, b, ops.device, "batch row", rows=sq, validate=validate
    )
    if validate:
        ops.check_finite()
    _check_out(out, (b, sq, sk), ops.device)
    requested = ops.backend if backend is None else backend
    backend = _resolve_scoring_backend(requested, ops, writes_out=out is not None)
    if backend == "deepgemm" and out is not None:
        raise ValueError("backend='deepgemm' returns DeepGEMM's own buffer; pass out=None.")
    if clean:
        return _bshd_scores(ops, offsets, ratio, backend, out)
    if backend == "deepgemm" and sq and sk:
        _record_scoring_call(ops.precision.value, backend)
        window = _deepgemm_causal_windows(ops, offsets, ratio)
        return WindowScores(window.scores.view(b, sq, sk), window.lengths.view(b, sq))
    scores = _bshd_scores(ops, offsets, ratio, backend, out)
    return WindowScores(scores, causal_key_counts(offsets, 0, sq, ratio, sk))


def _bshd_scores(
    ops: ScoringOperands,
    offsets: torch.Tensor,
    ratio: int,
    backend: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`indexer_scores` once its arguments are checked (for :mod:`dsa_precision.select`,
    which checks them once per call, not once per chunk): ``offsets`` int32 ``(B,)`` on the
    operands' device and in range, ``ratio`` a positive int, ``backend`` resolved for ``ops``
    (:func:`_resolve_scoring_backend`), ``out`` ``None`` or checked (and ``None`` for DeepGEMM)."""
    b, sq, _, _ = ops.q.shape
    sk = ops.k.shape[1]
    _record_scoring_call(ops.precision.value, backend)
    if sq == 0 or sk == 0:
        return _empty_scores(out, (b, sq, sk), ops.device)
    if backend == "cudnn":
        return _cudnn_scores(ops, offsets, ratio, out)
    if backend == "deepgemm":
        assert ops.k_descale is not None  # DeepGEMM scores FP8 operands only
        if b == 1:  # windows from key 0: DeepGEMM's own cleaning, one launch each
            ends = causal_key_counts(offsets, 0, sq, ratio, sk).view(-1)
            kv = (_aligned(ops.k[0]), _aligned(ops.k_descale[0]))
            with cudnn._device_scope(ops.device):
                logits = deepgemm._causal_logits(
                    _aligned(ops.q[0]), kv, _aligned(ops.weights[0]), ends
                )
            return logits.unsqueeze(0)
        return _deepgemm_causal_windows(ops, offsets, ratio).masked().view(b, sq, sk)
    if out is None:
        out = torch.empty((b, sq, sk), dtype=torch.float32, device=ops.device)
    return _reference_scores(ops, offsets, ratio, out)


# -------------------------------------------------------------------------------------- THD


@overload
def indexer_scores_varlen(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: Literal[True] = True,
) -> torch.Tensor: ...
@overload
@deprecated(
    "indexer_scores_varlen(..., clean=False) is deprecated: call indexer_window_scores_varlen(operands, ...)"
)
def indexer_scores_varlen(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: Literal[False],
) -> WindowScores: ...
@_takes_precision_config
def indexer_scores_varlen(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
    clean: bool = True,
) -> torch.Tensor | WindowScores:
    """Lightning-indexer scores of packed (THD) sequences.

    Arguments as for :func:`indexer_scores`, except:
        q: ScoringOperands of batch 1 (the packed tokens), or ``(T_q, H, 128)`` carriers with
            ``k`` ``(T_k, 128)`` and ``weights`` ``(T_q, H)``.
        cu_seqlens_q, cu_seqlens_k: ``(n + 1,)`` int32/int64 cumulative lengths on the
            operands' device.
        max_seqlen_q, max_seqlen_k: Python ints bounding the sequence lengths (as for
            ``flash_attn_varlen_func``; no host sync reads them from the tensors).
        q_causal_offsets: global index of each sequence's query 0 (an int or ``(n,)`` tensor).
        out: optional contiguous float32 ``(T_q, max_seqlen_k)`` to write into (cuDNN, torch).
        clean: as for :func:`indexer_scores`; ``False`` gives a
            :class:`~dsa_precision.rows.WindowScores` with ``(T_q,)`` limits (on DeepGEMM its
            compressed uncleaned call, which DeepGEMM cannot clean itself, and the rows' windows).

    Returns:
        float32 ``(T_q, max_seqlen_k)``: row ``t`` of sequence ``i`` scores that sequence's keys
        ``0 .. max_seqlen_k - 1`` (sequence-local), ``-inf`` from its causal limit on. With
        ``clean=False``, a :class:`~dsa_precision.rows.WindowScores` of those scores.
    """
    if not isinstance(q, ScoringOperands):
        if k is None or weights is None:
            raise ValueError("carriers need q, k and weights; or pass ScoringOperands.")
        if q.ndim != 3 or k.ndim not in (2, 3) or weights.ndim != 2:
            raise ValueError(
                "packed (THD) input expects q (T_q, H, D), k (T_k, D) and weights (T_q, H); got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}."
            )
        q, weights = q.unsqueeze(0), weights.unsqueeze(0)
        k = k.reshape(1, k.shape[0], k.shape[-1])  # (T_k, D) or (T_k, 1, D); T_k may be 0
    ops = _as_scoring_operands(q, k, weights, config=config, sm_scale=sm_scale, entry=_THD)
    if not _check_bool("clean", clean):  # a truthy "False" would return the other type
        _warn_clean(_THD, "indexer_window_scores_varlen")
    return _thd_call(
        ops, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ratio, q_causal_offsets,
        backend, out, validate, clean,
    )  # fmt: skip


def indexer_window_scores_varlen(
    ops: ScoringOperands,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    ratio: int = 1,
    q_causal_offsets: torch.Tensor | int | None = None,
    backend: Backend | None = None,
    out: torch.Tensor | None = None,
    validate: bool = False,
) -> WindowScores:
    """:func:`indexer_window_scores` for packed (THD) operands (batch 1): the scores
    ``(T_q, max_seqlen_k)`` of :func:`indexer_scores_varlen` uncleaned past each row's causal
    limit, and the limits ``(T_q,)`` int32 (on DeepGEMM its compressed uncleaned call, which
    DeepGEMM cannot clean itself, and the rows' windows). Arguments as for
    :func:`indexer_scores_varlen`."""
    return cast(
        WindowScores,
        _thd_call(
            _operands(ops, "indexer_window_scores_varlen"), cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, ratio, q_causal_offsets, backend, out, validate, False,
        ),
    )  # fmt: skip


def _thd_call(
    ops: ScoringOperands,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    ratio: int,
    q_causal_offsets: torch.Tensor | int | None,
    backend: Backend | None,
    out: torch.Tensor | None,
    validate: bool,
    clean: bool,
) -> torch.Tensor | WindowScores:
    """The body of :func:`indexer_scores_varlen` and :func:`indexer_window_scores_varlen`."""
    if ops.q.shape[0] != 1:
        raise ValueError(f"packed operands have batch 1, got q {tuple(ops.q.shape)}.")
    ratio = _check_positive_int("ratio", ratio, high=_INT32_MAX)
    validate = _check_bool("validate", validate)  # a truthy "no" would read the data
    n_seq = cu_seqlens_q.numel() - 1
    tq, tk = ops.q.shape[1], ops.k.shape[1]
    _check_varlen_args(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device=ops.device, total_q=tq,
        total_k=tk, validate=validate,
    )  # fmt: skip
    offsets = _causal_offsets(
        q_causal_offsets, n_seq, ops.device, "packed sequence", rows=max_seqlen_q, validate=validate
    )
    if validate:
        ops.check_finite()
    _check_out(out, (tq, max_seqlen_k), ops.device)
    requested = ops.backend if backend is None else backend
    backend = _resolve_scoring_backend(requested, ops, writes_out=out is not None)
    if backend == "deepgemm" and out is not None:
        raise ValueError("backend='deepgemm' returns its own (gathered) scores; pass out=None.")
    cu_q = _to_device(cu_seqlens_q, ops.device, torch.int32)
    cu_k = _to_device(cu_seqlens_k, ops.device, torch.int32)
    if clean:
        return _thd_scores(
            ops, cu_q, cu_k, max_seqlen_q, max_seqlen_k, offsets, ratio, backend, out
        )
    if backend == "deepgemm" and tq and max_seqlen_k:
        _record_scoring_call(ops.precision.value, backend)
        return _deepgemm_varlen_windows(ops, cu_q, cu_k, offsets, ratio, max_seqlen_k)
    scores = _thd_scores(ops, cu_q, cu_k, max_seqlen_q, max_seqlen_k, offsets, ratio, backend, out)
    return WindowScores(scores, _varlen_key_counts(cu_q, cu_k, offsets, ratio, tq))


def _thd_scores(
    ops: ScoringOperands,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    offsets: torch.Tensor,
    ratio: int,
    backend: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`indexer_scores_varlen` once its arguments are checked (for
    :mod:`dsa_precision.select`, which checks them once per call): ``ops`` of batch 1, ``cu_q`` /
    ``cu_k`` int32 on the operands' device, ``offsets`` int32 ``(n,)`` there, ``backend``
    resolved, ``out`` ``None`` or checked (``None`` for DeepGEMM)."""
    tq = ops.q.shape[1]
    n_seq = cu_q.numel() - 1
    _record_scoring_call(ops.precision.value, backend)
    if tq == 0 or max_seqlen_k == 0:
        return _empty_scores(out, (tq, max_seqlen_k), ops.device)
    if backend == "cudnn":
        return _cudnn_scores(
            ops,
            offsets,
            ratio,
            out,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )
    if backend == "deepgemm":
        return _deepgemm_varlen_windows(ops, cu_q, cu_k, offsets, ratio, max_seqlen_k).masked()
    # Reference: each sequence as a batch-1 BSHD block (host loop over the lengths).
    if out is None:
        out = torch.empty((tq, max_seqlen_k), dtype=torch.float32, device=ops.device)
    out.fill_(float("-inf"))
    q_starts, k_starts = cu_q.tolist(), cu_k.tolist()
    for i in range(n_seq):
        q0, q1, k0, k1 = q_starts[i], q_starts[i + 1], k_starts[i], k_starts[i + 1]
        if q1 > q0 and k1 > k0:
            part = ScoringOperands(
                ops.q[:, q0:q1],
                ops.k[:, k0:k1],
                ops.weights[:, q0:q1],
                None if ops.q_descale is None else ops.q_descale[:, q0:q1],
                None if ops.k_descale is None else ops.k_descale[:, k0:k1],
                ops.sm_scale,
            )
            _reference_scores(part, offsets[i : i + 1], ratio, out[None, q0:q1, : k1 - k0])
    return out
