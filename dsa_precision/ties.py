"""Ties at the top-k boundary: which rows no precision can decide, and why two selections differ.

An engine's top-k kernel is exact except where the ``k``-th largest score of a row is shared by
a key it did not take: on such a *boundary-tied* row any choice among the tied keys is a valid
top-k, and vLLM's kernels choose among them differently from run to run. Training, scoring
bit-identical logits, finds exactly the same rows tied, but cannot know the engine's choice; only
the engine's picks of those rows can say it (the ``replay_ties`` top-k source,
:mod:`dsa_precision.capture.ties`).

Definitions, for one row with scores ``s`` over its valid keys ``V`` (column below the row's
length, score neither ``-inf`` nor NaN) and a selection ``E`` of ``k`` slots (``-1`` pads):

- the row's **margin** is ``min(s[E]) - max(s[V \\ E])`` (NaN when ``E`` is empty or ``V \\ E``
  is): positive for a strict boundary, ``0`` for a boundary tie, negative when ``E`` is not a
  top-k of ``s``. Scores compare as floats (``-0.0 == +0.0``: exact-zero scores, common where
  every head is ReLU-zero, tie whatever their sign).
- ``E`` is a **valid top-k** of ``s`` when its keys are distinct keys of ``V``, it holds
  ``min(k, |V|)`` of them, and its margin is not negative.

:func:`classify_rows` tells, for each row where two selections differ, whether the other side's
set is a valid top-k of these scores (``TIE``: the rows differ only by the choice among tied
keys), is made of valid keys but is no top-k of them (``PRECISION``: the scores that chose it
differ from these, or, on the same scores, a wrong pick), or breaks the index rule
(``INVALID``: a key out of range, past the row's length, masked, or repeated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .checks import _check_tensor
from .picks import _repeated_keys, _sorted_keys

__all__ = [
    "INVALID",
    "PRECISION",
    "SAME",
    "TIE",
    "RowCauses",
    "ScoreRows",
    "classify_rows",
    "selection_margins",
]

SAME, TIE, PRECISION, INVALID = 0, 1, 2, 3
_CAUSES = ("same", "tie", "precision", "invalid")
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
_SCORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ScoreRows = Callable[[torch.Tensor], torch.Tensor]


def _valid_columns(scores: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """bool ``(rows, S_k)``: column below the row's length (default: every column), score
    neither ``-inf`` nor NaN."""
    valid = ~(torch.isnan(scores) | (scores == float("-inf")))
    if lengths is not None:
        cols = torch.arange(scores.shape[-1], device=scores.device)
        valid &= cols < lengths.to(scores.device).view(-1, 1)
    return valid


def selection_margins(
    scores: torch.Tensor,
    picks: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``(rows,)``: each row's margin (module docstring) of ``picks`` ``(rows, k)``
    under ``scores`` ``(rows, S_k)``, ``-1`` padding; ``lengths`` ``(rows,)``: the row's valid
    keys (default: all). ``starts`` ``(rows,)``: the column of each row's key 0 (a row's keys
    are columns ``starts + key``, as in the windows of DeepGEMM's and vLLM's prefill logits);
    default 0. NaN where the row picks nothing or leaves no valid key out, or where a pick's
    score is NaN. Keys outside the row's columns must have been refused by the caller. One
    float32 copy of the scores; no host synchronisation."""
    nan, inf = float("nan"), float("inf")
    s = scores.float()
    picked = picks >= 0
    safe = picks.long().clamp(min=0)
    if starts is not None:
        safe = safe + starts.to(device=safe.device, dtype=torch.int64).view(-1, 1)
    kth = s.gather(-1, safe).masked_fill(~picked, inf).amin(-1)  # NaN propagates
    cols = torch.arange(s.shape[-1], device=s.device)
    first = 0 if starts is None else starts.to(s.device).view(-1, 1)
    outside = None if lengths is None else cols >= first + lengths.to(s.device).view(-1, 1)
    if starts is not None:
        outside = cols < first if outside is None else outside | (cols < first)
    rest = s.clone() if outside is None else s.masked_fill(outside, -inf)  # the one copy
    rest.masked_fill_(rest.isnan(), -inf)
    # The picks leave the rest; padding slots rewrite one of the row's picks (a row that picks
    # nothing has no margin whatever they write).
    rest.scatter_(-1, torch.where(picked, safe, safe.amax(-1, keepdim=True)), -inf)
    following = rest.amax(-1)
    return torch.where((following > -inf) & (kth < inf), kth - following, nan)


def _causes(
    scores: torch.Tensor, picks: torch.Tensor, lengths: torch.Tensor | None, k: int
) -> torch.Tensor:
    """int8 ``(rows,)``: ``TIE`` where ``picks`` is a valid top-k of ``scores`` (module
    docstring), ``PRECISION`` where its keys are valid but it is no top-k, ``INVALID`` where it
    breaks the index rule. (``SAME`` is decided by the caller, from the two sets.)"""
    p = picks.long()
    sk = scores.shape[-1]
    valid = _valid_columns(scores.float(), lengths)
    inside = (p >= 0) & (p < sk)
    picked_valid = valid.gather(-1, p.clamp(0, max(sk - 1, 0))) & inside
    bad = ((p < -1) | ((p >= 0) & ~picked_valid)).any(-1) | _repeated_keys(_sorted_keys(p))
    p = torch.where(bad[:, None], -1, p)  # the margin reads only rows that keep the rule
    margin = selection_margins(scores, p, lengths)
    n_picked = (p >= 0).sum(-1)
    full = n_picked == torch.clamp(valid.sum(-1), max=k)
    is_topk = full & ~(margin < 0)  # NaN margin: nothing left out, or nothing picked
    cause = torch.where(is_topk, TIE, PRECISION)
    return torch.where(bad, INVALID, cause).to(torch.int8)


@dataclasses.dataclass(frozen=True)
class RowCauses:
    """Why each row of two selections differs (module docstring).

    Attributes:
        cause: int8 ``(...)``, one of :data:`SAME`, :data:`TIE`, :data:`PRECISION`,
            :data:`INVALID` per row (the leading shape of the selections).
        scored_rows: 0-d int64, the rows whose scores were read (those that differ).
    """

    cause: torch.Tensor
    scored_rows: torch.Tensor

    def counts(self) -> dict[str, int]:
        """``{"same": n, "tie": n, "precision": n, "invalid": n}`` (one host synchronisation)."""
        flat = self.cause.reshape(-1).long()
        values = torch.bincount(flat, minlength=len(_CAUSES)).tolist()
        return dict(zip(_CAUSES, values, strict=True))

    def rows(self, cause: int) -> torch.Tensor:
        """int64 ``(n,)``: the flattened rows of one cause (one host synchronisation)."""
        return (self.cause.reshape(-1) == cause).nonzero().view(-1)


def _check_index(name: str, idx: object) -> torch.Tensor:
    idx = _check_tensor(name, idx)
    if idx.dtype not in _INDEX_DTYPES or idx.ndim < 1 or idx.shape[-1] == 0:
        raise TypeError(
            f"{name}: expected [..., k] int16/int32/int64 picks with k >= 1, got "
            f"{str(idx.dtype).removeprefix('torch.')} {tuple(idx.shape)}."
        )
    return idx


def classify_rows(
    train_idx: torch.Tensor,
    infer_idx: torch.Tensor,
    scores: torch.Tensor | ScoreRows,
    *,
    lengths: torch.Tensor | None = None,
) -> RowCauses:
    """Why ``infer_idx`` differs from ``train_idx``, row by row, judged on training's scores.

    Args:
        train_idx: ``[..., k]`` training's picks (column indices of the scores, ``-1`` pads).
        infer_idx: ``[..., k]`` the engine's picks of the same rows, same shape and device.
        scores: training's scores of these rows, ``[..., S_k]`` float (``-inf`` at masked keys);
            or a function that takes ``(n,)`` int64 flattened row numbers and returns their
            ``(n, S_k)`` scores, so that only the rows that differ are scored (one host
            synchronisation finds them; the function is not called when none differs).
        lengths: ``[...]`` integer count of each row's valid columns (keys at or past it are
            not the row's); default: every column whose score is finite.

    Returns:
        :class:`RowCauses`: ``SAME`` where the two sets are equal, else ``TIE`` (the engine's
        set is a valid top-k of these scores), ``PRECISION`` or ``INVALID``.
    """
    t = _check_index("train_idx", train_idx)
    i = _check_index("infer_idx", infer_idx)
    if t.shape != i.shape or t.device != i.device:
        raise ValueError(
            f"train_idx is {tuple(t.shape)} on {t.device}, infer_idx {tuple(i.shape)} on "
            f"{i.device}; classify picks of the same rows, with the same k, on one device."
        )
    k = t.shape[-1]
    lead = t.shape[:-1]
    tf, inf_ = t.reshape(-1, k).long(), i.reshape(-1, k).long()
    n_rows = tf.shape[0]
    if lengths is not None:
        lengths = _check_tensor("lengths", lengths)
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(f"lengths: expected an integer tensor, got {lengths.dtype}.")
        if tuple(lengths.shape) != tuple(lead):
            raise ValueError(
                f"lengths has shape {tuple(lengths.shape)}; pass one count per row, shape "
                f"{tuple(lead)} (the picks' leading shape)."
            )
        lengths = lengths.reshape(-1).to(device=t.device, dtype=torch.int64)
    ordered = _sorted_keys(inf_)
    broken = (inf_ < -1).any(-1) | _repeated_keys(ordered)  # never read as padding or equal
    same = (_sorted_keys(tf) == ordered).all(-1) & ~broken
    cause = torch.full((n_rows,), SAME, dtype=torch.int8, device=t.device)
    if callable(scores) and not isinstance(scores, torch.Tensor):
        rows = (~same).nonzero().view(-1)  # the one host synchronisation
        if rows.numel():
            got = _check_tensor("scores(rows)", scores(rows))
            if got.ndim != 2 or got.shape[0] != rows.numel() or got.dtype not in _SCORE_DTYPES:
                raise ValueError(
                    f"scores(rows) returned {str(got.dtype).removeprefix('torch.')} "
                    f"{tuple(got.shape)}; it must return ({rows.numel()}, S_k) float scores of "
                    "the rows it is given."
                )
            sub = None if lengths is None else lengths[rows]
            cause[rows] = _causes(got.to(t.device), inf_[rows], sub, k)
        scored = torch.tensor(rows.numel(), dtype=torch.int64, device=t.device)
        return RowCauses(cause.view(lead), scored)
    s = _check_tensor("scores", scores)
    if s.dtype not in _SCORE_DTYPES or tuple(s.shape[:-1]) != tuple(lead) or s.device != t.device:
        raise ValueError(
            f"scores is {str(s.dtype).removeprefix('torch.')} {tuple(s.shape)} on {s.device}; "
            f"pass float scores of the same rows, shape {(*lead, 'S_k')}, on {t.device}."
        )
    judged = _causes(s.reshape(n_rows, -1), inf_, lengths, k)
    cause = torch.where(same, cause, judged)
    return RowCauses(cause.view(lead), (~same).sum())
