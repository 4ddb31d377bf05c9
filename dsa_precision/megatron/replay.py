"""Where a DSA layer's top-k comes from, and how far it is from the inference engine's.

``dsa_indexer_topk_source`` (a :class:`DSAPrecisionTransformerConfig` field):

- ``"compute"`` (default): the layer selects its keys as configured.
- ``"replay"``: the layer attends to the keys the engine picked for this micro-batch; its indexer
  does not score. Needs zero indexer loss.
- ``"verify"``: the layer selects as configured and compares its picks with the engine's.

The engine's picks reach the model through :func:`engine_topk`, a context manager around the
forward of one micro-batch, in the engines' layout: per token, ``topk`` sequence-relative key
positions (``0 <= key <= the token's position``), ``-1`` padding, tokens packed across sequences
(THD, with ``cu_seqlens``) or batch-major (BSHD, with ``seq_len``), one tensor per layer number.
Each rank takes its own rows (sequence and context parallelism: the global rows of its queries).
Layers that reuse another layer's top-k (index sharing) follow Megatron's rule and reuse the
source layer's picks, replayed or computed.

Checks (one :class:`~dsa_precision.topk_layout.TokenLayout`, the package's shared check of picks
that enter from outside): :func:`engine_topk` always checks host facts (the layout's types, each
layer's ``(T, k)`` integer picks, their device; ``cu_seqlens`` held on the CPU, its values), and
each layer, when it reads its picks, that they are in its own layout (BSHD: the model's sequence
length and batch; THD: its ``PackedSeqParams``' number of sequences, and their ``cu_seqlens``
values when both are on the CPU) -- no host synchronisation. The data (causal range, duplicate
keys, device ``cu_seqlens`` values against the layer's) is checked only with validation on, one
host synchronisation per layer: ``engine_topk(validate=True)``, or for every call that does not
say, ``DSA_PRECISION_VALIDATE=1`` / :func:`set_replay_validation` (a debug run). It is off by
default, so that a training step does not wait for the host.

Monitoring: in ``verify`` (and in ``compute`` when indices are handed in and the layer's picks are
the package's, i.e. FP8 scoring), every layer accumulates on the device, without host
synchronisation, its member agreement, identical rows and flipped picks, and (``verify``) the
margin of each row (its ``topk``-th minus its ``(topk+1)``-th score): :func:`topk_metrics` reads
them as a dict for Megatron's TensorBoard / W&B writers. :func:`capture_topk` records each layer's
picks in the engines' layout, e.g. to save them (:func:`save_topk`) for ``dsa-precision agree``.

Digests (verify without the payload): :func:`engine_topk` also takes, instead of the picks or
beside them, the engine's per-row digests (``engine_digests={layer: (T,) int64}``, the
:func:`dsa_precision.capture.digest_rows` of each token's sequence-relative picks, and
``engine_rows``, the ``(T,)`` bool rows the engine computed, both from
:func:`dsa_precision.capture.pack_digests`). Each layer digests its own picks in the same
sequence-relative form (:class:`CapturedTopk`'s) and counts, on the device, the rows it compares
and those whose digest differs: ``digest_mismatch_rows`` and ``digest_compared_rows`` in
:func:`topk_metrics`. 8 bytes per row and layer move instead of ``4 k``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch

from ..agreement import _agreement_and_identical_rows
from ..devices import to_device
from ..rows import packed_sequence_of
from ..topk_layout import TokenLayout

__all__ = [
    "TOPK_SOURCES",
    "CapturedTopk",
    "EngineTopk",
    "TopkMonitor",
    "capture_topk",
    "engine_topk",
    "load_topk",
    "replay_validation_enabled",
    "save_topk",
    "set_replay_validation",
    "topk_metrics",
]

TopkSource = Literal["compute", "replay", "verify"]
TOPK_SOURCES = ("compute", "replay", "verify")
# Metric names: dsa_topk/layer_07/member_agreement, ...; dsa_topk/all/... over every layer.
METRIC_PREFIX = "dsa_topk"


@dataclasses.dataclass(frozen=True)
class EngineTopk:
    """One micro-batch's engine top-k (see the module docstring for the layout), as checked by
    :func:`engine_topk`; ``validate``: whether the layers also check the data against their own
    layout (one host synchronisation per layer). ``digests``: layer number -> the engine's
    ``(T,)`` int64 row digests, ``engine_rows`` the ``(T,)`` bool rows it computed (``None``:
    every row)."""

    indices: Mapping[int, torch.Tensor]  # layer number -> (T, k) integer; empty: digests only
    layout: TokenLayout
    validate: bool = False
    digests: Mapping[int, torch.Tensor] | None = None
    engine_rows: torch.Tensor | None = None

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """THD: ``(n + 1,)`` cumulative lengths of the ``T`` tokens."""
        return self.layout.cu_seqlens

    @property
    def seq_len(self) -> int | None:
        """BSHD: tokens per sequence (``T = batch * seq_len``)."""
        return self.layout.seq_len

    def layer(self, layer_number: int) -> torch.Tensor:
        if not self.indices:
            raise ValueError(
                f"engine_topk holds only digests, no picks, for DSA layer {layer_number}: "
                "digests verify, replay needs the picks; pass engine_topk(indices=...)."
            )
        if layer_number not in self.indices:
            raise KeyError(
                f"engine_topk holds no indices for DSA layer {layer_number} (it has layers "
                f"{sorted(self.indices)}); replay and verify need every top-k-computing layer's."
            )
        return self.indices[layer_number]

    def rows(
        self,
        layer_number: int,
        positions: torch.Tensor | None,
        batch: int,
        topk: int,
        consumer: TokenLayout,
        *,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """The engine's picks of a rank's query rows, in ``DSAttention``'s key coordinates:
        ``(batch, rows, topk)`` int32 (BSHD: key positions; THD: global packed key rows).

        ``positions``: Megatron's global position (BSHD) or packed row (THD) of each query row;
        ``None`` (BSHD): every row of every sequence, in order (one CP rank, no sequence-parallel
        slice), on ``device``: the picks as handed in, one copy. ``consumer``: the layer's own
        layout (its global sequence length, or the ``cu_seqlens`` of its ``PackedSeqParams``),
        which the picks must match (host facts always; the values of device ``cu_seqlens`` only
        with ``validate``)."""
        name = f"engine_topk layer {layer_number}"
        where = f"DSA layer {layer_number}"
        idx = self.layer(layer_number)
        self.layout.check_consumer(name, consumer, where=where, validate=self.validate)
        if idx.shape[1] > topk:
            raise ValueError(
                f"{name} holds {idx.shape[1]} keys per token, more than the layer's "
                f"dsa_indexer_topk={topk}; pass at most {topk} picks per token."
            )
        if positions is not None:
            device = positions.device
        elif device is None or self.layout.seq_len is None:
            raise ValueError("rows(positions=None) needs a BSHD layout and the rows' device.")
        if idx.device != device and idx.device.type != "cpu":
            raise ValueError(
                f"{name} is on {idx.device}, {where} on {device}; hand in the picks "
                f"on {device} or the CPU (pinned memory copies without a sync)."
            )
        total = idx.shape[0]
        self._check_batch_rows(name, where, total, batch, "picks")
        moved = to_device(idx, device)
        if positions is None:  # every row in order: the picks themselves, in their layout,
            # copied once (by the move, the cast, or else here: never the engine's tensor)
            picks = moved.reshape(batch, self.seq_len, -1).to(torch.int32, copy=moved is idx)
        elif self.layout.seq_len is not None:
            tokens = torch.arange(batch, device=device).view(-1, 1) * self.seq_len + positions
            picks = moved[tokens].to(torch.int32)
        else:
            cu = to_device(self.layout.cu_seqlens, device, torch.int64)
            valid = positions < total  # padding rows past the packed tokens select nothing
            safe = positions.clamp(max=total - 1)
            start = cu[packed_sequence_of(cu, safe)]
            picks = moved[safe].to(torch.int64)
            picks = torch.where((picks >= 0) & valid[:, None], picks + start[:, None], -1)
            picks = picks.to(torch.int32).unsqueeze(0)
        if picks.shape[-1] == topk:
            return picks
        return torch.nn.functional.pad(picks, (0, topk - picks.shape[-1]), value=-1)

    def _check_batch_rows(self, name: str, where: str, total: int, batch: int, what: str) -> None:
        """BSHD: the ``total`` rows handed in are the layer's ``batch`` sequences (host ints)."""
        if self.layout.seq_len is not None and total != batch * self.layout.seq_len:
            raise ValueError(
                f"{name}: {total} token rows, but {where} runs {batch} sequences of "
                f"{self.layout.seq_len} tokens ({batch * self.layout.seq_len} rows); pass "
                f"this micro-batch's {what}, batch-major."
            )

    def digest_rows(
        self, layer_number: int, tokens: torch.Tensor, batch: int, consumer: TokenLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's digests of a rank's rows and which of them to compare, on the rows'
        device (no synchronisation): ``((rows,) int64, (rows,) bool)``.

        ``tokens``: ``(rows,)`` int64 global token of each row (BSHD: ``b * seq_len + position``;
        THD: the packed row; padding rows past the ``T`` tokens are not compared); ``consumer``:
        the layer's own layout, checked as in :meth:`rows`."""
        name = f"engine_topk digests of layer {layer_number}"
        where = f"DSA layer {layer_number}"
        if layer_number not in self.digests:
            raise KeyError(
                f"engine_topk holds no digests for DSA layer {layer_number} (it has layers "
                f"{sorted(self.digests)}); verify needs every top-k-computing layer's."
            )
        self.layout.check_consumer(name, consumer, where=where, validate=self.validate)
        digests = self.digests[layer_number]
        total = digests.shape[0]
        self._check_batch_rows(name, where, total, batch, "digests")
        device = tokens.device
        inside = tokens < total
        safe = tokens.clamp(max=max(total - 1, 0))
        theirs = to_device(digests, device)[safe]
        if self.engine_rows is not None:
            inside = inside & to_device(self.engine_rows, device)[safe]
        return theirs, inside


_ENGINE: contextvars.ContextVar[EngineTopk | None] = contextvars.ContextVar(
    "dsa_precision_engine_topk", default=None
)
_CAPTURE: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "dsa_precision_capture_topk", default=None
)

# The debug switch of replay-index validation (see replay_validation_enabled).
VALIDATE_ENV = "DSA_PRECISION_VALIDATE"
_VALIDATION: bool | None = None


def set_replay_validation(enabled: bool | None) -> None:
    """Turn the data checks of :func:`engine_topk` on or off for every later call that does not
    pass ``validate``; ``None`` returns to the environment (``DSA_PRECISION_VALIDATE``)."""
    global _VALIDATION
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"set_replay_validation(enabled={enabled!r}): pass True, False or None (the "
            f"environment, {VALIDATE_ENV})."
        )
    _VALIDATION = enabled


def replay_validation_enabled() -> bool:
    """Whether :func:`engine_topk` checks the data when not told: :func:`set_replay_validation`
    when it was called, else ``DSA_PRECISION_VALIDATE`` (``1``/``true``/``yes``/``on``); off by
    default (the step does not synchronise)."""
    if _VALIDATION is not None:
        return _VALIDATION
    return os.environ.get(VALIDATE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _checked(
    indices: Mapping[int, torch.Tensor], layout: TokenLayout, validate: bool
) -> dict[int, torch.Tensor]:
    """The layers' picks, checked against ``layout``: host facts always (types, dtypes, shapes,
    devices; CPU ``cu_seqlens`` values), the data with ``validate`` (one synchronisation per
    layer). Errors name the layer."""
    if not isinstance(indices, Mapping):
        raise TypeError(
            f"engine_topk takes {{layer_number: (T, k) indices}}, got {type(indices).__name__}."
        )
    if not indices:
        raise ValueError("engine_topk got no layers; pass {layer_number: (T, k) indices}.")
    devices = {}
    for layer, idx in indices.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise ValueError(f"engine_topk keys are 1-based layer numbers, got {layer!r}.")
        name = f"engine_topk layer {layer}"
        if validate:
            layout.validate_indices(name, idx)
        else:
            layout.check_indices(name, idx)
        devices.setdefault(idx.device, layer)
    if len(devices) > 1:
        where = ", ".join(f"layer {n} on {d}" for d, n in devices.items())
        raise ValueError(f"engine_topk: the layers' picks are on different devices ({where}); "
                         "hand them in on one device.")  # fmt: skip
    return dict(indices)


def _checked_digests(
    digests: Mapping[int, torch.Tensor],
    engine_rows: torch.Tensor | None,
    layout: TokenLayout,
    indices: Mapping[int, torch.Tensor],
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """The layers' engine digests and ``engine_rows``, host facts only (types, dtypes, shapes,
    devices, ``T`` against the layout and the picks). Errors name the layer and the fix."""
    if not isinstance(digests, Mapping) or not digests:
        raise TypeError(
            "engine_topk(engine_digests=...) takes {layer_number: (T,) int64 digests} (e.g. from "
            f"dsa_precision.capture.pack_digests), got {type(digests).__name__} {digests!r:.60}."
        )
    lengths = {t.shape[0] for t in indices.values()}
    devices = {t.device for t in indices.values()}
    for layer, d in digests.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise ValueError(f"engine_digests keys are 1-based layer numbers, got {layer!r}.")
        name = f"engine_digests layer {layer}"
        if not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or d.ndim != 1:
            got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
            hint = " (per-row picks? digest them: digest_rows(picks))" if _is_picks(d) else ""
            raise TypeError(f"{name}: expected (T,) int64 row digests, got {got}{hint}.")
        if d.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {d.device}; hold the digests on the CPU or a GPU.")
        fix = "pass one digest per packed token of this micro-batch (pack_digests)"
        layout.check_rows(name, d.shape[0], fix=fix)
        lengths.add(d.shape[0])
        devices.add(d.device)
    if len(lengths) > 1:
        raise ValueError(
            f"engine_topk: the picks and digests hold different token counts {sorted(lengths)}; "
            "hand in one micro-batch's rows for every layer."
        )
    if engine_rows is not None:
        (total,) = lengths
        if not (
            isinstance(engine_rows, torch.Tensor)
            and engine_rows.dtype == torch.bool
            and engine_rows.shape == (total,)
        ):
            got = (
                f"{engine_rows.dtype} {tuple(engine_rows.shape)}"
                if isinstance(engine_rows, torch.Tensor)
                else type(engine_rows).__name__
            )
            raise TypeError(
                f"engine_rows: expected a ({total},) bool tensor (the rows the engine computed, "
                f"from pack_digests), got {got}."
            )
        devices.add(engine_rows.device)
    if len(devices) > 1:
        raise ValueError(
            f"engine_topk: picks, digests and engine_rows are on different devices "
            f"({sorted(map(str, devices))}); hand them in on one device."
        )
    return dict(digests), engine_rows


def _is_picks(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 2


@contextlib.contextmanager
def engine_topk(
    indices: Mapping[int, torch.Tensor] | None = None,
    *,
    engine_digests: Mapping[int, torch.Tensor] | None = None,
    engine_rows: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_len: int | None = None,
    validate: bool | None = None,
) -> Iterator[EngineTopk]:
    """Hand one micro-batch's engine top-k to the model for the forward inside the block.

    Always checked, on the host (no synchronisation): the layout (``seq_len`` a positive int,
    ``cu_seqlens`` a 1-D int32/int64 tensor; held on the CPU, its values too), each layer's
    ``(T, k)`` integer picks and their device; and, when a layer reads them, that the layout is
    the layer's own (BSHD: ``seq_len`` is the model's sequence length and ``T`` its batch of
    sequences; THD: as many sequences as its ``PackedSeqParams``, equal ``cu_seqlens`` when both
    are on the CPU) and ``k <= dsa_indexer_topk``.

    Args:
        indices: layer number (1-based, Megatron's) -> ``(T, k)`` engine picks (see the module
            docstring); all on one device, the CPU or the layers' (copied to the layer's when it
            reads them; from pinned memory without a synchronisation). ``None``: digests only.
        engine_digests: layer number -> ``(T,)`` int64 digests of the engine's rows
            (:func:`dsa_precision.capture.digest_rows` of the sequence-relative picks;
            :func:`dsa_precision.capture.pack_digests` packs them), instead of or beside
            ``indices``: verify (and FP8 compute) compares each layer's own picks with them by
            digest. Replay needs ``indices``.
        engine_rows: ``(T,)`` bool, the rows the engine computed (``pack_digests``); the other
            rows are not compared. ``None``: every row.
        cu_seqlens: ``(n + 1,)`` cumulative lengths of the packed tokens (THD micro-batches), as
            the model's ``PackedSeqParams`` hold them.
        seq_len: tokens per sequence of a BSHD micro-batch (``T = batch * seq_len``).
        validate: also check the data: the causal range, duplicate keys, ``T`` against
            ``cu_seqlens[-1]``, and at each layer the ``cu_seqlens`` values against its
            ``PackedSeqParams``: one host synchronisation per layer here and per layer
            forward. ``None`` (default): :func:`replay_validation_enabled`, i.e. on when
            ``DSA_PRECISION_VALIDATE=1`` or :func:`set_replay_validation` (a debug run), off
            in a training step.
    """
    if validate is None:
        validate = replay_validation_enabled()
    elif not isinstance(validate, bool):
        raise TypeError(f"engine_topk(validate={validate!r}): pass True, False or None.")
    layout = TokenLayout(cu_seqlens=cu_seqlens, seq_len=seq_len)
    if engine_rows is not None and engine_digests is None:
        raise ValueError(
            "engine_topk(engine_rows=...) marks the rows of engine_digests; pass engine_digests "
            "too (pack_digests returns both)."
        )
    if indices is None and engine_digests is None:
        raise ValueError(
            "engine_topk needs the engine's picks (indices={layer: (T, k)}) or their digests "
            "(engine_digests={layer: (T,) int64}); got neither."
        )
    picks = {} if indices is None else _checked(indices, layout, validate)
    digests, rows = (
        (None, None)
        if engine_digests is None
        else _checked_digests(engine_digests, engine_rows, layout, picks)
    )
    engine = EngineTopk(picks, layout, validate, digests, rows)
    token = _ENGINE.set(engine)
    try:
        yield engine
    finally:
        _ENGINE.reset(token)


def current_engine_topk() -> EngineTopk | None:
    return _ENGINE.get()


@dataclasses.dataclass(frozen=True)
class CapturedTopk:
    """A layer's picks on this rank, in the engines' layout."""

    tokens: torch.Tensor  # (rows,) int64: each row's global token (BSHD: batch * S + position)
    indices: torch.Tensor  # (rows, k) int32: sequence-relative key positions, -1 padding


@contextlib.contextmanager
def capture_topk() -> Iterator[dict[int, CapturedTopk]]:
    """Record every DSA layer's top-k during the block: ``{layer_number: CapturedTopk}``.

    A layer records the picks it attends to (replayed, or the package's selection); a layer on
    Megatron's own BF16 path records the package's BF16 selection of the same operands (one more
    scoring pass; Megatron's own picks can differ from it only at exact ties).
    """
    captured: dict[int, CapturedTopk] = {}
    token = _CAPTURE.set(captured)
    try:
        yield captured
    finally:
        _CAPTURE.reset(token)


def current_capture() -> dict[int, CapturedTopk] | None:
    return _CAPTURE.get()


class TopkMonitor:
    """Per-layer agreement with the engine, accumulated on the device (no host sync)."""

    _SUMS = ("common", "members", "identical", "rows", "flipped", "margin", "margin_rows",
             "margin_flipped", "flipped_rows", "digest_mismatch", "digest_compared")  # fmt: skip

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
        values = {
            "common": a.member_agreement * a.members.to(f64),
            "members": a.members.to(f64),
            "identical": a.rows_identical * rows,
            "rows": rows,
            "flipped": a.flipped_mean * rows,
        }
        if margins is not None:
            m = margins.reshape(-1).to(f64)
            defined = ~torch.isnan(m)
            flipped = defined & ~same.reshape(-1)
            values |= {
                "margin": torch.where(defined, m, 0.0).sum(),
                "margin_rows": defined.sum().to(f64),
                "margin_flipped": torch.where(flipped, m, 0.0).sum(),
                "flipped_rows": flipped.sum().to(f64),
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


def _metrics(name: str, raw: list[float]) -> dict[str, float]:
    s = dict(zip(TopkMonitor._SUMS, raw[:-1], strict=True))
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
        f"{name}/digest_mismatch_rows": s["digest_mismatch"],
        f"{name}/digest_compared_rows": s["digest_compared"],
    }


def topk_metrics(
    model: torch.nn.Module,
    *,
    reset: bool = True,
    group: torch.distributed.ProcessGroup | None = None,
) -> dict[str, float]:
    """Every monitored layer's metrics since the last reset, as ``{name: value}``.

    Names: ``dsa_topk/layer_NN/{member_agreement, rows_identical, flipped_per_row, flipped_max,
    rows, margin_mean, margin_mean_flipped, digest_mismatch_rows, digest_compared_rows}`` and
    ``dsa_topk/all/...`` over every layer (the digest counts are 0 without engine digests). With
    ``group`` (e.g. the data-parallel group) the counts are summed (``flipped_max``: max) across
    its ranks first. One host synchronisation.
    """
    monitors = {
        m.layer_number: m.topk_monitor
        for m in model.modules()
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
        out |= _metrics(f"{METRIC_PREFIX}/" + (f"layer_{n:02d}" if n else "all"), row)
    if reset:
        for n in layers:
            monitors[n].reset()
    return out


def save_topk(
    path: str | Path,
    indices: Mapping[int, torch.Tensor],
    *,
    cu_seqlens: torch.Tensor | None = None,
    seq_len: int | None = None,
) -> None:
    """Save per-layer top-k in the replay file format ``agree`` and :func:`load_topk` read: a
    ``.pt`` or ``.safetensors`` dict of ``layer_NN`` -> ``(T, k)`` tensors, plus ``cu_seqlens`` or
    ``seq_len``."""
    tensors = {f"layer_{n:02d}": t.detach().cpu().contiguous() for n, t in sorted(indices.items())}
    if cu_seqlens is not None:
        tensors["cu_seqlens"] = cu_seqlens.detach().cpu().to(torch.int64)
    if seq_len is not None:
        tensors["seq_len"] = torch.tensor([seq_len], dtype=torch.int64)
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)


def load_topk(path: str | Path) -> tuple[dict[int, torch.Tensor], dict[str, object]]:
    """The per-layer indices of a replay file and its layout (``cu_seqlens`` / ``seq_len``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    layers = {
        int(k.removeprefix("layer_")): v for k, v in tensors.items() if k.startswith("layer_")
    }
    layout: dict[str, object] = {}
    if "cu_seqlens" in tensors:
        layout["cu_seqlens"] = tensors["cu_seqlens"]
    if "seq_len" in tensors:
        layout["seq_len"] = int(tensors["seq_len"][0])
    return layers, layout
