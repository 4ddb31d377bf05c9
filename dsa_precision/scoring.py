"""Indexer scoring: ``score[s, t] = sum_h relu(q[s, h] . k[t]) * w[s, h]``, causal, in BF16 or FP8.

:func:`_indexer_forward` is the package's single scoring choke point: it rounds the operands to
BF16 or quantizes them to E4M3/UE8M0, then runs cuDNN's SM90 indexer kernel or the torch
reference over row chunks. :func:`indexer_scores` is its public face.

The math, per precision (``sm_scale`` is ``s``; ``qs``/``ks`` are the UE8M0 descales)::

    bf16: score = s * sum_h relu(bf16(q_h) . bf16(k)) * w_h
    fp8:  w'_h  = fp32(fp32(w_h) * qs_h) * s                 # folded once, in float32
          score = ks * sum_h relu(e4m3(q_h) . e4m3(k)) * w'_h

and ``score[s, t] = -inf`` where ``t >= floor((offset + s + 1) / ratio)`` or ``t >= S_k``
(top-left causal; ``offset`` per batch row or packed sequence, for chunks and context parallelism).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch

from . import _cudnn
from ._checks import (
    check_float_dtype,
    check_int_tensor,
    check_positive_int,
    check_same_device,
    check_tensor,
)
from .audit import record_scoring_call
from .config import FP8_HEAD_DIM, FP8_N_HEADS, ScoringPrecision
from .quantize import DEFAULT_AMAX_FLOOR, quantize_e4m3_ue8m0

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Backend",
    "ScoringOperands",
    "indexer_scores",
    "prepare_scoring_operands",
    "resolve_scoring_backend",
]

Backend = Literal["auto", "cudnn", "torch"]
_BACKENDS = ("auto", "cudnn", "torch")

# Byte budget of the per-chunk score buffers (Megatron's cuDNN path uses the same 1 GiB).
DEFAULT_CHUNK_BYTES = 1 << 30
# Bytes of working memory per score element: cuDNN writes float32; the torch reference keeps a
# float64 accumulator and a float64 per-head product beside the float32 result.
_BYTES_PER_SCORE = {"cudnn": 4, "torch": 20}
# Chunks start on multiples of this many rows when the budget allows (as Megatron's cuDNN path
# does), and on multiples of the kernel's query tile (at most 8 tokens) otherwise.
_CHUNK_ROW_ALIGNMENT = 512
_CHUNK_ROW_MIN_ALIGNMENT = 8
_CARRIER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class ScoringOperands:
    """What reaches the kernel: rounded or quantized once, shared by every row chunk.

    Always 4-D with a batch dimension (packed THD input uses batch 1): q ``[B, S_q, H, D]``,
    k ``[B, S_k, 1, D]``, w ``[B, S_q, H]``, q_scale ``[B, S_q, H]``, k_scale ``[B, S_k, 1]``, all
    contiguous. ``k`` is the cached key: its BF16 / E4M3 values, never the FP32 carrier. Built by
    the choke point from carriers, or directly by a fused preprocess-and-quantize kernel and passed
    to it as ``operands=``.
    """

    precision: ScoringPrecision
    q: torch.Tensor  # bf16 | float8_e4m3fn
    k: torch.Tensor  # bf16 | float8_e4m3fn
    w: torch.Tensor  # bf16 | float32 (fp8: float32, q descale and sm_scale folded in)
    q_scale: torch.Tensor | None  # float32 descale (fp8)
    k_scale: torch.Tensor | None  # float32 descale (fp8)
    sm_scale: float  # applied by the kernel (fp8: 1.0, already folded into w)
    # [B, S_k] keys whose k vector is non-finite, when some are and the operands cannot carry it
    # (BF16: the kernel's ReLU is fmax, which turns NaN into 0); None otherwise.
    bad_keys: torch.Tensor | None = None


def _chunk_rows(budget: int, bytes_per_row: int) -> int:
    """Query rows per chunk: within ``budget`` bytes, aligned to whole kernel tiles."""
    rows = budget // max(bytes_per_row, 1)
    for align in (_CHUNK_ROW_ALIGNMENT, _CHUNK_ROW_MIN_ALIGNMENT):
        if rows >= align:
            return rows // align * align
    return _CHUNK_ROW_MIN_ALIGNMENT  # a budget below one tile: one tile per chunk


def _prepare_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    precision: ScoringPrecision,
    sm_scale: float,
    amax_floor: float,
) -> ScoringOperands:
    if precision is ScoringPrecision.BF16:
        # FP32 carriers are rounded to BF16 here, so BF16 scoring means BF16 operands whatever
        # the carrier dtype.
        w_op = w if w.dtype in (torch.bfloat16, torch.float32) else w.to(torch.float32)
        # Non-finite inputs must give non-finite scores (the kernel's fmax-ReLU would map a NaN
        # dot product to 0): a bad query row gets NaN head weights, so every score of the row is
        # NaN; bad keys are recorded and their columns set to NaN after scoring.
        bad_rows = ~torch.isfinite(q).all(dim=-1).all(dim=-1)
        w_op = w_op.masked_fill(bad_rows.unsqueeze(-1), float("nan"))
        bad_keys = ~torch.isfinite(k).all(dim=-1).all(dim=-1)
        return ScoringOperands(
            precision,
            q.to(torch.bfloat16).contiguous(),
            k.to(torch.bfloat16).contiguous(),
            w_op.contiguous(),
            None,
            None,
            sm_scale,
            bad_keys if bool(bad_keys.any()) else None,  # one small host sync
        )
    # FP8: the quantizer gives a non-finite vector a NaN descale; folded into the weights (q) or
    # applied per key (k), it makes the affected scores NaN on every backend.
    q_fp8, q_scale = quantize_e4m3_ue8m0(q, amax_floor)
    k_fp8, k_scale = quantize_e4m3_ue8m0(k, amax_floor)
    # Fold the q descale (a power of two: exact) and the score scale into FP32 head weights,
    # as the inference indexer does; the kernel then applies the k descale per key.
    w_fold = (w.to(torch.float32) * q_scale) * sm_scale
    return ScoringOperands(
        precision,
        q_fp8.contiguous(),
        k_fp8.contiguous(),
        w_fold.contiguous(),
        q_scale.contiguous(),
        k_scale.contiguous(),
        1.0,
    )


def _fresh(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as its own contiguous allocation: cuDNN's kernels need 16-byte aligned bases, which a
    row slice of a packed tensor (e.g. one key scale per token) does not guarantee."""
    if t is None or (t.is_contiguous() and t.storage_offset() == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def prepare_scoring_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    scoring_precision: ScoringPrecision | str,
    sm_scale: float = 1.0,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
    packed: bool = False,
) -> ScoringOperands:
    """The reference operand preparation of :func:`indexer_scores` (BF16 rounding or E4M3/UE8M0
    quantization with weight folding), e.g. to check a fused kernel that builds
    :class:`ScoringOperands` itself. Arguments as for :func:`indexer_scores`; ``packed`` for THD
    layouts."""
    precision = ScoringPrecision.parse(scoring_precision)
    q4, k4, w3 = _carriers_to_4d(q, k, weights, packed)
    return _prepare_operands(q4, k4, w3, precision, float(sm_scale), amax_floor)


def _row_limits(
    offsets: torch.Tensor, row_start: int, rows: int, ratio: int, sk: int
) -> torch.Tensor:
    """``[B, rows]`` int64 count of visible keys: ``min(floor((offset + s + 1) / ratio), S_k)``."""
    s = torch.arange(row_start + 1, row_start + rows + 1, device=offsets.device)
    return torch.div(offsets.view(-1, 1) + s, ratio, rounding_mode="floor").clamp(max=sk)


def _reference_scores(
    ops: ScoringOperands,
    q: torch.Tensor,
    w: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    limits: torch.Tensor,
) -> torch.Tensor:
    """Torch reference for one row chunk: ``[B, r, S_k]`` float32.

    ``q`` ``[B, r, H, D]`` and ``w`` ``[B, r, H]`` are chunk slices of the operands; ``k_cache``
    ``[B, D, S_k]`` float64 holds the operand key exactly. Products of BF16 or E4M3 values are
    exact in float64 and their sums over ``D`` are too (unless the magnitudes span more than ~2**29),
    so the result does not depend on chunking, batch split or device; heads are summed in a fixed
    order and the float64 total is rounded to float32 once.
    """
    b, r, h, _ = q.shape
    q64 = q.to(torch.float64)
    w64 = w.to(torch.float64)
    acc = torch.zeros(b, r, k_cache.shape[-1], dtype=torch.float64, device=q.device)
    for head in range(h):
        dots = torch.bmm(q64[:, :, head], k_cache)
        acc.add_(dots.clamp_min_(0.0).mul_(w64[:, :, head, None]))
    if ops.precision is ScoringPrecision.BF16:
        acc.mul_(ops.sm_scale)
    else:
        acc.mul_(k_scale.to(torch.float64).unsqueeze(1))
    scores = acc.to(torch.float32)
    keys = torch.arange(scores.shape[-1], device=q.device)
    return scores.masked_fill_(keys >= limits.unsqueeze(-1), float("-inf"))


def _cudnn_scores(
    ops: ScoringOperands,
    q: torch.Tensor,
    w: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    offsets: torch.Tensor,
    ratio: int,
    **thd: object,
) -> torch.Tensor:
    """One cuDNN ``indexer_forward_wrapper`` launch; the only call of that kernel in the package."""
    with _cudnn.device_scope(q.device):
        return _cudnn.dsa().indexer_forward_wrapper(
            q,
            k,
            w,
            ratio=ratio,
            sm_scale=ops.sm_scale,
            q_causal_offsets=offsets.to(torch.int32).contiguous(),
            precision=ops.precision.value,
            q_scale=q_scale,
            k_scale=k_scale,
            **thd,
        )["scores"]


def _score_rows(
    ops: ScoringOperands,
    backend: str,
    *,
    b_slice: slice,
    q_rows: slice,
    k_rows: slice,
    offsets: torch.Tensor,
    ratio: int,
    chunk_rows: int,
    emit: Callable[[int, torch.Tensor], None],
) -> None:
    """Score one BSHD block (``b_slice`` of the batch; for THD a single packed sequence, B = 1)
    in chunks of ``chunk_rows`` query rows, passing ``(row_start, scores [B, r, S_k])`` to
    ``emit``. Each chunk keeps global causal rows via ``offsets + row_start``."""
    q_all, w_all = ops.q[b_slice, q_rows], ops.w[b_slice, q_rows]
    k = ops.k[b_slice, k_rows]
    qs_all = None if ops.q_scale is None else ops.q_scale[b_slice, q_rows]
    ks = None if ops.k_scale is None else ops.k_scale[b_slice, k_rows]
    sq, sk = q_all.shape[1], k.shape[1]
    bad_keys = None if ops.bad_keys is None else ops.bad_keys[b_slice, k_rows]
    # The key is cast once and reused by every chunk; it holds the operand (BF16 / E4M3) values.
    k_cache = None
    if backend == "cudnn":
        k, ks = _fresh(k), _fresh(ks)
    else:
        k_cache = k[:, :, 0, :].to(torch.float64).transpose(1, 2).contiguous()
    for row_start in range(0, sq, chunk_rows):
        rows = slice(row_start, min(row_start + chunk_rows, sq))
        q, w = q_all[:, rows], w_all[:, rows]
        if backend == "torch":
            limits = _row_limits(offsets, row_start, q.shape[1], ratio, sk)
            scores = _reference_scores(
                ops, q, w, k_cache, None if ks is None else ks[..., 0], limits
            )
        else:
            qs = None if qs_all is None else qs_all[:, rows]
            scores = _cudnn_scores(
                ops, _fresh(q), _fresh(w), _fresh(qs), k, ks, offsets + row_start, ratio
            )
        if bad_keys is not None:
            scores = _poison_keys(scores, bad_keys)
        emit(row_start, scores)
        del scores  # free this chunk before the next one is allocated


def _poison_keys(scores: torch.Tensor, bad_keys: torch.Tensor) -> torch.Tensor:
    """NaN at every visible (finite) score of a key whose k vector was non-finite."""
    poison = bad_keys[:, None, : scores.shape[-1]] & torch.isfinite(scores)
    return scores.masked_fill_(poison, float("nan"))


def resolve_scoring_backend(
    backend: str,
    *,
    device: torch.device,
    precision: ScoringPrecision,
    n_heads: int,
    head_dim: int,
    n_kv_heads: int = 1,
) -> str:
    """``"cudnn"`` or ``"torch"`` for a scoring call; an explicit ``"cudnn"`` that cannot run
    raises ``RuntimeError`` with the reason (it never falls back)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not a scoring backend; use one of {_BACKENDS}.")
    if backend == "torch":
        return "torch"
    reason = _cudnn.scoring_unsupported_reason(
        device=device,
        precision=precision,
        n_heads=n_heads,
        head_dim=head_dim,
        n_kv_heads=n_kv_heads,
    )
    if reason is None:
        return "cudnn"
    if backend == "cudnn":
        raise RuntimeError(
            f"backend='cudnn' cannot score this call: {reason}. Use backend='torch' (the "
            "reference, same precision) or backend='auto'."
        )
    return "torch"


def _as_offsets(
    q_causal_offsets: torch.Tensor | int | None, n: int, device: torch.device, what: str
) -> torch.Tensor:
    if q_causal_offsets is None:
        return torch.zeros(n, dtype=torch.int64, device=device)
    if isinstance(q_causal_offsets, int) and not isinstance(q_causal_offsets, bool):
        offsets = torch.full((n,), q_causal_offsets, dtype=torch.int64, device=device)
    else:
        check_int_tensor("q_causal_offsets", q_causal_offsets, ndim=1)
        if q_causal_offsets.shape[0] != n:
            raise ValueError(
                f"q_causal_offsets has {q_causal_offsets.shape[0]} entries; expected one per "
                f"{what} ({n})."
            )
        offsets = q_causal_offsets.to(device=device, dtype=torch.int64)
    if bool((offsets < 0).any()):
        raise ValueError(
            f"q_causal_offsets must be non-negative (global index of each local row 0), got "
            f"{offsets.tolist()}."
        )
    return offsets


def _check_cu_seqlens(
    name: str, cu: torch.Tensor, total: int, device: torch.device
) -> torch.Tensor:
    check_int_tensor(name, cu, ndim=1)
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least [0, total], got {cu.tolist()}.")
    cu64 = cu.to(device=device, dtype=torch.int64)
    if int(cu64[0]) != 0 or bool((cu64[1:] < cu64[:-1]).any()) or int(cu64[-1]) != total:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at the packed length {total}; "
            f"got {cu.tolist()}."
        )
    return cu64


def _carriers_to_4d(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate carrier tensors and view them as ``[B, S_q, H, D]``, ``[B, S_k, 1, D]``,
    ``[B, S_q, H]`` (packed input gets batch 1)."""
    q, k, weights = check_tensor("q", q), check_tensor("k", k), check_tensor("weights", weights)
    check_float_dtype("q", q, _CARRIER_DTYPES)
    check_float_dtype("k", k, _CARRIER_DTYPES)
    check_float_dtype("weights", weights, _CARRIER_DTYPES)
    check_same_device(q=q, k=k, weights=weights)
    if packed:
        if q.ndim != 3 or weights.ndim != 2 or k.ndim not in (2, 3):
            raise ValueError(
                "packed (THD) input expects q [T_q, H, D], k [T_k, D] or [T_k, 1, D] and "
                f"weights [T_q, H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"weights {tuple(weights.shape)}."
            )
        q4, k4, w3 = q.unsqueeze(0), k.unsqueeze(0), weights.unsqueeze(0)
    else:
        if q.ndim != 4 or weights.ndim != 3 or k.ndim not in (3, 4):
            raise ValueError(
                "expected q [B, S_q, H, D], k [B, S_k, D] or [B, S_k, 1, D] and weights "
                f"[B, S_q, H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"weights {tuple(weights.shape)} (pass cu_seqlens_q/cu_seqlens_k for THD)."
            )
        q4, k4, w3 = q, k, weights
    if k4.ndim == 3:
        k4 = k4.unsqueeze(2)
    _check_shapes(q4, k4, w3, weights_shape=tuple(weights.shape), q_shape=tuple(q.shape))
    return q4, k4, w3


def _check_shapes(q4, k4, w3, *, weights_shape, q_shape) -> None:
    bq, sq, h, d = q4.shape
    bk, _, hk, dk = k4.shape
    if hk != 1:
        raise ValueError(f"k has {hk} heads; the indexer scores every query head against one key.")
    if bk != bq:
        raise ValueError(f"batch mismatch: q has {bq}, k has {bk}.")
    if tuple(w3.shape) != (bq, sq, h):
        raise ValueError(
            f"weights has shape {weights_shape}; expected one weight per query row and "
            f"head, {q_shape[:-1]}."
        )
    if dk != d:
        raise ValueError(f"head dim mismatch: q has {d}, k has {dk}.")


def _check_operands(ops: ScoringOperands, precision: ScoringPrecision) -> None:
    if not isinstance(ops, ScoringOperands):
        raise TypeError(f"operands must be ScoringOperands, got {type(ops).__name__}.")
    if ops.precision is not precision:
        raise ValueError(
            f"operands were prepared for scoring_precision={ops.precision.value!r} but "
            f"{precision.value!r} was requested; prepare them for the requested precision."
        )
    want = torch.float8_e4m3fn if precision is ScoringPrecision.FP8 else torch.bfloat16
    if ops.q.dtype != want or ops.k.dtype != want or ops.q.ndim != 4 or ops.k.ndim != 4:
        raise ValueError(
            f"{precision.value} operands must be 4-D {want}; got q {ops.q.dtype} "
            f"{tuple(ops.q.shape)}, k {ops.k.dtype} {tuple(ops.k.shape)}."
        )
    if (ops.q_scale is None) != (precision is ScoringPrecision.BF16) or (
        (ops.k_scale is None) != (precision is ScoringPrecision.BF16)
    ):
        raise ValueError("fp8 operands carry q_scale and k_scale; bf16 operands carry neither.")
    _check_shapes(ops.q, ops.k, ops.w, weights_shape=tuple(ops.w.shape), q_shape=tuple(ops.q.shape))
    check_same_device(q=ops.q, k=ops.k, w=ops.w, q_scale=ops.q_scale, k_scale=ops.k_scale)


def _indexer_forward(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    weights: torch.Tensor | None,
    *,
    scoring_precision: ScoringPrecision | str,
    ratio: int = 1,
    sm_scale: float = 1.0,
    backend: str = "auto",
    q_causal_offsets: torch.Tensor | int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    operands: ScoringOperands | None = None,
    on_chunk: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor | None:
    """The scoring choke point; see :func:`indexer_scores` for the arguments.

    ``operands`` replaces ``q``, ``k`` and ``weights`` (pass ``None`` for them) with operands a
    fused kernel already rounded or quantized (their ``sm_scale`` and amax floor are baked in);
    their precision must be the requested one. ``on_chunk`` (BSHD only) streams the result instead
    of materialising it: it receives ``(row_start, scores [B, r, S_k])`` per row chunk and the
    function returns ``None``.
    """
    precision = ScoringPrecision.parse(scoring_precision)
    ratio = check_positive_int("ratio", ratio)
    chunk_bytes = check_positive_int("chunk_bytes", chunk_bytes)
    sm_scale = float(sm_scale)
    if not (abs(sm_scale) < float("inf")):
        raise ValueError(f"sm_scale={sm_scale!r} must be finite.")
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("packed (THD) scoring needs both cu_seqlens_q and cu_seqlens_k.")
        if on_chunk is not None:
            raise ValueError("on_chunk streams BSHD input only; packed input returns scores.")

    if operands is None:
        q4, k4, w3 = _carriers_to_4d(q, k, weights, packed)
    else:
        if q is not None or k is not None or weights is not None:
            raise ValueError("pass either q, k, weights or operands=, not both.")
        _check_operands(operands, precision)
        q4, k4, w3 = operands.q, operands.k, operands.w
    device = q4.device
    bq, sq, h, d = q4.shape
    sk = k4.shape[1]
    if precision is ScoringPrecision.FP8:
        if d != FP8_HEAD_DIM:
            raise ValueError(
                f"scoring_precision='fp8' quantizes 128-wide vectors; q and k have head dim {d}. "
                "Use head dim 128 or scoring_precision='bf16'."
            )
        if h not in FP8_N_HEADS:
            raise ValueError(
                f"scoring_precision='fp8' needs {FP8_N_HEADS[0]} or {FP8_N_HEADS[1]} indexer "
                f"heads (the FP8 kernel's packing); q has {h}. Use scoring_precision='bf16'."
            )
    backend = resolve_scoring_backend(
        backend, device=device, precision=precision, n_heads=h, head_dim=d
    )
    record_scoring_call(precision.value, backend)

    ops = operands or _prepare_operands(q4, k4, w3, precision, sm_scale, amax_floor)
    bytes_per_row = _BYTES_PER_SCORE[backend]

    if not packed:
        offsets = _as_offsets(q_causal_offsets, bq, device, "batch row")
        chunk_rows = _chunk_rows(chunk_bytes, bq * max(sk, 1) * bytes_per_row)
        out = None
        if on_chunk is None:
            out = torch.full((bq, sq, sk), float("-inf"), dtype=torch.float32, device=device)

            def on_chunk(row_start: int, scores: torch.Tensor) -> None:
                out[:, row_start : row_start + scores.shape[1]] = scores

        every = slice(None)
        _score_rows(
            ops,
            backend,
            b_slice=every,
            q_rows=every,
            k_rows=every,
            offsets=offsets,
            ratio=ratio,
            chunk_rows=chunk_rows,
            emit=on_chunk,
        )
        return out

    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, sq, device)
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, sk, device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q describes {cu_q.numel() - 1} sequences and cu_seqlens_k "
            f"{cu_k.numel() - 1}; they must describe the same sequences."
        )
    n_seq = cu_q.numel() - 1
    offsets = _as_offsets(q_causal_offsets, n_seq, device, "packed sequence")
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    longest_k = max(k_lens, default=0)
    if max_seqlen_k is None:
        max_seqlen_k = longest_k
    elif max_seqlen_k < longest_k:
        raise ValueError(
            f"max_seqlen_k={max_seqlen_k} is below the longest key sequence ({longest_k})."
        )
    out = torch.full((sq, max_seqlen_k), float("-inf"), dtype=torch.float32, device=device)
    if (
        backend == "cudnn"
        and ops.bad_keys is None
        and sq * max(max_seqlen_k, 1) * bytes_per_row <= chunk_bytes
    ):
        q_lens = cu_q[1:] - cu_q[:-1]
        out.copy_(
            _cudnn_scores(
                ops,
                ops.q[0],
                ops.w[0],
                None if ops.q_scale is None else ops.q_scale[0],
                ops.k[0],
                None if ops.k_scale is None else ops.k_scale[0],
                offsets,
                ratio,
                cu_seqlens_q=cu_q.to(torch.int32),
                cu_seqlens_k=cu_k.to(torch.int32),
                max_seqlen_q=int(q_lens.max()) if n_seq else 0,
                max_seqlen_k=max_seqlen_k,
            )
        )
        return out
    # Chunked (or reference) packed scoring: each sequence as a batch-1 BSHD block.
    q_starts = cu_q.tolist()
    for i in range(n_seq):
        q0, q1 = q_starts[i], q_starts[i + 1]
        k0, k1 = int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        chunk_rows = _chunk_rows(chunk_bytes, max(k1 - k0, 1) * bytes_per_row)

        def emit(
            row_start: int, scores: torch.Tensor, base: int = q0, width: int = k1 - k0
        ) -> None:
            out[base + row_start : base + row_start + scores.shape[1], :width] = scores[0]

        _score_rows(
            ops,
            backend,
            b_slice=slice(0, 1),
            q_rows=slice(q0, q1),
            k_rows=slice(k0, k1),
            offsets=offsets[i : i + 1],
            ratio=ratio,
            chunk_rows=chunk_rows,
            emit=emit,
        )
    return out


def indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    scoring_precision: ScoringPrecision | str,
    ratio: int = 1,
    sm_scale: float = 1.0,
    backend: Backend = "auto",
    q_causal_offsets: torch.Tensor | int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Lightning-indexer scores under an explicit operand precision.

    Arguments:
        q: ``(B, S_q, H, 128)`` queries; bfloat16 or a float32 carrier (float16 accepted).
            Packed: ``(T_q, H, 128)``.
        k: ``(B, S_k, 128)`` or ``(B, S_k, 1, 128)`` keys, same dtypes. Packed: ``(T_k, 128)`` or
            ``(T_k, 1, 128)``.
        weights: ``(B, S_q, H)`` per-head weights as Megatron computes them (already scaled by
            ``H**-0.5 * D**-0.5``); bfloat16 or float32. Packed: ``(T_q, H)``.
        scoring_precision: ``"bf16"`` (operands rounded to BF16 first, FP32 carriers included)
            or ``"fp8"`` (E4M3 operands with UE8M0 descales, q descale and ``sm_scale`` folded into
            float32 weights, k descale per key; 32 or 64 heads of width 128).
        ratio: key compression ratio of the causal mask (1: one key per token).
        sm_scale: extra score scale (1.0 for Megatron, whose weights carry the scaling).
        backend: ``"cudnn"`` (SM90 cuDNN indexer kernel), ``"torch"`` (reference: same math,
            exact float64 accumulation rounded to float32, any device) or ``"auto"`` (cuDNN when
            it can serve the call, else torch). An explicit ``"cudnn"`` that cannot run raises.
        q_causal_offsets: global index of each batch row's (or packed sequence's) query 0, an int
            or ``(B,)`` / ``(n,)`` integer tensor; 0 by default.
        cu_seqlens_q, cu_seqlens_k: ``(n + 1,)`` cumulative lengths for packed (THD) input.
        max_seqlen_k: width of the packed output (default: the longest key sequence).
        amax_floor: UE8M0 amax floor for ``"fp8"`` (1e-4 in vLLM / SGLang).
        chunk_bytes: byte budget of one chunk's score buffer; longer inputs are scored in row
            chunks that keep their global causal rows, bit-identical to one launch.

    Returns:
        float32 ``(B, S_q, S_k)`` (packed: ``(T_q, max_seqlen_k)``, key index local to each
        sequence) with ``-inf`` at every key ``t >= floor((offset + s + 1) / ratio)``.
    """
    return _indexer_forward(
        q,
        k,
        weights,
        scoring_precision=scoring_precision,
        ratio=ratio,
        sm_scale=sm_scale,
        backend=backend,
        q_causal_offsets=q_causal_offsets,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seqlen_k,
        amax_floor=amax_floor,
        chunk_bytes=chunk_bytes,
    )
