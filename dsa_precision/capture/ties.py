"""The engine's picks of the rows only it can decide: its boundary-tied rows, and every row's digest.

With matched precision training scores bit-identical logits and picks what the engine picks on
every row but those whose ``k``-th score is tied with a key left out (:mod:`dsa_precision.ties`):
there the engine's kernel chooses among the tied keys in a way that is not a function of its
scores. Full replay ships every row's picks (``4 k`` bytes per token and layer); this ships what
training cannot compute:

- :func:`engine_tie_rows` runs in the engine's process, on the logits and the picks of one
  indexer call (a torch function; no Megatron): every row's 64-bit digest
  (:func:`~dsa_precision.capture.digest.digest_rows`) and the picks of the rows whose margin is
  not positive (a boundary tie, or a set that is no top-k of the logits). One pass over the
  logits and one host synchronisation (the count of rows sent; int64 picks: one more, their
  key range checked before the int32 cast).
- :class:`TieRows` holds that, per layer and request (or step); :meth:`TieRows.to_bytes` /
  :meth:`TieRows.from_bytes` frame it (magic ``DSATIES1``, header, digests, rows, then the picks
  as a :class:`~dsa_precision.capture.compact.CompactPicks` frame), checked where it enters.
- :func:`pack_tie_rows` packs per-request :class:`TieRows` into the
  :class:`~dsa_precision.picks.TopkPicks` of one micro-batch (``sent`` rows, every row's
  digest) for ``dsa_indexer_topk_source="replay_ties"``.

Training then takes the engine's picks for the rows it sent and its own for the others, and
counts (on the device) the rows it finds tied that the engine did not send and the rows whose
digest still differs: docs/capture.md, "Replay of the tied rows".
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from ..checks import _describe
from ..kernels import triton_unavailable_reason
from ..picks import TokenLayout, TopkPicks, _check_key_range
from ..ties import selection_margins
from .compact import CompactPicks, decode_picks, encode_picks
from .digest import _mix64, _mix64_int, _signed64, digest_rows
from .pack import _int_at_least, keyed, pack_digests

__all__ = ["TieRows", "engine_tie_rows", "pack_tie_rows"]

_MAGIC = b"DSATIES1"
# magic, rows, rows sent, k, checksum
_HEADER = struct.Struct("<8sqqqq")
_G = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _checksum(n: int, k: int, digests: torch.Tensor, rows: torch.Tensor) -> int:
    """64-bit mix of the header's sizes and of every digest and row (on the CPU)."""
    total = _mix64_int((n * _G + 1) & _MASK) ^ _mix64_int((rows.numel() * _G + 2) & _MASK)
    total ^= _mix64_int((k * _G + 3) & _MASK)
    for i, part in enumerate((digests, rows), start=4):
        words = part.detach().to("cpu", torch.int64).reshape(-1)
        index = torch.arange(1, words.numel() + 1, dtype=torch.int64)
        total = (total + int(_mix64(words ^ _mix64(index * _signed64(_G) + i)).sum())) & _MASK
    return _signed64(_mix64_int(total))


@dataclasses.dataclass(frozen=True)
class TieRows:
    """The engine's top-k of ``n`` consecutive rows of one layer, as the tie replay ships it.

    Attributes:
        digests: ``(n,)`` int64, every row's digest of its picks (sequence-relative keys).
        rows: ``(m,)`` int64, ascending, the rows (``0 <= row < n``) whose picks are sent.
        picks: ``(m, k)`` int32, their picks: sequence-relative keys, ``-1`` padding.
    """

    digests: torch.Tensor
    rows: torch.Tensor
    picks: torch.Tensor

    def __post_init__(self) -> None:
        d, r, p = self.digests, self.rows, self.picks
        if not (isinstance(d, torch.Tensor) and d.dtype == torch.int64 and d.ndim == 1):
            raise TypeError(f"TieRows.digests: expected (n,) int64 digests, got {_describe(d)}.")
        if not (isinstance(r, torch.Tensor) and r.dtype == torch.int64 and r.ndim == 1):
            raise TypeError(f"TieRows.rows: expected (m,) int64 row numbers, got {_describe(r)}.")
        if not (isinstance(p, torch.Tensor) and p.dtype == torch.int32 and p.ndim == 2):
            raise TypeError(f"TieRows.picks: expected (m, k) int32 picks, got {_describe(p)}.")
        if p.shape[0] != r.shape[0] or p.shape[1] < 1:
            raise ValueError(
                f"TieRows: {r.shape[0]} rows sent but picks of shape {tuple(p.shape)}; pass one "
                "row of k >= 1 picks per row sent."
            )
        if len({d.device, r.device, p.device}) > 1:
            raise ValueError(
                f"TieRows: digests on {d.device}, rows on {r.device}, picks on {p.device}; hold "
                "them on one device."
            )
        if r.device.type == "cpu" and r.numel():  # host data: checked at no synchronisation
            steps = r[1:] - r[:-1]
            if int(r[0]) < 0 or int(r[-1]) >= d.shape[0] or bool((steps <= 0).any()):
                raise ValueError(
                    f"TieRows.rows = {r.tolist()[:8]}...: row numbers must be ascending, "
                    f"distinct and in [0, {d.shape[0]}) (one digest per row)."
                )

    @property
    def k(self) -> int:
        return int(self.picks.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the frame :meth:`to_bytes` writes (header, digests, rows as int32, the picks
        as a delta frame)."""
        return len(self.to_bytes())

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TieRows:
        return TieRows(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.digests, self.rows, self.picks)
            )
        )

    def to_bytes(self, format: str = "delta") -> bytes:
        """The frame: header (magic, sizes, checksum), digests (int64), rows sent (int32), then
        the picks as a :class:`CompactPicks` frame of ``format`` (``delta`` by default)."""
        n, m, k = self.digests.shape[0], self.rows.shape[0], self.k
        repeated = _repeats_a_key(self.picks.detach().cpu()).nonzero().view(-1)
        if repeated.numel():
            i = int(repeated[0])
            raise ValueError(
                f"TieRows.to_bytes: row {int(self.rows[i])} holds a key twice "
                f"({self.picks[i].tolist()[:8]}...; {repeated.numel()} such row(s)). The engine's "
                "top-k returned a set with a repeated key (LMDeploy's bitonic_topk does on equal "
                "scores); training attends to distinct keys and cannot reproduce it. Serve with a "
                "top-k that returns distinct keys (LMDeploy: TileLang's sparse_index_topk, top-k "
                "512 or 2048)."
            )
        digests = self.digests.detach().cpu().contiguous()
        rows = self.rows.detach().cpu().to(torch.int32).contiguous()
        header = _HEADER.pack(_MAGIC, n, m, k, _checksum(n, k, digests, rows.to(torch.int64)))
        picks = encode_picks(self.picks.detach().cpu(), format)  # type: ignore[arg-type]
        body = (
            digests.view(torch.uint8).numpy().tobytes() + rows.view(torch.uint8).numpy().tobytes()
        )
        return header + body + picks.to_bytes()

    @classmethod
    def from_bytes(
        cls, buffer: bytes | bytearray | memoryview, *, source: str | None = None
    ) -> TieRows:
        """A frame of :meth:`to_bytes`, on the CPU, checked: a wrong magic, sizes that do not
        fit the buffer, a damaged payload or rows out of order raise ``ValueError``, prefixed
        with ``source`` when given (where the frame came from, e.g. ``"vllm request 'a' layer
        3"``: the frame itself knows neither)."""
        try:
            return cls._read(buffer)
        except ValueError as exc:
            if source is None:
                raise
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def _read(cls, buffer: bytes | bytearray | memoryview) -> TieRows:
        if not isinstance(buffer, bytes | bytearray | memoryview):
            raise TypeError(f"TieRows.from_bytes takes bytes, got {type(buffer).__name__}.")
        raw = bytes(buffer)
        if len(raw) < _HEADER.size or raw[: len(_MAGIC)] != _MAGIC:
            raise ValueError(
                f"not a tie-rows frame: {len(raw)} bytes without the {_MAGIC!r} header "
                "(TieRows.to_bytes writes it)."
            )
        _, n, m, k, checksum = _HEADER.unpack_from(raw)
        if n < 0 or m < 0 or m > n or k < 1:
            raise ValueError(f"tie-rows frame header is damaged (rows {n}, sent {m}, k {k}).")
        start = _HEADER.size
        end = start + 8 * n + 4 * m
        if len(raw) < end:
            raise ValueError(
                f"tie-rows frame is truncated: {n} digests and {m} rows need {end - start} bytes "
                f"after the header, it holds {len(raw) - start}."
            )
        digests = torch.frombuffer(bytearray(raw[start : start + 8 * n]) or bytearray(8),
                                   dtype=torch.int64)[:n].clone()  # fmt: skip
        rows = torch.frombuffer(bytearray(raw[start + 8 * n : end]) or bytearray(4),
                                dtype=torch.int32)[:m].to(torch.int64)  # fmt: skip
        if _checksum(n, k, digests, rows) != checksum:
            raise ValueError(
                "tie-rows frame is damaged: its digests or rows do not match the checksum; "
                "re-send or re-read it."
            )
        frame = CompactPicks.from_bytes(raw[end:])  # verified; refuses a cut or extended tail
        if frame.shape != (m, k):
            raise ValueError(
                f"tie-rows frame: its picks are {frame.shape}, the header says ({m}, {k})."
            )
        return cls(digests, rows, decode_picks(frame))

    def split(self, sizes: Sequence[int]) -> list[TieRows]:
        """Consecutive blocks of ``sizes`` rows (e.g. one engine step's rows, request by
        request: ``query_start_loc``'s differences), rows renumbered from 0 in each."""
        sizes = [_int_at_least(f"sizes[{i}]", s, low=0) for i, s in enumerate(sizes)]
        n = self.digests.shape[0]
        if sum(sizes) != n:
            raise ValueError(f"sizes={sizes[:8]} add up to {sum(sizes)}; these TieRows hold {n}.")
        out, first = [], 0
        bounds = torch.tensor([0, *sizes], device=self.rows.device).cumsum(0)
        cut = torch.searchsorted(self.rows, bounds).tolist()
        for i, size in enumerate(sizes):
            a, b = cut[i], cut[i + 1]
            out.append(TieRows(self.digests[first : first + size], self.rows[a:b] - first,
                               self.picks[a:b]))  # fmt: skip
            first += size
        return out

    @classmethod
    def cat(cls, parts: Sequence[TieRows]) -> TieRows:
        """Blocks of consecutive rows (e.g. one request's chunks over steps) as one."""
        if not parts or not all(isinstance(p, TieRows) for p in parts):
            raise TypeError("TieRows.cat takes a non-empty sequence of TieRows.")
        ks = {p.k for p in parts}
        if len(ks) > 1:
            raise ValueError(f"TieRows.cat: the parts hold different k {sorted(ks)}.")
        offsets = torch.tensor([0, *(p.digests.shape[0] for p in parts)]).cumsum(0).tolist()
        return cls(
            torch.cat([p.digests for p in parts]),
            torch.cat([p.rows + off for p, off in zip(parts, offsets, strict=False)]),
            torch.cat([p.picks for p in parts]),
        )


def engine_tie_rows(
    logits: torch.Tensor,
    picks: torch.Tensor,
    lengths: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
) -> TieRows:
    """The engine side of the tie replay, for one indexer call of one layer.

    Args:
        logits: ``(rows, W)`` float32 (or bf16) logits the engine's top-k read (DeepGEMM's
            ``fp8_mqa_logits`` output, cleaned or not: only each row's window is read).
        picks: ``(rows, k)`` int32/int64, the engine's top-k of each row, sequence-relative
            keys (vLLM's ``topk_indices_buffer`` rows), ``-1`` padding.
        lengths: ``(rows,)`` integer, each row's visible keys (its position + 1 for a causal
            row; vLLM's ``ke - ks`` in prefill, ``seq_len`` in decode).
        starts: ``(rows,)`` integer column of each row's key 0 in ``logits`` (vLLM's prefill
            ``ks``); default 0.

    Returns:
        :class:`TieRows` on the logits' device: every row's digest, and the picks of the rows
        whose margin is not positive (boundary-tied, or not a top-k of the logits) or that hold
        a key twice (LMDeploy's ``bitonic_topk`` on equal scores). Training cannot attend to a
        key twice, so :meth:`TieRows.to_bytes` refuses a frame with such a row, naming it.
    """
    for name, t in (("logits", logits), ("picks", picks), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"engine_tie_rows({name}=...): expected a tensor, got {_describe(t)}.")
    if logits.ndim != 2 or not logits.dtype.is_floating_point:
        raise TypeError(f"logits: expected (rows, W) float logits, got {_describe(logits)}.")
    rows = logits.shape[0]
    if picks.ndim != 2 or picks.shape[0] != rows or picks.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"picks: expected ({rows}, k) int32/int64 picks (one row per logits row), got "
            f"{_describe(picks)}."
        )
    windows = [("lengths", lengths)] + ([("starts", starts)] if starts is not None else [])
    for name, t in windows:
        if not isinstance(t, torch.Tensor) or t.shape != (rows,) or t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected ({rows},) integers, got {_describe(t)}.")
    device = logits.device
    if picks.device != device or any(t.device != device for _, t in windows):
        raise ValueError("engine_tie_rows: logits, picks, lengths and starts must share a device.")
    if picks.dtype == torch.int64:  # the key range in the picks' own dtype, before any use
        _check_key_range("engine_tie_rows picks", picks)
    if logits.is_cuda and _unit_columns(logits, picks) and triton_unavailable_reason() is None:
        from ..kernels.tie_rows import tie_rows  # one pass over each row's picks and window

        first = torch.zeros_like(lengths) if starts is None else starts
        digests, flags = tie_rows(
            logits, picks, first.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous()
        )
    else:
        margins = selection_margins(logits, picks, lengths, starts=starts)
        digests, flags = digest_rows(picks), margins <= 0  # NaN: nothing left out
    # A set holding a key twice is no top-k even where its margin is positive (the other copy
    # displaced the k-th key): sent too, so that it is never mistaken for training's own set.
    flags = flags | _repeats_a_key(picks)
    sent = flags.nonzero().view(-1)  # the one synchronisation
    return TieRows(digests, sent, picks[sent].to(torch.int32))


def _repeats_a_key(picks: torch.Tensor) -> torch.Tensor:
    """``(rows,)`` bool: the rows of ``(rows, k)`` picks (``-1`` padding) that hold a key twice
    (one sort of the picks, on their device, no synchronisation)."""
    if picks.shape[-1] < 2:
        return torch.zeros(picks.shape[:-1], dtype=torch.bool, device=picks.device)
    ordered = picks.sort(dim=-1).values
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1)


def _unit_columns(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def pack_tie_rows(
    requests: Mapping[Any, Mapping[int, TieRows]] | Sequence[Mapping[int, TieRows]],
    seq_lens: Mapping[Any, int] | Sequence[int],
    *,
    order: Sequence[object] | None = None,
    seq_len: int | None = None,
    source: str = "engine",
) -> TopkPicks:
    """Per-request :class:`TieRows` (layer number -> the request's rows ``0 .. n - 1``, ``n``
    its sequence length or one less) -> one micro-batch's
    :class:`~dsa_precision.picks.TopkPicks` for ``dsa_indexer_topk_source="replay_ties"``: every
    row's digest, the sent rows' picks (``sent``: their token rows) and ``engine_rows``.

    The requests are packed in ``order`` (THD, ``cu_seqlens``); with ``seq_len`` they are the
    sequences of a BSHD micro-batch, batch-major, each of ``seq_len`` tokens. Checked on the
    host: every request of ``order`` given once, with the same layers and ``k``, its rows
    covering its sequence (as :func:`~.pack.pack_digests` checks them)."""
    ids, given = keyed("requests", requests)
    _, given_lens = keyed("seq_lens", seq_lens)
    order = ids if order is None else order
    frames: dict[object, dict[int, TieRows]] = {}
    for r in ids:
        held = given[r]
        if not isinstance(held, Mapping) or not held:
            raise TypeError(
                f"{source} request {r!r}: expected {{layer_number: TieRows}}, got {_describe(held)}."
            )
        for layer, part in held.items():
            if not isinstance(part, TieRows):
                raise TypeError(
                    f"{source} request {r!r} layer {layer!r}: expected TieRows (engine_tie_rows' "
                    f"output), got {_describe(part)}."
                )
        frames[r] = dict(held)
    layers = sorted(frames[ids[0]]) if ids else []
    for r, held in frames.items():
        if sorted(held) != layers:
            raise ValueError(f"{source} request {r!r}: layers {sorted(held)}, expected {layers}.")
    ks = {part.k for held in frames.values() for part in held.values()}
    if len(ks) > 1:
        raise ValueError(f"{source}: the requests' rows hold different k {sorted(ks)}.")
    digests, engine_rows = pack_digests(
        {r: torch.stack([frames[r][n].digests for n in layers], 1) for r in ids},
        cast(Mapping[Any, int], given_lens),  # checked there
        order=order,
        layer_numbers=layers,
        source=source,
    )
    (k,) = ks
    lens = {r: _int_at_least(f"seq_lens[{r!r}]", given_lens[r], low=1) for r in order}
    starts = [0]
    for r in order:
        starts.append(starts[-1] + lens[r])
    sent = {n: torch.cat([frames[r][n].rows + s for r, s in zip(order, starts, strict=False)])
            for n in layers}  # fmt: skip
    picks = {n: torch.cat([frames[r][n].picks for r in order]).view(-1, k) for n in layers}
    if seq_len is None:
        layout = TokenLayout(cu_seqlens=torch.tensor(starts, dtype=torch.int64))
    else:
        layout = TokenLayout(seq_len=seq_len)  # checks its type
        uneven = [r for r in order if lens[r] != seq_len]
        if uneven:
            raise ValueError(
                f"pack_tie_rows(seq_len={seq_len}): request {uneven[0]!r} has "
                f"{lens[uneven[0]]} tokens; a BSHD micro-batch holds sequences of seq_len "
                "tokens each (pack them as THD: leave seq_len out)."
            )
    return TopkPicks(
        picks, layout, engine_rows=engine_rows, digests=digests, request_ids=tuple(order),
        sent=sent,
    )  # fmt: skip
