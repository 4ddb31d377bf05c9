"""Agreement between a training-side and an inference-side top-k selection, and how close to a tie
their boundaries are.

Definitions, over the rows whose inference set ``I`` is non-empty (``T`` is the training set)::

    member_agreement = sum_rows |T ∩ I| / sum_rows |I|
    rows_identical   = share of rows with T == I
    flipped picks    = |I \\ T| per row (mean and max over those rows)

Index tensors are ``[..., k]`` integer tensors (``k >= 1``), in any order, on any device. **The
index rule** (the same for :func:`topk_agreement`, ``dsa-precision agree`` and the replay layout
of :class:`dsa_precision.picks.TokenLayout`): an entry is a key ``>= 0`` or ``-1``
(padding); a row holds each key at most once (``-1`` may repeat). A negative other than ``-1`` or
a repeated key is an error, never read as padding or counted twice.

The metrics are computed with a handful of tensor ops and no host synchronisation, so calling
:func:`topk_agreement` every training step on GPU tensors is cheap; the returned
:class:`TopkAgreement` holds 0-d tensors until you read a field as a Python number. Checking the
rule on the data needs a host synchronisation, so it is opt-in: with ``validate=True`` a
violation raises ``ValueError`` naming the tensor, the row and its values; without it, a
violation makes ``member_agreement``, ``rows_identical`` and ``flipped_mean`` NaN (no sync), so a
broken selection never reads as an agreement, and ``broken_rows`` says how many rows broke it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .checks import _check_bool, _check_tensor
from .picks import _repeated_keys, _sorted_keys
from .ties import INVALID, PRECISION, TIE, classify_rows

__all__ = ["TopkAgreement", "topk_agreement"]

_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class TopkAgreement:
    """Top-k agreement metrics (0-d tensors; ``float(x)`` / :meth:`as_dict` to read them)."""

    member_agreement: torch.Tensor  # float64, in [0, 1]
    rows_identical: torch.Tensor  # float64, in [0, 1]
    flipped_mean: torch.Tensor  # float64, mean |I \ T| per row
    flipped_max: torch.Tensor  # int64, max |I \ T| per row
    rows: torch.Tensor  # int64, rows with a non-empty inference set
    members: torch.Tensor  # int64, sum_rows |I|
    broken_rows: torch.Tensor  # int64, rows of either side breaking the index rule (NaN metrics)
    # With scores (topk_agreement(..., scores=)): the differing rows by cause (dsa_precision.ties)
    tie_rows: torch.Tensor | None = None  # int64: the engine's set is a valid top-k of the scores
    precision_rows: torch.Tensor | None = None  # int64: valid keys, no top-k of the scores
    invalid_rows: torch.Tensor | None = None  # int64: the engine's set breaks the index rule

    def as_dict(self) -> dict[str, float | int]:
        """Python numbers (one host sync), e.g. for ``json`` or a logger; the causes only when
        they were computed."""
        fields = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        values = torch.stack([getattr(self, n).to(torch.float64) for n in fields])
        out = dict(zip(fields, values.tolist(), strict=True))
        for name in ("flipped_max", "rows", "members", "broken_rows", "tie_rows",
                     "precision_rows", "invalid_rows"):  # fmt: skip
            if name in out:
                out[name] = int(out[name])
        return out


def topk_agreement(
    train_idx: torch.Tensor,
    infer_idx: torch.Tensor,
    *,
    validate: bool = False,
    scores: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    lengths: torch.Tensor | None = None,
) -> TopkAgreement:
    """Compare two top-k selections of the same rows.

    Args:
        train_idx: ``[..., k]`` integer key indices selected by training, ``-1`` padded.
        infer_idx: ``[..., k]`` integer key indices selected by inference, same shape and device.
        validate: check the index rule (module docstring) on the data of both tensors and raise
            ``ValueError`` on a violation; one host synchronisation. Without it, rows breaking
            the rule make the float metrics NaN.
        scores: training's scores of these rows (``[..., S_k]``, or a function scoring given
            flattened rows): then each compared row that differs is also told apart
            (:func:`dsa_precision.classify_rows`: ``tie_rows``, ``precision_rows``,
            ``invalid_rows``); one host synchronisation finds the differing rows, and only
            those are scored when ``scores`` is a function.
        lengths: ``[...]`` each row's visible keys, for ``scores`` (default: the finite ones).

    Returns:
        :class:`TopkAgreement` over the rows whose inference set is non-empty; with none,
        ``member_agreement``, ``rows_identical`` and ``flipped_mean`` are NaN (nothing compared
        never reads as a match, as ``topk_metrics`` and ``dsa-precision agree`` treat it).
    """
    if _check_bool("validate", validate):
        for name, idx in (("train_idx", train_idx), ("infer_idx", infer_idx)):
            _validate_index_rows(name, idx)
    agreement = _agreement_and_identical_rows(train_idx, infer_idx)[0]
    if scores is None:
        if lengths is not None:
            raise ValueError("topk_agreement(lengths=...) qualifies scores=; pass both or neither.")
        return agreement
    cause = classify_rows(train_idx, infer_idx, scores, lengths=lengths).cause.reshape(-1)
    compared = (_check_index_tensor("infer_idx", infer_idx) >= 0).any(-1)  # agreement's rows
    counts = {name: ((cause == code) & compared).sum()
              for name, code in (("tie_rows", TIE), ("precision_rows", PRECISION),
                                 ("invalid_rows", INVALID))}  # fmt: skip
    return dataclasses.replace(agreement, **counts)


def _check_index_tensor(name: str, idx: object) -> torch.Tensor:
    """Host-side facts of one ``[..., k]`` selection; returns it as ``int64 [rows, k]``."""
    idx = _check_tensor(name, idx)
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {idx.dtype}; top-k indices are int16/int32/int64.")
    if idx.ndim < 1:
        raise ValueError(f"{name} must be [..., k], got a 0-d tensor.")
    k = idx.shape[-1]
    if k == 0:
        raise ValueError(
            f"{name} has shape {tuple(idx.shape)}: k = 0 slots per row; a top-k selection holds "
            "at least one slot (-1 pads a row with fewer keys)."
        )
    return idx.reshape(-1, k).to(torch.int64)


def _broken_rows(rows: torch.Tensor, ordered: torch.Tensor) -> torch.Tensor:
    """bool ``[rows]``: the row breaks the index rule (a negative other than -1, or a key twice);
    ``ordered`` is :func:`~dsa_precision.picks._sorted_keys` of ``rows``."""
    return (rows < -1).any(-1) | _repeated_keys(ordered)


def _validate_index_rows(name: str, idx: torch.Tensor) -> None:
    """Check the index rule (module docstring) on the data of ``idx`` ``[..., k]``.

    Raises:
        TypeError, ValueError: host-side facts (not a tensor, dtype, 0-d, ``k = 0``).
        ValueError: naming ``name``, the first offending row (flattened over ``[...]``) and its
            values. One host synchronisation.
    """
    rows = _check_index_tensor(name, idx)
    broken = _broken_rows(rows, _sorted_keys(rows))
    if not bool(broken.any()):  # the one synchronisation
        return
    row = int(broken.nonzero()[0])
    values = rows[row].tolist()
    shown = f"{values[:8]}{'...' if len(values) > 8 else ''}"
    why = (
        f"holds {min(v for v in values if v < -1)}; keys are >= 0 and -1 pads"
        if min(values) < -1
        else "repeats a key; a top-k row holds distinct keys"
    )
    raise ValueError(
        f"{name}: row {row} of {rows.shape[0]} (shape {tuple(idx.shape)}) is {shown}: it {why}."
    )


def _agreement_and_identical_rows(
    train_idx: torch.Tensor, infer_idx: torch.Tensor
) -> tuple[TopkAgreement, torch.Tensor]:
    """:func:`topk_agreement`, and a bool ``[...]`` tensor: whether each row's two sets are equal
    (two empty sets included; ``False`` where a row breaks the index rule)."""
    t = _check_index_tensor("train_idx", train_idx)
    i = _check_index_tensor("infer_idx", infer_idx)
    if train_idx.shape != infer_idx.shape:
        raise ValueError(
            f"train_idx has shape {tuple(train_idx.shape)} but infer_idx {tuple(infer_idx.shape)}; "
            "compare selections of the same rows with the same k."
        )
    if train_idx.device != infer_idx.device:
        raise ValueError(f"train_idx is on {train_idx.device} but infer_idx on {infer_idx.device}.")
    k = t.shape[-1]
    # Membership of each inference pick in the training row: binary search in the sorted row.
    # O(rows * k log k), no host sync.
    t_sorted, i_sorted = _sorted_keys(t), _sorted_keys(i)
    broken_rows = _broken_rows(t, t_sorted) | _broken_rows(i, i_sorted)
    broken = broken_rows.any()
    pos = torch.searchsorted(t_sorted, i).clamp_max(k - 1)
    found = (t_sorted.gather(-1, pos) == i) & (i >= 0)
    size_i = (i >= 0).sum(-1)
    size_t = (t >= 0).sum(-1)
    common = found.sum(-1)
    same = (common == size_i) & (size_t == size_i) & ~broken_rows
    rows = size_i > 0
    n_rows = rows.sum()
    members = size_i.sum()
    identical = (same & rows).sum()
    flipped = (size_i - common) * rows
    f64 = torch.float64

    def checked(x: torch.Tensor) -> torch.Tensor:  # NaN when any row breaks the index rule,
        return torch.where(broken | (n_rows == 0), torch.nan, x)  # or when none is compared

    agreement = TopkAgreement(
        member_agreement=checked(common.sum().to(f64) / members.clamp_min(1)),
        rows_identical=checked(identical.to(f64) / n_rows.clamp_min(1)),
        flipped_mean=checked(flipped.sum().to(f64) / n_rows.clamp_min(1)),
        flipped_max=flipped.max()
        if flipped.numel()
        else torch.zeros((), dtype=torch.int64, device=t.device),
        rows=n_rows,
        members=members,
        broken_rows=broken_rows.sum(),
    )
    return agreement, same.reshape(train_idx.shape[:-1])


def _row_scale(reference: torch.Tensor) -> torch.Tensor:
    """``sigma_r``: float64 ``[rows]`` standard deviation of each row's finite entries of
    ``reference`` ``[rows, S_k]`` (``-inf`` = masked); NaN where a row is constant."""
    finite = torch.isfinite(reference)
    ref = torch.where(finite, reference.double(), 0.0)
    n = finite.sum(-1)
    centered = torch.where(finite, ref - (ref.sum(-1) / n)[:, None], 0.0)
    sigma = ((centered**2).sum(-1) / n).sqrt()
    return torch.where(sigma > 0, sigma, torch.nan)


def _boundary_margin(scores: torch.Tensor, scale: torch.Tensor, topk: int) -> float:
    """``median_r (y_(k) - y_(k+1)) / sigma_r``, with ``y_(j)`` the ``j``-th largest score of row
    ``r`` of ``scores`` ``[rows, S_k]`` (more than ``topk`` finite entries per row) and ``scale``
    from :func:`_row_scale`: how far from a tie the top-k boundary typically is."""
    top = scores.topk(topk + 1, dim=-1).values.double()
    return float(((top[:, topk - 1] - top[:, topk]) / scale).nanmedian())


def _score_error(scores: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    """``median_r max_t |scores[r, t] - reference[r, t]| / sigma_r`` over the finite entries
    (both ``[rows, S_k]`` with the same ``-inf`` pattern)."""
    finite = torch.isfinite(reference)
    diff = torch.where(finite, scores.double() - reference.double(), 0.0).abs().amax(-1)
    return float((diff / scale).nanmedian())
