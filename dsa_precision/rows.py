"""Row arithmetic of causal and packed scoring: which keys each query row sees.

A query row ``s`` of batch row ``b`` sees keys ``t < limit(b, s) = min(floor((offset_b + s + 1)
/ ratio), S_k)`` (top-left causal; ``offset_b`` is the global position of the row's first query:
row chunks, context parallelism). Packed (THD) rows count positions per sequence, their
cumulative lengths ``cu_seqlens`` checked here. Everything runs on the device without a host
synchronisation, except the ``validate_*`` checks, which read the data.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple, cast

import torch

from .checks import _INT32_MAX, _as_int32_tensor, _check_int_fits, _check_int_tensor
from .devices import _shared_device_tensor

__all__ = ["WindowScores", "causal_key_counts"]


def causal_key_counts(
    q_causal_offsets: torch.Tensor, row_start: int, rows: int, ratio: int, sk: int
) -> torch.Tensor:
    """``(B, rows)`` int32 visible keys ``min(floor((offset_b + s + 1) / ratio), S_k)`` of query
    rows ``s`` in ``[row_start, row_start + rows)`` (the top-k ``seq_lens`` of causal scores)."""
    s = torch.arange(row_start + 1, row_start + rows + 1, device=q_causal_offsets.device)
    counts = torch.div(
        q_causal_offsets.view(-1, 1).to(torch.int64) + s, ratio, rounding_mode="floor"
    )
    return counts.clamp_(0, sk).to(torch.int32)


@_shared_device_tensor
def _constant_offsets(value: int, n: int, device: torch.device) -> torch.Tensor:
    """``(n,)`` int32 ``value`` on ``device``, shared read-only (a Python int offset's tensor)."""
    return torch.full((n,), value, dtype=torch.int32, device=device)


@_shared_device_tensor
def _constant_key_counts(
    offset: int, batch: int, row_start: int, rows: int, ratio: int, sk: int, device: torch.device
) -> torch.Tensor:
    """``(batch * rows,)`` int32 :func:`causal_key_counts` of ``batch`` rows that all start at the
    Python int ``offset``, flattened; built once per arguments and shared: read it, never write
    into it."""
    offsets = _constant_offsets(offset, batch, device)
    return causal_key_counts(offsets, row_start, rows, ratio, sk).view(-1)


def _packed_sequence_of(cu_seqlens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64 index of the packed sequence that holds each of ``rows`` (packed row numbers, on
    ``cu_seqlens``' device); rows at or past ``cu_seqlens[-1]`` map to the last sequence."""
    cu = cu_seqlens.to(torch.int64)
    return torch.searchsorted(cu[1:], rows, right=True).clamp_(max=cu.numel() - 2)


class _VarlenWindows(NamedTuple):
    """Each packed query row's key window ``[start, end)`` in the packed keys: DeepGEMM's
    ``cu_seq_len_k_start`` / ``cu_seq_len_k_end``, and ``counts = end - start`` (the top-k's
    ``seq_lens``). Each ``(T_q,)`` int32, contiguous."""

    start: torch.Tensor  # first key of the row's sequence, cu_seqlens_k[i]
    end: torch.Tensor  # start + counts
    counts: torch.Tensor  # the row's visible keys, its sequence's causal limit


@dataclasses.dataclass(frozen=True)
class WindowScores:
    """Scores valid up to each row's length, the rest unspecified: DeepGEMM's uncleaned layout.

    What :func:`~dsa_precision.indexer_scores` and :func:`~dsa_precision.indexer_scores_varlen`
    return with ``clean=False``, and what :func:`~dsa_precision.indexer_topk` reads in place
    (DeepGEMM's ``clean_logits=False``, which vLLM's prefill top-k reads with each row's end).

    ``scores``: ``(..., columns)`` float32 with unit column stride; column ``j`` of a row holds its
    score for ``j < lengths[row]``, and past it whatever the kernel's buffer held (DeepGEMM), or
    ``-inf`` (cuDNN, torch). Rows may lie further apart than ``columns`` floats (DeepGEMM pads them
    in its buffer). ``lengths``: int32 ``scores.shape[:-1]`` on the same device, each in
    ``[0, columns]``: the row's causal key count.
    """

    scores: torch.Tensor
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        s, n = self.scores, self.lengths
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.ndim < 1:
            raise TypeError(f"scores must be a float32 tensor (..., columns), got {_describe(s)}.")
        if not isinstance(n, torch.Tensor) or n.dtype != torch.int32:
            raise TypeError(f"lengths must be an int32 tensor, got {_describe(n)}.")
        if n.shape != s.shape[:-1] or n.device != s.device:
            raise ValueError(
                f"lengths {tuple(n.shape)} on {n.device} must give one length per score row: "
                f"{tuple(s.shape[:-1])} on {s.device}."
            )
        if s.shape[-1] > 1 and s.stride(-1) != 1:
            raise ValueError(f"scores must have unit column stride, got strides {s.stride()}.")
        if _rows_overlap(s):
            raise ValueError(
                f"scores of shape {tuple(s.shape)} and strides {s.stride()} are not rows of their "
                "own memory (rows that share it, as a broadcast or expanded view, or interleave): "
                "masking one row would write the others; pass scores.contiguous()."
            )

    def _rows(self) -> torch.Tensor:
        """``(rows, columns)``: a view of ``scores`` (its rows uniformly apart)."""
        try:
            return self.scores.view(self.lengths.numel(), self.scores.shape[-1])
        except RuntimeError as exc:
            raise ValueError(
                f"scores of shape {tuple(self.scores.shape)} and strides {self.scores.stride()} "
                "are not rows uniformly apart in one buffer; pass a row-major tensor."
            ) from exc

    def masked(self) -> torch.Tensor:
        """``scores`` with ``-inf`` at every column ``j >= lengths[row]``, written in place (on
        CUDA one Triton pass that stores only those tails). Returns ``scores``."""
        flat = self._rows()
        counts = self.lengths.reshape(-1)
        if flat.is_cuda:
            from .kernels import triton_unavailable_reason

            if triton_unavailable_reason() is None:
                from .kernels.mask_tails import _mask_tails

                _mask_tails(flat, counts)
                return self.scores
        cols = torch.arange(flat.shape[1], device=flat.device)
        flat.masked_fill_(cols >= counts.unsqueeze(1), float("-inf"))
        return self.scores

    def rows_in_place(self) -> torch.Tensor:
        """``(rows, row_stride)``: the rows' memory as one contiguous tensor, no copy (the top-k's
        input, which with ``seq_lens = lengths`` reads only valid columns)."""
        flat = self._rows()
        rows, columns = flat.shape
        stride = flat.stride(0) if rows > 1 else columns
        storage = flat.untyped_storage().nbytes() // flat.element_size()
        if stride < columns or flat.storage_offset() + rows * stride > storage:
            raise ValueError(
                f"scores of shape {tuple(self.scores.shape)} and strides {self.scores.stride()} "
                f"in a buffer of {storage} floats are not rows of one buffer; expected row-major "
                "rows (DeepGEMM 2.4-2.8's layout)."
            )
        return flat.as_strided((rows, stride), (stride, 1))


def _rows_overlap(scores: torch.Tensor) -> bool:
    """Whether two elements of ``scores`` (unit column stride) may share memory: with the
    dimensions of more than one entry sorted by stride, each must step past the extent of the
    ones inside it (a host fact of the sizes and strides)."""
    if scores.numel() <= 1:
        return False
    extent = scores.shape[-1]  # the columns, unit stride
    dims = sorted(
        (st, size)
        for st, size in zip(scores.stride()[:-1], scores.shape[:-1], strict=True)
        if size > 1
    )
    for st, size in dims:
        if st < extent:
            return True
        extent = st * (size - 1) + extent
    return False


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def _fused_windows(device: torch.device) -> bool:
    """Whether :func:`_varlen_windows` runs as one Triton launch on ``device``."""
    if device.type != "cuda":
        return False
    from .kernels import triton_unavailable_reason

    return triton_unavailable_reason() is None


def _varlen_windows(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    q_causal_offsets: torch.Tensor,
    ratio: int,
    total_q: int,
) -> _VarlenWindows:
    """Every packed query row's key window (its sequence's keys up to its causal limit).

    Arguments: ``(n + 1,)`` int32 / int64 cumulative lengths and ``(n,)`` offsets on one device
    (checked by the caller), ``ratio`` a positive int, ``total_q`` the packed rows. On CUDA one
    Triton launch (:mod:`dsa_precision.kernels.varlen_windows`), elsewhere the torch expression
    below; both give the same integers."""
    if _fused_windows(cu_seqlens_q.device):
        from .kernels.varlen_windows import _varlen_windows as fused

        return _VarlenWindows(*fused(cu_seqlens_q, cu_seqlens_k, q_causal_offsets, ratio, total_q))
    rows = torch.arange(total_q, device=cu_seqlens_q.device)
    cu_q = cu_seqlens_q.to(torch.int64)
    seq = _packed_sequence_of(cu_q, rows)
    local = rows - cu_q[seq]
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)[seq]
    off = q_causal_offsets.to(torch.int64)[seq]
    counts = torch.div(off + local + 1, ratio, rounding_mode="floor")
    counts = torch.minimum(counts.clamp_(min=0), len_k).to(torch.int32)
    start = cu_seqlens_k.to(torch.int32)[seq]
    return _VarlenWindows(start, start + counts, counts)


def _varlen_key_counts(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    q_causal_offsets: torch.Tensor,
    ratio: int,
    total_q: int,
) -> torch.Tensor:
    """``(T_q,)`` int32 visible keys of every packed query row (its sequence's causal limit):
    the ``counts`` of :func:`_varlen_windows`."""
    return _varlen_windows(cu_seqlens_q, cu_seqlens_k, q_causal_offsets, ratio, total_q).counts


def _varlen_row_slice(
    cu_seqlens_q: torch.Tensor, q_causal_offsets: torch.Tensor, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, q_causal_offsets)`` of packed rows ``[start, stop)``, on the device.

    The sequences the slice cuts keep their global causal rows: each one's first row in the
    slice is at position ``offset + max(start - cu_seqlens_q[i], 0)`` of its sequence; sequences
    outside the slice get length 0.
    """
    cu = cu_seqlens_q.to(torch.int64)
    sliced = (cu - start).clamp_(0, stop - start).to(torch.int32)
    offsets = q_causal_offsets.to(torch.int64) + (start - cu[:-1]).clamp_(min=0)
    return sliced, offsets


def _causal_offsets(
    q_causal_offsets: torch.Tensor | int | None,
    n: int,
    device: torch.device,
    what: str,
    *,
    rows: int,
    validate: bool,
) -> torch.Tensor:
    """``(n,)`` int32 offsets on ``device``. Each offset plus the ``rows`` query rows after it
    must fit int32: always checked for a Python int, with ``validate=True`` for a tensor (before
    its cast to int32, one host sync). For an int or ``None`` the tensor is shared read-only
    (built once per value, batch and device); a tensor comes back as :func:`_as_int32_tensor`
    gives it."""
    if q_causal_offsets is None:
        return _constant_offsets(0, n, device)
    fix = (
        f"pass the global index of each {what}'s first query row: non-negative, and with its "
        f"{rows} rows added still within int32"
    )
    if isinstance(q_causal_offsets, numbers.Integral) and not isinstance(q_causal_offsets, bool):
        value = _check_int_fits(
            "q_causal_offsets", q_causal_offsets, high=_INT32_MAX - rows, fix=fix
        )
        return _constant_offsets(value, n, device)
    # An int was handled above; check_int_tensor refuses anything else that is not a tensor.
    q_causal_offsets = cast(torch.Tensor, q_causal_offsets)
    _check_int_tensor("q_causal_offsets", q_causal_offsets, ndim=1)
    if q_causal_offsets.shape[0] != n:
        raise ValueError(
            f"q_causal_offsets has {q_causal_offsets.shape[0]} entries; expected one per {what} "
            f"({n})."
        )
    return _as_int32_tensor(
        "q_causal_offsets",
        q_causal_offsets,
        device=device,
        validate=validate,
        high=_INT32_MAX - rows,
        fix=fix,
    )


def _check_cu_seqlens(name: str, cu: torch.Tensor, n: int | None) -> torch.Tensor:
    """Host checks of cumulative lengths: a 1-D integer tensor of at least ``[0, total]``, with
    ``n`` entries when given (the same sequences as ``cu_seqlens_q``)."""
    _check_int_tensor(name, cu, ndim=1)
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least [0, total]; got {cu.numel()} entries.")
    if n is not None and cu.numel() != n:
        raise ValueError(
            f"cu_seqlens_q describes {n - 1} sequences and {name} {cu.numel() - 1}; they must "
            "describe the same sequences."
        )
    return cu


def _validate_cu_seqlens(
    name: str, cu: torch.Tensor, total: int, max_len: int, *, padding: bool = False
) -> None:
    """``cu`` starts at 0, does not decrease, ends at ``total`` (with ``padding``: at most
    ``total``, the rows past its end being padding no sequence owns) and holds no sequence longer
    than ``max_len``; reads the data (on a CUDA tensor one host synchronisation)."""
    lens = cu[1:] - cu[:-1]
    end = int(cu[-1])
    if int(cu[0]) != 0 or bool((lens < 0).any()) or end > total or (end != total and not padding):
        bound = f"at most the packed length {total}" if padding else f"the packed length {total}"
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at {bound}; got "
            f"{cu.tolist()[:16]}{'...' if cu.numel() > 16 else ''}."
        )
    if lens.numel() and int(lens.max()) > max_len:
        raise ValueError(
            f"{name} has a sequence of {int(lens.max())} tokens, above max_seqlen {max_len}; pass "
            "the longest sequence's length (max_seqlen_q / max_seqlen_k bound every sequence)."
        )


def _check_varlen_args(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    device: torch.device,
    total_q: int,
    total_k: int,
    validate: bool,
) -> None:
    """The checks of the packed-sequence arguments: host facts always (dtypes, shapes, the
    lengths held where the operands are or on the CPU); their values when they are host data
    (on the CPU: free of any device work) or with ``validate`` (one host synchronisation):
    starting at 0, non-decreasing, ending at the packed lengths ``total_q`` / ``total_k``, no
    sequence longer than ``max_seqlen_q`` / ``max_seqlen_k``."""
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.numel())
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
            raise ValueError(f"{name}={value!r} must be a non-negative Python int within int32.")
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k),
    ):
        if cu.device.type != "cpu" and cu.device != device:
            raise ValueError(
                f"{name} is on {cu.device}, the operands on {device}; hold the lengths on the "
                "CPU or on the operands' device."
            )
        if validate or cu.device.type == "cpu":  # keys past cu_seqlens_k[-1] are padding
            _validate_cu_seqlens(name, cu, total, longest, padding=name == "cu_seqlens_k")
