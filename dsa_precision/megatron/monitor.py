"""How far a layer's own picks are from the engine's: accumulated on the device, read as metrics.

In ``verify`` (and in ``compute`` when picks are handed in and the layer's picks are the
package's, i.e. FP8 scoring), every layer accumulates on the device, without host
synchronisation, its member agreement, identical rows and flipped picks, the margin of each row
(``verify``: its ``topk``-th minus its ``(topk+1)``-th score), and the rows whose digest differs
from the engine's (digests handed in): :func:`topk_metrics` reads them as a dict for Megatron's
TensorBoard / W&B writers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..agreement import _agreement_and_identical_rows

__all__ = ["topk_metrics"]

# Metric names: dsa_topk/layer_07/member_agreement, ...; dsa_topk/all/... over every layer.
_METRIC_PREFIX = "dsa_topk"


class _TopkMonitor:
    """Per-layer agreement with the engine, accumulated on the device (no host sync)."""

    _SUMS = ("common", "members", "identical", "rows", "flipped", "margin", "margin_rows",
             "margin_flipped", "flipped_rows", "flipped_tied", "flipped_strict", "digest_mismatch",
             "digest_compared", "replayed", "tied", "undecided")  # fmt: skip

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.flipped_max: torch.Tensor | None = None

    def update(
        self, ours: torch.Tensor, engine: torch.Tensor, margins: torch.Tensor | None = None
    ) -> None:
        """Add one micro-batch: ``ours`` and ``engine`` ``(..., k)`` picks of the same rows,
        ``margins`` ``(...)`` per row (NaN where undefined)."""
        a, same = _agreement_and_identical_rows(ours, engine)
        f64 = torch.float64
        rows = a.rows.to(f64)

        def total(mean: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            # A micro-batch with no engine row adds nothing (its means are NaN); a broken one
            # (NaN with rows) makes the layer's metrics NaN.
            return torch.where(a.rows > 0, mean * n, 0.0)

        values = {
            "common": total(a.member_agreement, a.members.to(f64)),
            "members": a.members.to(f64),
            "identical": total(a.rows_identical, rows),
            "rows": rows,
            "flipped": total(a.flipped_mean, rows),
        }
        if margins is not None:
            m = margins.reshape(-1).to(f64)
            defined = ~torch.isnan(m)
            ran = (engine >= 0).any(-1).reshape(-1)  # rows the engine computed (topk_agreement's)
            flipped = defined & ~same.reshape(-1) & ran
            values |= {
                "margin": torch.where(defined, m, 0.0).sum(),
                "margin_rows": defined.sum().to(f64),
                "margin_flipped": torch.where(flipped, m, 0.0).sum(),
                "flipped_rows": flipped.sum().to(f64),
                "flipped_tied": (flipped & (m == 0)).sum().to(f64),
                "flipped_strict": (flipped & (m > 0)).sum().to(f64),
            }
        self._add(values)
        top = a.flipped_max.to(torch.int64)
        self.flipped_max = top if self.flipped_max is None else torch.maximum(self.flipped_max, top)

    def update_digests(self, mismatch: torch.Tensor, compared: torch.Tensor) -> None:
        """Add one micro-batch's digest comparison: ``mismatch`` and ``compared`` ``(rows,)``
        bool (rows whose digest differs from the engine's; rows compared)."""
        f64 = torch.float64
        self._add(
            {
                "digest_mismatch": (mismatch & compared).sum().to(f64),
                "digest_compared": compared.sum().to(f64),
            }
        )

    def update_tied_rows(
        self,
        replayed: torch.Tensor,
        tied: torch.Tensor,
        mismatch: torch.Tensor,
        compared: torch.Tensor,
    ) -> None:
        """Add one micro-batch of ``replay_ties``, all ``(rows,)`` bool: the rows whose engine
        picks replaced the layer's, the rows whose own boundary is tied, the rows whose final
        digest differs from the engine's, and the rows compared. A tied row the engine did not
        send is *undecided*: kept as computed, counted, never guessed."""
        f64 = torch.float64
        self._add(
            {
                "replayed": replayed.sum().to(f64),
                "tied": tied.sum().to(f64),
                "undecided": (tied & ~replayed).sum().to(f64),
            }
        )
        self.update_digests(mismatch, compared)

    def _add(self, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def raw(self) -> torch.Tensor:
        """float64 ``[len(_SUMS) + 1]``: the sums then ``flipped_max`` (for an all-reduce)."""
        held = [*self.sums.values(), self.flipped_max]
        device = next((t.device for t in held if t is not None), "cpu")
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = [self.sums.get(n, zero) for n in self._SUMS]
        top = self.flipped_max.to(torch.float64) if self.flipped_max is not None else zero
        return torch.stack([*sums, top])

    def reset(self) -> None:
        self.sums.clear()
        self.flipped_max = None

    def causes(self) -> dict[str, int]:
        """The differing rows since the last reset by cause (``verify``): ``tie_rows`` (own
        boundary tied), ``precision_rows`` (strict); what ``topk_metrics`` names
        ``flipped_tied_rows`` and ``flipped_precision_rows``. One host synchronisation."""
        held = [self.sums.get(n) for n in ("flipped_tied", "flipped_strict")]
        device = next((t.device for t in held if t is not None), "cpu")
        zero = torch.zeros((), dtype=torch.float64, device=device)
        tied, strict = torch.stack([zero if t is None else t for t in held]).tolist()
        return {"tie_rows": int(tied), "precision_rows": int(strict)}


def _metrics(name: str, raw: list[float]) -> dict[str, float]:
    s = dict(zip(_TopkMonitor._SUMS, raw[:-1], strict=True))
    nan = float("nan")
    return {
        f"{name}/member_agreement": s["common"] / s["members"] if s["members"] else nan,
        f"{name}/rows_identical": s["identical"] / s["rows"] if s["rows"] else nan,
        f"{name}/flipped_per_row": s["flipped"] / s["rows"] if s["rows"] else nan,
        f"{name}/flipped_max": raw[-1],
        f"{name}/rows": s["rows"],
        f"{name}/margin_mean": s["margin"] / s["margin_rows"] if s["margin_rows"] else nan,
        f"{name}/margin_mean_flipped": (
            s["margin_flipped"] / s["flipped_rows"] if s["flipped_rows"] else nan
        ),
        f"{name}/flipped_tied_rows": s["flipped_tied"],
        f"{name}/flipped_precision_rows": s["flipped_strict"],
        f"{name}/digest_mismatch_rows": s["digest_mismatch"],
        f"{name}/digest_compared_rows": s["digest_compared"],
        f"{name}/replayed_rows": s["replayed"],
        f"{name}/tied_rows": s["tied"],
        f"{name}/undecided_rows": s["undecided"],
    }


def topk_metrics(
    model: torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...],
    *,
    reset: bool = True,
    group: torch.distributed.ProcessGroup | None = None,
) -> dict[str, float]:
    """Every monitored layer's metrics since the last reset, as ``{name: value}``.

    Names: ``dsa_topk/layer_NN/{member_agreement, rows_identical, flipped_per_row, flipped_max,
    rows, margin_mean, margin_mean_flipped, flipped_tied_rows, flipped_precision_rows,
    digest_mismatch_rows, digest_compared_rows, replayed_rows, tied_rows, undecided_rows}`` and
    ``dsa_topk/all/...`` over every layer (the digest counts are 0 without engine digests).
    ``flipped_tied_rows`` (``verify``): differing rows whose own boundary is tied (margin 0),
    where no precision can decide the engine's choice (a tie when the engine scored these
    logits: ``classify_rows`` with the scores tells exactly); ``flipped_precision_rows``:
    differing rows whose own boundary is strict (margin > 0: their top-k is unique, so the
    engine's set is no top-k of these scores: a precision difference, or an invalid set).
    ``replayed_rows``, ``tied_rows``, ``undecided_rows``
    (``replay_ties``): rows that took the engine's picks, rows the layer finds tied, and tied
    rows the engine did not send (kept as computed). With
    ``group`` (e.g. the data-parallel group) the counts are summed (``flipped_max``: max) across
    its ranks first. One host synchronisation. ``model``: the model, or Megatron's list of its
    model chunks (virtual pipeline parallelism).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(m, torch.nn.Module) for m in chunks):
        raise TypeError(
            f"topk_metrics takes the model (a torch.nn.Module) or Megatron's list of its model "
            f"chunks, got {type(model).__name__} {[type(m).__name__ for m in chunks][:4]}."
        )
    # The attention layers' own attributes, which nn.Module's __getattr__ types as Tensor | Module.
    modules: Iterator[Any] = (m for chunk in chunks for m in chunk.modules())
    monitors: dict[int, _TopkMonitor] = {
        m.layer_number: m.topk_monitor
        for m in modules
        if getattr(m, "topk_monitor", None) is not None and m.topk_monitor.sums
    }
    if not monitors:
        return {}
    layers = sorted(monitors)
    raw = torch.stack([monitors[n].raw() for n in layers])
    if group is not None:
        sums = raw[:, :-1].contiguous()
        top = raw[:, -1].contiguous()
        torch.distributed.all_reduce(sums, group=group)
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        raw = torch.cat((sums, top[:, None]), dim=1)
    total = torch.cat((raw[:, :-1].sum(0), raw[:, -1].max().view(1)))
    values = torch.cat((raw, total[None])).tolist()
    out: dict[str, float] = {}
    for n, row in zip([*layers, None], values, strict=True):
        out |= _metrics(f"{_METRIC_PREFIX}/" + (f"layer_{n:02d}" if n else "all"), row)
    if reset:
        for n in layers:
            monitors[n].reset()
    return out
