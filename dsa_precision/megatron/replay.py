"""Where a DSA layer's top-k comes from: computed, or the engine's picks handed in.

``dsa_indexer_topk_source`` (a :class:`DSAPrecisionTransformerConfig` field):

- ``"compute"`` (default): the layer selects its keys as configured.
- ``"replay"``: the layer attends to the keys the engine picked for this micro-batch; its indexer
  does not score. Needs zero indexer loss.
- ``"verify"``: the layer selects as configured and compares its picks with the engine's
  (:mod:`.monitor`).
- ``"replay_ties"``: the layer selects as configured, then takes the engine's picks for the rows
  the engine sent (its boundary-tied rows, where its choice among tied keys is not a function of
  its scores: :mod:`dsa_precision.capture.ties`) and keeps its own for the others; the engine's
  digest of every row checks them. Rows it finds tied that the engine did not send, and rows whose
  digest still differs, are counted on the device (:func:`~.monitor.topk_metrics`), never
  guessed.

The engine's picks (:class:`~dsa_precision.picks.TopkPicks`, from the capture adapters or a
file) reach the model through :func:`engine_topk`, a context manager around the forward of one
micro-batch. Each rank takes its own rows (sequence and context parallelism: the global rows of
its queries); layers that reuse another layer's top-k (index sharing) follow Megatron's rule and
reuse the source layer's picks. What is checked, and when it costs a host synchronisation:
docs/robustness.md, "Replay".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Literal

import numpy as np
import torch

from ..checks import _describe
from ..devices import _to_device
from ..picks import TokenLayout, TopkPicks, _check_key_range
from ..rows import _packed_sequence_of

__all__ = ["engine_topk", "set_replay_validation"]

_TopkSource = Literal["compute", "replay", "verify", "replay_ties"]
_TOPK_SOURCES = ("compute", "replay", "verify", "replay_ties")


@dataclasses.dataclass(frozen=True)
class _HandedIn:
    """The picks handed in for the forward inside :func:`engine_topk`, as checked there;
    ``validate``: whether each layer also checks the data against its own layout (one host
    synchronisation per layer)."""

    picks: TopkPicks
    validate: bool = False
    # The layers that compared their picks with these already (see first_count).
    counted: set[int] = dataclasses.field(default_factory=set, compare=False, repr=False)

    def first_count(self, layer: torch.nn.Module) -> bool:
        """Whether ``layer`` compares its picks with these for the first time inside this
        :func:`engine_topk` block: a recomputed forward (activation checkpointing) of the same
        micro-batch is not counted twice."""
        key = id(layer)
        if key in self.counted:
            return False
        self.counted.add(key)
        return True

    def layer(self, layer_number: int) -> torch.Tensor:
        """The ``(T, k)`` picks of one layer; an error naming the layers held otherwise."""
        indices = self.picks.indices
        if not indices:
            raise ValueError(
                f"engine_topk holds only digests, no picks, for DSA layer {layer_number}: "
                "digests verify, replay needs the picks; pass engine_topk(indices=...)."
            )
        if self.picks.sent is not None:
            raise ValueError(
                f"engine_topk holds the picks of the engine's tied rows only (pack_tie_rows), "
                f"not every row of DSA layer {layer_number}: replay needs every row; train with "
                "dsa_indexer_topk_source='replay_ties', which computes the others."
            )
        if layer_number not in indices:
            raise KeyError(
                f"engine_topk holds no indices for DSA layer {layer_number} (it has layers "
                f"{sorted(indices)}); replay and verify need every top-k-computing layer's."
            )
        return indices[layer_number]

    def rows(
        self,
        layer_number: int,
        positions: torch.Tensor | None,
        batch: int,
        topk: int,
        consumer: TokenLayout,
        *,
        device: torch.device | None = None,
        compared: bool = False,
    ) -> torch.Tensor:
        """The engine's picks of a rank's query rows, in ``DSAttention``'s key coordinates:
        ``(batch, rows, topk)`` int32 (BSHD: key positions; THD: global packed key rows).
        ``compared``: for a comparison with the layer's own picks, the rows the engine never
        computed (``engine_rows`` False) empty, so that no agreement counts them.

        ``positions``: Megatron's global position (BSHD) or packed row (THD) of each query row;
        ``None`` (BSHD): every row of every sequence, in order (one CP rank, no sequence-parallel
        slice), on ``device``: the picks as handed in, one copy. ``consumer``: the layer's own
        layout (its global sequence length, or the ``cu_seqlens`` of its ``PackedSeqParams``),
        which the picks must match (host facts always; the values of device ``cu_seqlens`` only
        with ``validate``)."""
        name = f"engine_topk layer {layer_number}"
        where = f"DSA layer {layer_number}"
        idx = self.layer(layer_number)
        assert self.picks.layout is not None  # engine_topk hands in picks with a layout
        self.picks.layout.check_consumer(name, consumer, where=where, validate=self.validate)
        if idx.shape[1] > topk:
            raise ValueError(
                f"{name} holds {idx.shape[1]} keys per token, more than the layer's "
                f"dsa_indexer_topk={topk}; pass at most {topk} picks per token."
            )
        if positions is not None:
            device = positions.device
        elif device is None or self.picks.seq_len is None:
            raise ValueError("rows(positions=None) needs a BSHD layout and the rows' device.")
        if idx.device != device and idx.device.type != "cpu":
            raise ValueError(
                f"{name} is on {idx.device}, {where} on {device}; hand in the picks "
                f"on {device} or the CPU (pinned memory copies without a sync)."
            )
        total = idx.shape[0]
        self._check_batch_rows(name, where, total, batch, "picks")
        moved = _to_device(idx, device)
        if compared and self.picks.engine_rows is not None:
            ran = _to_device(self.picks.engine_rows, device)
            moved = torch.where(ran[:, None], moved, -1)
        if positions is None:  # every row in order: the picks themselves, in their layout,
            # copied once (by the move, the cast, or else here: never the engine's tensor)
            assert self.picks.seq_len is not None  # checked above
            picks = moved.reshape(batch, self.picks.seq_len, -1).to(torch.int32, copy=moved is idx)
        elif self.picks.seq_len is not None:
            tokens = torch.arange(batch, device=device).view(-1, 1) * self.picks.seq_len + positions
            picks = moved[tokens].to(torch.int32)
        else:
            assert self.picks.cu_seqlens is not None  # THD
            cu = _to_device(self.picks.cu_seqlens, device, torch.int64)
            valid = positions < total  # padding rows past the packed tokens select nothing
            safe = positions.clamp(max=total - 1)
            start = cu[_packed_sequence_of(cu, safe)]
            picks = moved[safe].to(torch.int64)
            picks = torch.where((picks >= 0) & valid[:, None], picks + start[:, None], -1)
            picks = picks.to(torch.int32).unsqueeze(0)
        if picks.shape[-1] == topk:
            return picks
        return torch.nn.functional.pad(picks, (0, topk - picks.shape[-1]), value=-1)

    def _check_batch_rows(self, name: str, where: str, total: int, batch: int, what: str) -> None:
        """BSHD: the ``total`` rows handed in are the layer's ``batch`` sequences (host ints)."""
        seq_len = self.picks.seq_len
        if seq_len is not None and total != batch * seq_len:
            raise ValueError(
                f"{name}: {total} token rows, but {where} runs {batch} sequences of "
                f"{seq_len} tokens ({batch * seq_len} rows); pass "
                f"this micro-batch's {what}, batch-major."
            )

    def _held(
        self,
        held: Mapping[int, torch.Tensor],
        what: str,
        layer_number: int,
        consumer: TokenLayout,
        name: str,
        needs: str,
    ) -> torch.Tensor:
        """``held[layer_number]`` once the picks' layout is checked against the layer's own
        (``consumer``); a ``KeyError`` naming the layers held otherwise."""
        if layer_number not in held:
            raise KeyError(
                f"engine_topk holds no {what} for DSA layer {layer_number} (it has layers "
                f"{sorted(held)}); {needs} needs every top-k-computing layer's."
            )
        assert self.picks.layout is not None  # engine_topk hands in picks with a layout
        where = f"DSA layer {layer_number}"
        self.picks.layout.check_consumer(name, consumer, where=where, validate=self.validate)
        return held[layer_number]

    def sent_rows(
        self,
        layer_number: int,
        tokens: torch.Tensor,
        batch: int,
        topk: int,
        consumer: TokenLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's picks of a rank's rows where the engine sent them (``replay_ties``), on
        the rows' device, no synchronisation: ``((rows, topk) int32 sequence-relative picks,
        -1 where not sent; (rows,) bool, sent)``. ``tokens`` and ``consumer`` as in
        :meth:`digest_rows`."""
        name = f"engine_topk tied rows of layer {layer_number}"
        where = f"DSA layer {layer_number}"
        sent = self.picks.sent
        if sent is None:
            raise ValueError(
                f"{name}: these picks are not the engine's tied rows (TopkPicks.sent is None); "
                "dsa_indexer_topk_source='replay_ties' takes pack_tie_rows' output (every row's "
                "digest, the tied rows' picks). For every row's picks use 'replay'."
            )
        rows = self._held(sent, "tied rows", layer_number, consumer, name, "replay_ties")
        picks = self.picks.indices[layer_number]
        if picks.shape[1] > topk:
            raise ValueError(
                f"{name} holds {picks.shape[1]} keys per token, more than the layer's "
                f"dsa_indexer_topk={topk}; pass at most {topk} picks per token."
            )
        total = (self.picks.digests or {})[layer_number].shape[0]
        self._check_batch_rows(name, where, total, batch, "tied rows")
        device = tokens.device
        rows = _to_device(rows, device, torch.int64)
        slot = torch.full((total + 1,), -1, dtype=torch.int64, device=device)
        slot[rows] = torch.arange(rows.numel(), device=device)
        index = slot[tokens.clamp(max=total)]  # rows past the T tokens: the -1 of slot[total]
        taken = index >= 0
        moved = _to_device(picks, device)
        if not rows.numel():
            theirs = torch.full((tokens.numel(), topk), -1, dtype=torch.int32, device=device)
            return theirs, taken
        theirs = torch.where(taken[:, None], moved[index.clamp(min=0)].to(torch.int32), -1)
        if theirs.shape[1] != topk:
            theirs = torch.nn.functional.pad(theirs, (0, topk - theirs.shape[1]), value=-1)
        return theirs, taken

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
        digests = self.picks.digests or {}
        layer_digests = self._held(digests, "digests", layer_number, consumer, name, "verify")
        total = layer_digests.shape[0]
        self._check_batch_rows(name, where, total, batch, "digests")
        device = tokens.device
        inside = tokens < total
        safe = tokens.clamp(max=max(total - 1, 0))
        theirs = _to_device(layer_digests, device)[safe]
        if self.picks.engine_rows is not None:
            inside = inside & _to_device(self.picks.engine_rows, device)[safe]
        return theirs, inside


_HANDED_IN: contextvars.ContextVar[_HandedIn | None] = contextvars.ContextVar(
    "dsa_precision_engine_topk", default=None
)

# The debug switch of replay-index validation (see replay_validation_enabled).
_VALIDATE_ENV = "DSA_PRECISION_VALIDATE"
_VALIDATION: bool | None = None


def set_replay_validation(enabled: bool | None) -> None:
    """Turn the data checks of :func:`engine_topk` on or off for every later call that does not
    pass ``validate``; ``None`` returns to the environment (``DSA_PRECISION_VALIDATE``)."""
    global _VALIDATION
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"set_replay_validation(enabled={enabled!r}): pass True, False or None (the "
            f"environment, {_VALIDATE_ENV})."
        )
    _VALIDATION = enabled


def _replay_validation_enabled() -> bool:
    """Whether :func:`engine_topk` checks the data when not told: :func:`set_replay_validation`
    when it was called, else ``DSA_PRECISION_VALIDATE`` (``1``/``true``/``yes``/``on``); off by
    default (the step does not synchronise)."""
    if _VALIDATION is not None:
        return _VALIDATION
    return os.environ.get(_VALIDATE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _layer_number(what: str, layer: object) -> int:
    """A layer key as a Python int: Megatron's 1-based ``layer_number`` (a NumPy integer is
    taken as its value); anything else, ``bool`` included, is refused with the reason."""
    if isinstance(layer, np.integer):
        layer = int(layer)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
        raise ValueError(
            f"{what} keys are Megatron's 1-based layer numbers (ints >= 1, a DSA layer's "
            f"layer_number), got {layer!r} ({type(layer).__name__}); key each layer's tensor "
            "by its layer number."
        )
    return layer


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
    devices: dict[torch.device, int] = {}
    indices = {_layer_number("engine_topk", layer): idx for layer, idx in indices.items()}
    for layer, idx in indices.items():
        name = f"engine_topk layer {layer}"
        if validate:
            layout.validate_indices(name, idx)
        else:
            layout.check_indices(name, idx)
            if idx.device.type == "cpu":  # host data: the key range, before any int32 cast
                _check_key_range(name, idx)
        devices.setdefault(idx.device, layer)
    if len(devices) > 1:
        where = ", ".join(f"layer {n} on {d}" for d, n in devices.items())
        raise ValueError(f"engine_topk: the layers' picks are on different devices ({where}); "
                         "hand them in on one device.")  # fmt: skip
    return dict(indices)


def _checked_digests(
    digests: Mapping[int, torch.Tensor] | None,
    engine_rows: torch.Tensor | None,
    layout: TokenLayout,
    indices: Mapping[int, torch.Tensor],
) -> tuple[dict[int, torch.Tensor] | None, torch.Tensor | None]:
    """The layers' engine digests (``None``: picks alone) and ``engine_rows``, host facts only
    (types, dtypes, shapes, devices, ``T`` against the layout and the picks). Errors name the
    layer and the fix."""
    if digests is not None and (not isinstance(digests, Mapping) or not digests):
        raise TypeError(
            "engine_topk(engine_digests=...) takes {layer_number: (T,) int64 digests} (e.g. from "
            f"dsa_precision.capture.pack_digests), got {type(digests).__name__} {digests!r:.60}."
        )
    lengths = {t.shape[0] for t in indices.values()}
    devices = {t.device for t in indices.values()}
    if digests is not None:
        digests = {_layer_number("engine_digests", layer): d for layer, d in digests.items()}
    for layer, d in (digests or {}).items():
        name = f"engine_digests layer {layer}"
        if not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or d.ndim != 1:
            got = _describe(d)
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
            raise TypeError(
                f"engine_rows: expected a ({total},) bool tensor (the rows the engine computed, "
                f"from pack_requests or pack_digests), got {_describe(engine_rows)}."
            )
        devices.add(engine_rows.device)
    if len(devices) > 1:
        raise ValueError(
            f"engine_topk: picks, digests and engine_rows are on different devices "
            f"({sorted(map(str, devices))}); hand them in on one device."
        )
    return None if digests is None else dict(digests), engine_rows


def _checked_sent(picks: TopkPicks, layout: TokenLayout, validate: bool) -> None:
    """The tied rows of :func:`~dsa_precision.capture.pack_tie_rows`: per layer, ``(n,)`` int64
    token rows and their ``(n, k)`` picks, beside every row's digest. Host facts always (layers,
    dtypes, shapes, devices); the data (rows ascending inside ``T``, the picks' causal range)
    when held on the CPU, and with ``validate`` on any device (one synchronisation per layer)."""
    sent, digests = picks.sent or {}, picks.digests
    if not isinstance(sent, Mapping) or not sent:
        raise TypeError(
            f"TopkPicks.sent: expected {{layer_number: (n,) int64 rows}}, got {sent!r:.60}."
        )
    if digests is None or set(digests) != set(sent) or set(picks.indices) != set(sent):
        raise ValueError(
            f"TopkPicks with tied rows hold layers {sorted(sent)} of rows sent, "
            f"{sorted(picks.indices)} of picks and {sorted(digests or {})} of digests; "
            "replay_ties needs the three for the same layers (pack_tie_rows builds them)."
        )
    for layer, rows in sent.items():
        name = f"engine_topk tied rows of layer {layer}"
        idx = picks.indices[layer]
        if not (isinstance(rows, torch.Tensor) and rows.dtype == torch.int64 and rows.ndim == 1):
            raise TypeError(f"{name}: expected (n,) int64 token rows, got {_describe(rows)}.")
        if not (isinstance(idx, torch.Tensor) and idx.ndim == 2 and idx.shape[0] == rows.numel()):
            raise ValueError(
                f"{name}: {rows.numel()} rows sent but picks {_describe(idx)}; pass one (k,) row "
                "of picks per row sent."
            )
        if idx.dtype not in (torch.int16, torch.int32, torch.int64) or idx.shape[1] == 0:
            raise TypeError(f"{name}: expected (n, k) integer picks, k >= 1, got {_describe(idx)}.")
        if rows.device != idx.device:
            raise ValueError(
                f"{name}: rows on {rows.device}, picks on {idx.device}; use one device."
            )
        if not (validate or rows.device.type == "cpu") or not rows.numel():
            continue
        total = digests[layer].shape[0]
        steps = rows[1:] - rows[:-1]
        position = layout.positions(total, rows.device)[rows.clamp(0, max(total - 1, 0))]
        key = idx.to(torch.int64)
        flags = torch.stack((
            (rows[:1] < 0).any() | (rows[-1:] >= total).any() | (steps <= 0).any(),
            ((key < -1) | (key > position[:, None])).any(),
        )).tolist()  # fmt: skip
        if flags[0]:
            raise ValueError(
                f"{name}: rows {rows.tolist()[:8]}... must be ascending, distinct and in "
                f"[0, {total}) (the micro-batch's tokens)."
            )
        if flags[1]:
            raise ValueError(
                f"{name}: a row's picks break 0 <= key <= position (causal, sequence-relative) "
                "or use a negative other than -1."
            )


def _is_picks(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 2


_SEPARATE = ("engine_digests", "engine_rows", "cu_seqlens", "seq_len")


@contextlib.contextmanager
def engine_topk(
    indices: TopkPicks | Mapping[int, torch.Tensor] | None = None,
    *,
    engine_digests: Mapping[int, torch.Tensor] | None = None,
    engine_rows: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_len: int | None = None,
    validate: bool | None = None,
) -> Iterator[TopkPicks]:
    """Hand one micro-batch's engine top-k to the model for the forward inside the block.

    Always checked, on the host (no synchronisation): the layout (``seq_len`` a positive int,
    ``cu_seqlens`` a 1-D int32/int64 tensor; held on the CPU, its values too), each layer's
    ``(T, k)`` integer picks and their device; and, when a layer reads them, that the layout is
    the layer's own (BSHD: ``seq_len`` is the model's sequence length and ``T`` its batch of
    sequences; THD: as many sequences as its ``PackedSeqParams``, equal ``cu_seqlens`` when both
    are on the CPU) and ``k <= dsa_indexer_topk``.

    Args:
        indices: the picks: a :class:`~dsa_precision.picks.TopkPicks` (what the capture adapters
            and :func:`~dsa_precision.capture.load_picks` return; it carries its layout,
            ``engine_rows`` and digests, so none of the keywords below is passed with it), or
            layer number (1-based, Megatron's) -> ``(T, k)`` engine picks, all on one device,
            the CPU or the layers' (copied to the layer's when it reads them; from pinned memory
            without a synchronisation). ``None``: digests only.
        engine_digests: layer number -> ``(T,)`` int64 digests of the engine's rows
            (:func:`dsa_precision.capture.digest_rows` of the sequence-relative picks;
            :func:`dsa_precision.capture.pack_digests` packs them), instead of or beside
            ``indices``: verify (and FP8 compute) compares each layer's own picks with them by
            digest. Replay needs ``indices``.
        engine_rows: ``(T,)`` bool, the rows the engine computed (``pack_requests``,
            ``pack_digests``): the other rows (a sequence's last token, filled by
            ``pack_requests``) are replayed as handed in but not compared with the layers' own
            picks (verify, the FP8 monitor). ``None``: every row.
        cu_seqlens: ``(n + 1,)`` cumulative lengths of the packed tokens (THD micro-batches), as
            the model's ``PackedSeqParams`` hold them.
        seq_len: tokens per sequence of a BSHD micro-batch (``T = batch * seq_len``).
        validate: also check the data: the causal range, duplicate keys, ``T`` against
            ``cu_seqlens[-1]``, and at each layer the ``cu_seqlens`` values against its
            ``PackedSeqParams``: one host synchronisation per layer here and per layer
            forward. ``None`` (default): on when ``DSA_PRECISION_VALIDATE=1`` or
            :func:`set_replay_validation` (a debug run), off in a training step.

    Yields:
        The checked :class:`~dsa_precision.picks.TopkPicks`.
    """
    if validate is None:
        validate = _replay_validation_enabled()
    elif not isinstance(validate, bool):
        raise TypeError(f"engine_topk(validate={validate!r}): pass True, False or None.")
    if isinstance(indices, TopkPicks):
        given = {
            name: value
            for name, value in zip(
                _SEPARATE, (engine_digests, engine_rows, cu_seqlens, seq_len), strict=True
            )
            if value is not None
        }
        if given:
            raise ValueError(
                f"engine_topk(TopkPicks, {', '.join(f'{k}=...' for k in given)}): the picks "
                "carry their layout, engine_rows and digests; pass the TopkPicks alone."
            )
        if indices.layout is None:
            raise ValueError(
                "engine_topk: these TopkPicks have no token layout; replay and verify need one "
                "(TopkPicks(..., layout=TokenLayout(cu_seqlens=...) or TokenLayout(seq_len=...)))."
            )
        if indices.tokens is not None:
            raise ValueError(
                f"engine_topk: these TopkPicks hold {indices.tokens.numel()} rows of one "
                "context-parallel rank (TopkPicks.tokens); hand in every row of the micro-batch "
                "(assemble the ranks' recorded picks first)."
            )
        picks = indices
        assert picks.layout is not None  # checked above
        if picks.sent is not None:  # the engine's tied rows (replay_ties): their own checks
            _checked_sent(picks, picks.layout, validate)
            _checked_digests(picks.digests, picks.engine_rows, picks.layout, {})
        else:
            picks = _checked_picks(
                dict(picks.indices) or None, picks.layout, picks.digests, picks.engine_rows,
                validate, picks,
            )  # fmt: skip
    else:
        layout = TokenLayout(cu_seqlens=cu_seqlens, seq_len=seq_len)
        picks = _checked_picks(indices, layout, engine_digests, engine_rows, validate, None)
    token = _HANDED_IN.set(_HandedIn(picks, validate))
    try:
        yield picks
    finally:
        _HANDED_IN.reset(token)


def _checked_picks(
    indices: Mapping[int, torch.Tensor] | None,
    layout: TokenLayout,
    engine_digests: Mapping[int, torch.Tensor] | None,
    engine_rows: torch.Tensor | None,
    validate: bool,
    given: TopkPicks | None,
) -> TopkPicks:
    """:func:`engine_topk`'s picks of every row (and digests), checked against ``layout``; a
    ``given`` ``TopkPicks`` keeps its other fields."""
    if indices is None and engine_digests is None:
        raise ValueError(
            "engine_topk needs the engine's picks (indices={layer: (T, k)}) or their digests "
            "(engine_digests={layer: (T,) int64}); got neither."
        )
    checked = {} if indices is None else _checked(indices, layout, validate)
    digests, rows = (
        (None, None)
        if engine_digests is None and engine_rows is None
        else _checked_digests(engine_digests, engine_rows, layout, checked)
    )
    if given is None:
        return TopkPicks(checked, layout, engine_rows=rows, digests=digests)
    return dataclasses.replace(given, indices=checked, engine_rows=rows, digests=digests)


def _current_handed_in() -> _HandedIn | None:
    """The picks handed in for the forward now running (:func:`engine_topk`), or ``None``."""
    return _HANDED_IN.get()
