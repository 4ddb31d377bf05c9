"""The picks: one micro-batch's top-k per layer in the engines' layout, and the one check of picks
that enter from outside.

:class:`TopkPicks` is what the capture adapters return (:mod:`dsa_precision.capture`), what replay
and verify take (``dsa_precision.megatron.engine_topk``), what training records
(``dsa_precision.megatron.record_topk``), what :func:`dsa_precision.capture.save_picks` writes and
``dsa-precision agree`` compares. The layout: per token, ``k`` sequence-relative key positions
(``0 <= key <= the token's position``, causal), ``-1`` padding, keys distinct within a row; the
``T`` tokens either packed across sequences (THD, ``cu_seqlens`` ``(n + 1,)``) or batch-major
(BSHD, ``seq_len`` tokens per sequence, ``T = batch * seq_len``): a :class:`TokenLayout`.

Two levels of checks, as everywhere in the package (docs/robustness.md):

- :meth:`TokenLayout.check_indices` and :meth:`TokenLayout.check_consumer`: host-side facts only
  (types, dtypes, ranks, shapes, devices, the layout against the consumer's); no device work,
  safe on the hot path. ``cu_seqlens`` held on the CPU are host data: their values (start at 0,
  never decrease, end at ``T``, equal to the consumer's when both are on the CPU) are always
  checked, at no synchronisation.
- :meth:`TokenLayout.validate_indices` (and ``check_consumer(..., validate=True)``): the data
  (row count against ``cu_seqlens[-1]``, causal range, duplicates, monotone ``cu_seqlens``, the
  consumer's ``cu_seqlens`` on the device); a few reductions and **one host synchronisation**
  per call on a CUDA tensor. Errors name the source (e.g. the layer), the row, its position, the
  offending values and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

__all__ = ["TokenLayout", "TopkPicks"]

# Integer dtypes accepted for top-k picks (int16 only where every position fits).
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
# Padding sorts last, as a value no key takes.
_PAD = torch.iinfo(torch.int64).max
# Keys are int32 where the kernels read them: every pick is -1 or in [0, KEY_LIMIT).
_KEY_LIMIT = 2**31


def _check_key_range(
    name: str,
    idx: torch.Tensor,
    *,
    describe_row: Callable[[int], str] | None = None,
) -> None:
    """``ValueError`` unless every value of ``idx`` ``(T, ...)`` is ``-1`` or in
    ``[0, 2**31)``, read in its own dtype before any cast (an int64 key past int32 would
    otherwise wrap to another, valid-looking key). One pass (``aminmax``: 2.5 ms for 16 M int32
    picks on one CPU core); on a CUDA tensor one host synchronisation (callers run it on host
    data always, on device data with ``validate``).
    ``describe_row(row)`` names a row of the first dimension in the error."""
    if not idx.numel():
        return
    low, high = (int(v) for v in torch.aminmax(idx))  # one pass; the row is found only on failure
    if low >= -1 and high < _KEY_LIMIT:
        return
    bad = (idx < -1) | (idx >= _KEY_LIMIT)
    flat = bad.reshape(idx.shape[0], -1).any(-1) if idx.ndim > 1 else bad
    if not bool(flat.any()):
        return
    row = int(flat.nonzero()[0])
    values = idx[row].reshape(-1)
    value = int(values[bad[row].reshape(-1)][0])
    where = f" ({describe_row(row)})" if describe_row is not None else ""
    raise ValueError(
        f"{name}: row {row}{where} holds {value}; a key is -1 (padding) or in [0, 2**31), "
        "checked before its int32 cast (a larger one would wrap to another key)."
    )


_CU_DTYPES = (torch.int32, torch.int64)
_DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """How ``T`` tokens of a micro-batch are laid out: packed (``cu_seqlens``) or batch-major
    (``seq_len``); exactly one is given.

    Args:
        cu_seqlens: THD: ``(n + 1,)`` int32/int64 cumulative sequence lengths, ``cu_seqlens[0] ==
            0``, non-decreasing, ``cu_seqlens[-1] == T``; on any device.
        seq_len: BSHD: tokens per sequence, a positive ``int``.
    """

    cu_seqlens: torch.Tensor | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        if (self.cu_seqlens is None) == (self.seq_len is None):
            raise ValueError(
                "give cu_seqlens (packed THD tokens) or seq_len (BSHD, tokens per sequence), "
                f"exactly one; got cu_seqlens={_describe(self.cu_seqlens)}, "
                f"seq_len={self.seq_len!r}."
            )
        if self.seq_len is not None:
            if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int):
                raise TypeError(
                    f"seq_len={self.seq_len!r} ({type(self.seq_len).__name__}) must be an int: "
                    "the tokens per sequence of a BSHD micro-batch."
                )
            if self.seq_len <= 0:
                raise ValueError(f"seq_len={self.seq_len} must be positive (tokens per sequence).")
            return
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor):
            raise TypeError(
                f"cu_seqlens must be a 1-D int32/int64 torch.Tensor, got {type(cu).__name__}; "
                "pass torch.tensor([0, len_0, len_0 + len_1, ...])."
            )
        if cu.dtype not in _CU_DTYPES or cu.ndim != 1 or cu.numel() < 2:
            raise ValueError(
                f"cu_seqlens is {_describe(cu)}; expected a 1-D int32/int64 tensor of n + 1 >= 2 "
                "cumulative lengths starting at 0."
            )
        if cu.device.type not in _DEVICE_TYPES:
            raise ValueError(
                f"cu_seqlens is on {cu.device}; hold it on the CPU or the indices' CUDA device."
            )
        if cu.device.type == "cpu":  # host data: checked at no synchronisation
            self.validate()

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def check_indices(self, name: str, idx: object, *, topk: int | None = None) -> torch.Tensor:
        """Host-side facts of ``idx``: a ``(T, k)`` integer tensor, ``1 <= k <= topk``, and (BSHD)
        ``T`` a whole number of sequences. No device work. Returns ``idx``."""
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name}: expected a (T, k) integer tensor, got {type(idx).__name__}.")
        if idx.dtype not in _INDEX_DTYPES or idx.ndim != 2:
            raise TypeError(
                f"{name}: expected a (T, k) int16/int32/int64 tensor, got {_describe(idx)}."
            )
        if idx.shape[1] == 0:
            raise ValueError(f"{name}: k = 0 keys per token; a top-k row holds at least one slot.")
        if topk is not None and idx.shape[1] > topk:
            raise ValueError(
                f"{name} holds {idx.shape[1]} keys per token, more than the consumer's "
                f"topk={topk}; pass at most {topk} picks per token."
            )
        if idx.device.type not in _DEVICE_TYPES:
            raise ValueError(
                f"{name} is on {idx.device}; hold the picks on the CPU or a CUDA device."
            )
        cu = self.cu_seqlens
        if cu is not None and cu.device.type != "cpu" and cu.device != idx.device:
            raise ValueError(
                f"{name} is on {idx.device} but cu_seqlens on {cu.device}; hold cu_seqlens on "
                "the CPU or on the picks' device."
            )
        self.check_rows(name, idx.shape[0])
        return idx

    def check_rows(
        self,
        name: str,
        rows: int,
        *,
        fix: str = "the picks must hold one row per packed token of this micro-batch",
    ) -> None:
        """``rows`` token rows fit the layout, host facts only: BSHD a whole number of sequences;
        THD with ``cu_seqlens`` on the CPU, ``cu_seqlens[-1]`` of them (free; on a device, that is
        :meth:`validate_indices`'s). ``fix`` ends the THD error."""
        if self.seq_len is not None and rows % self.seq_len:
            raise ValueError(
                f"{name}: {rows} token rows are not a whole number of sequences of "
                f"seq_len={self.seq_len}; pass batch * seq_len rows, batch-major."
            )
        cu = self.cu_seqlens
        if cu is not None and cu.device.type == "cpu" and int(cu[-1]) != rows:
            raise ValueError(
                f"{name}: {rows} token rows but cu_seqlens ends at {int(cu[-1])}; {fix}."
            )

    def check_consumer(
        self, name: str, consumer: TokenLayout, *, where: str, validate: bool = False
    ) -> None:
        """The picks' layout (``self``) is the consumer's own: both packed or both batch-major;
        BSHD: the same ``seq_len``; THD: as many sequences, and the same ``cu_seqlens`` values,
        compared when both are on the CPU (host data, free) or with ``validate`` (one host
        synchronisation). ``where`` names the consumer in errors (e.g. ``"DSA layer 3"``)."""
        if self.packed != consumer.packed:
            given = "cu_seqlens (packed THD)" if self.packed else f"seq_len={self.seq_len} (BSHD)"
            fix = (
                "pass cu_seqlens=<the micro-batch's PackedSeqParams cu_seqlens>"
                if consumer.packed
                else f"pass seq_len={consumer.seq_len}"
            )
            own = "packed THD tokens" if consumer.packed else "BSHD sequences"
            raise ValueError(f"{name}: gives {given}, but {where} runs {own}; {fix}.")
        if not self.packed:
            if self.seq_len != consumer.seq_len:
                raise ValueError(
                    f"{name}: seq_len={self.seq_len}, but {where} runs sequences of "
                    f"{consumer.seq_len} tokens; the picks must be this micro-batch's (pass "
                    f"seq_len={consumer.seq_len} and its picks)."
                )
            return
        ours, theirs = self.cu_seqlens, consumer.cu_seqlens
        assert ours is not None and theirs is not None  # both packed
        if ours.numel() != theirs.numel():
            raise ValueError(
                f"{name}: cu_seqlens holds {ours.numel() - 1} sequences, but {where}'s "
                f"PackedSeqParams hold {theirs.numel() - 1}; the picks must be this "
                "micro-batch's, packed as the model sees it."
            )
        if not (validate or ours.device.type == theirs.device.type == "cpu"):
            return
        a = ours.to(device=theirs.device, dtype=torch.int64)
        differ = a != theirs.to(torch.int64)
        if bool(differ.any()):  # on a CUDA tensor: the one synchronisation of validate
            at = int(differ.nonzero()[0])
            raise ValueError(
                f"{name}: cu_seqlens[{at}] = {int(a[at])}, but {where}'s PackedSeqParams have "
                f"{int(theirs[at])} there (cu_seqlens {_head(a)} vs {_head(theirs)}); the "
                "picks must be this micro-batch's, packed as the model sees it (Megatron's "
                "padded cu_seqlens under CP, when it uses them)."
            )

    def validate(self, name: str = "cu_seqlens") -> None:
        """``cu_seqlens`` starts at 0 and never decreases (one host synchronisation)."""
        if self.cu_seqlens is None:
            return
        cu = self.cu_seqlens.to(torch.int64)
        steps = cu[1:] - cu[:-1]
        bad = torch.cat((cu[:1] != 0, steps < 0))
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise ValueError(
                f"{name} = {_head(cu)} is not cumulative lengths (entry {at} = {int(cu[at])}): "
                "it must start at 0 and never decrease."
            )

    def positions(self, rows: int, device: torch.device) -> torch.Tensor:
        """``(rows,)`` int64 position of each token inside its sequence."""
        t = torch.arange(rows, device=device)
        if self.cu_seqlens is None:
            assert self.seq_len is not None  # exactly one of the two is given
            return t % self.seq_len
        cu = self.cu_seqlens.to(device=device, dtype=torch.int64)
        seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=cu.numel() - 2)
        return t - cu[seq]

    def validate_indices(
        self,
        name: str,
        idx: torch.Tensor,
        *,
        topk: int | None = None,
        describe_row: Callable[[int], str] | None = None,
    ) -> None:
        """:meth:`check_indices`, then the data: ``T == cu_seqlens[-1]`` (THD), every key ``-1`` or
        ``0 <= key <= position``, no key twice in a row. One host synchronisation.

        ``describe_row(row)`` (optional) names a token row in the errors, e.g. the request it came
        from (capture adapters)."""
        self.check_indices(name, idx, topk=topk)
        self.validate(f"{name}: cu_seqlens")
        total = idx.shape[0]
        if self.cu_seqlens is not None:
            end = int(self.cu_seqlens[-1])
            if end != total:
                raise ValueError(
                    f"{name}: {total} token rows but cu_seqlens ends at {end}; the picks must "
                    "hold one row per packed token of this micro-batch."
                )
        position = self.positions(total, idx.device)
        bad = ((idx < -1) | (idx > position[:, None])).any(-1)
        repeated = _repeated_keys(_sorted_keys(idx.to(torch.int64)))
        flags = torch.stack((bad.any(), repeated.any())).tolist()  # the one synchronisation
        if flags[0]:
            row = int(bad.nonzero()[0])
            where = f"{describe_row(row)}, " if describe_row is not None else ""
            raise ValueError(
                f"{name}: row {row} ({where}position {int(position[row])} in its sequence) holds "
                f"{idx[row].tolist()[:8]}{'...' if idx.shape[1] > 8 else ''}; keys must satisfy "
                "0 <= key <= position (causal, sequence-relative), -1 for padding."
            )
        if flags[1]:
            row = int(repeated.nonzero()[0])
            where = f" ({describe_row(row)})" if describe_row is not None else ""
            raise ValueError(
                f"{name}: row {row}{where} repeats a key ({idx[row].tolist()[:8]}); a top-k row holds "
                "distinct keys."
            )


def _sorted_keys(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``int64 [rows, k]`` sorted, negatives (padding) last as :data:`_PAD`."""
    return torch.where(rows < 0, _PAD, rows).sort(dim=-1).values


def _repeated_keys(ordered: torch.Tensor) -> torch.Tensor:
    """bool ``[rows]``: the row holds a key twice; ``ordered`` is :func:`_sorted_keys` of the
    rows (padding never counts). The duplicate rule of every index check of the package."""
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != _PAD)).any(-1)


@dataclasses.dataclass(frozen=True)
class TopkPicks:
    """One micro-batch's top-k, layer by layer, in the engines' layout (module docstring).

    Attributes:
        indices: layer number (1-based, Megatron's) -> ``(T, k)`` integer picks,
            sequence-relative, ``-1`` padding; empty when only ``digests`` are given.
        layout: the ``T`` tokens' :class:`TokenLayout`; ``None`` for a saved selection that does
            not say (``agree`` then checks the index rule only; replay needs a layout).
        engine_rows: ``(T,)`` bool, the rows the engine computed (``False``: a sequence's last
            token, which the engine never runs); ``None``: every row.
        digests: layer number -> ``(T,)`` int64 row digests
            (:func:`dsa_precision.capture.digest_rows` of each row's picks), to verify without
            the picks; ``None``: none.
        request_ids: the packed requests, in order (the capture adapters'); ``None``: unnamed.
        tokens: ``(rows,)`` int64 global token of each row, ascending, when the picks hold only
            some rows of the micro-batch (one context-parallel rank's, as recorded); ``None``:
            every one of the ``T`` tokens, in order.
        sent: layer number -> ``(n,)`` int64 ascending token rows (of the ``T``) whose picks
            ``indices[layer]`` ``(n, k)`` holds, when the engine sent the picks of some rows
            only (its boundary-tied rows, :func:`dsa_precision.capture.pack_tie_rows`) and the
            digests of every row; ``None``: ``indices`` holds every row. Read by the
            ``replay_ties`` top-k source; replay, which needs every row, refuses it.
    """

    indices: Mapping[int, torch.Tensor]
    layout: TokenLayout | None
    engine_rows: torch.Tensor | None = None
    digests: Mapping[int, torch.Tensor] | None = None
    request_ids: tuple[object, ...] | None = None
    tokens: torch.Tensor | None = None
    sent: Mapping[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.indices, Mapping):
            raise TypeError(
                f"TopkPicks.indices takes {{layer_number: (T, k) indices}}, got "
                f"{type(self.indices).__name__}."
            )
        if self.layout is not None and not isinstance(self.layout, TokenLayout):
            raise TypeError(
                f"TopkPicks.layout is a TokenLayout (or None), got {type(self.layout).__name__}; "
                "pass TokenLayout(cu_seqlens=...) or TokenLayout(seq_len=...)."
            )
        self._check_metadata()

    def _check_metadata(self) -> None:
        """``engine_rows`` a ``(T,)`` bool mask (never row indices) and ``request_ids`` one per
        packed sequence, host facts (``T`` read from CPU ``cu_seqlens``)."""
        rows, ids, cu = self.engine_rows, self.request_ids, self.cu_seqlens
        if rows is not None:
            if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or rows.ndim != 1:
                raise TypeError(
                    f"TopkPicks.engine_rows is {_describe(rows)}; pass a (T,) bool mask of the "
                    "rows the engine computed (True: computed), not row indices."
                )
            if cu is not None and cu.device.type == "cpu" and rows.numel() != int(cu[-1]):
                raise ValueError(
                    f"TopkPicks.engine_rows has {rows.numel()} entries but cu_seqlens packs "
                    f"{int(cu[-1])} tokens; pass one entry per token row."
                )
        if ids is not None:
            if not isinstance(ids, (tuple, list)):
                raise TypeError(
                    f"TopkPicks.request_ids is {_describe(ids)}; pass a tuple of the packed "
                    "requests' ids, in order."
                )
            if cu is not None and len(ids) != cu.numel() - 1:
                raise ValueError(
                    f"TopkPicks.request_ids names {len(ids)} requests but cu_seqlens packs "
                    f"{cu.numel() - 1} sequences; pass one id per packed sequence, in order."
                )

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """THD: ``(n + 1,)`` cumulative lengths of the ``T`` tokens."""
        return None if self.layout is None else self.layout.cu_seqlens

    @property
    def seq_len(self) -> int | None:
        """BSHD: tokens per sequence (``T = batch * seq_len``)."""
        return None if self.layout is None else self.layout.seq_len

    def describe_row(self, row: int) -> str:
        """``"request <id> token <position>"`` (or ``"sequence <i> token <position>"``) of a
        packed row; ``"token <row>"`` without a packed layout."""
        cu = self.cu_seqlens
        if cu is None:
            return f"token {row}"
        starts = cu.tolist()
        seq = next((i for i in range(len(starts) - 1) if starts[i] <= row < starts[i + 1]), None)
        if seq is None:
            return f"token {row} (past the packed sequences)"
        who = f"request {self.request_ids[seq]!r}" if self.request_ids else f"sequence {seq}"
        return f"{who} token {row - starts[seq]}"


def _head(t: torch.Tensor) -> str:
    return f"{t.tolist()[:16]}{'...' if t.numel() > 16 else ''}"


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
    return repr(t)
