"""Agreement between a training-side and an inference-side top-k selection, and how close to a tie
their boundaries are.

Definitions, over the rows whose inference set ``I`` is non-empty (``T`` is the training set)::

    member_agreement = sum_rows |T ∩ I| / sum_rows |I|
    rows_identical   = share of rows with T == I
    flipped picks    = |I \\ T| per row (mean and max over those rows)

Index tensors are ``[..., k]`` integer tensors with ``-1`` as padding, in any order (indices
unique within a row), on any device.
The metrics are computed with a handful of tensor ops and no host synchronisation per row, so
calling :func:`topk_agreement` every training step on GPU tensors is cheap; the returned
:class:`TopkAgreement` holds 0-d tensors until you read a field as a Python number.
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import check_tensor

__all__ = ["TopkAgreement", "boundary_margin", "row_scale", "score_error", "topk_agreement"]

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

    def as_dict(self) -> dict[str, float | int]:
        """Python numbers (one host sync), e.g. for ``json`` or a logger."""
        values = torch.stack(
            [getattr(self, f.name).to(torch.float64) for f in dataclasses.fields(self)]
        )
        out = dict(zip((f.name for f in dataclasses.fields(self)), values.tolist(), strict=True))
        for name in ("flipped_max", "rows", "members"):
            out[name] = int(out[name])
        return out


def topk_agreement(train_idx: torch.Tensor, infer_idx: torch.Tensor) -> TopkAgreement:
    """Compare two top-k selections of the same rows.

    Args:
        train_idx: ``[..., k]`` integer key indices selected by training, ``-1`` padded.
        infer_idx: ``[..., k]`` integer key indices selected by inference, same shape and device.

    Returns:
        :class:`TopkAgreement` over the rows whose inference set is non-empty (all metrics are
        ``1`` / ``0`` when there is none).
    """
    return _agreement_and_identical_rows(train_idx, infer_idx)[0]


def _agreement_and_identical_rows(
    train_idx: torch.Tensor, infer_idx: torch.Tensor
) -> tuple[TopkAgreement, torch.Tensor]:
    """:func:`topk_agreement`, and a bool ``[...]`` tensor: whether each row's two sets are equal
    (two empty sets included)."""
    train_idx, infer_idx = (
        check_tensor("train_idx", train_idx),
        check_tensor("infer_idx", infer_idx),
    )
    for name, t in (("train_idx", train_idx), ("infer_idx", infer_idx)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; top-k indices are int16/int32/int64.")
        if t.ndim < 1:
            raise ValueError(f"{name} must be [..., k], got a 0-d tensor.")
    if train_idx.shape != infer_idx.shape:
        raise ValueError(
            f"train_idx has shape {tuple(train_idx.shape)} but infer_idx {tuple(infer_idx.shape)}; "
            "compare selections of the same rows with the same k."
        )
    if train_idx.device != infer_idx.device:
        raise ValueError(f"train_idx is on {train_idx.device} but infer_idx on {infer_idx.device}.")
    k = train_idx.shape[-1]
    t = train_idx.reshape(-1, k).to(torch.int64)
    i = infer_idx.reshape(-1, k).to(torch.int64)
    # Membership of each inference pick in the training row: binary search in the sorted row
    # (padding sorted to the end as a value no index takes). O(rows * k log k), no host sync.
    pad = torch.iinfo(torch.int64).max
    t_sorted = torch.where(t < 0, pad, t).sort(dim=-1).values
    pos = torch.searchsorted(t_sorted, i).clamp_max(max(k - 1, 0))
    found = (t_sorted.gather(-1, pos) == i) & (i >= 0)
    size_i = (i >= 0).sum(-1)
    size_t = (t >= 0).sum(-1)
    common = found.sum(-1)
    same = (common == size_i) & (size_t == size_i)
    rows = size_i > 0
    n_rows = rows.sum()
    members = size_i.sum()
    identical = (same & rows).sum()
    flipped = (size_i - common) * rows
    one = torch.ones((), dtype=torch.float64, device=t.device)
    f64 = torch.float64
    agreement = TopkAgreement(
        member_agreement=torch.where(members > 0, common.sum().to(f64) / members.clamp_min(1), one),
        rows_identical=torch.where(n_rows > 0, identical.to(f64) / n_rows.clamp_min(1), one),
        flipped_mean=flipped.sum().to(f64) / n_rows.clamp_min(1),
        flipped_max=flipped.max()
        if flipped.numel()
        else torch.zeros((), dtype=torch.int64, device=t.device),
        rows=n_rows,
        members=members,
    )
    return agreement, same.reshape(train_idx.shape[:-1])


def row_scale(reference: torch.Tensor) -> torch.Tensor:
    """``sigma_r``: float64 ``[rows]`` standard deviation of each row's finite entries of
    ``reference`` ``[rows, S_k]`` (``-inf`` = masked); NaN where a row is constant."""
    finite = torch.isfinite(reference)
    ref = torch.where(finite, reference.double(), 0.0)
    n = finite.sum(-1)
    centered = torch.where(finite, ref - (ref.sum(-1) / n)[:, None], 0.0)
    sigma = ((centered**2).sum(-1) / n).sqrt()
    return torch.where(sigma > 0, sigma, torch.nan)


def boundary_margin(scores: torch.Tensor, scale: torch.Tensor, topk: int) -> float:
    """``median_r (y_(k) - y_(k+1)) / sigma_r``, with ``y_(j)`` the ``j``-th largest score of row
    ``r`` of ``scores`` ``[rows, S_k]`` (more than ``topk`` finite entries per row) and ``scale``
    from :func:`row_scale`: how far from a tie the top-k boundary typically is."""
    top = scores.topk(topk + 1, dim=-1).values.double()
    return float(((top[:, topk - 1] - top[:, topk]) / scale).nanmedian())


def score_error(scores: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    """``median_r max_t |scores[r, t] - reference[r, t]| / sigma_r`` over the finite entries
    (both ``[rows, S_k]`` with the same ``-inf`` pattern)."""
    finite = torch.isfinite(reference)
    diff = torch.where(finite, scores.double() - reference.double(), 0.0).abs().amax(-1)
    return float((diff / scale).nanmedian())
