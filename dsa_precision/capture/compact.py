"""Compact storage / transfer of top-k picks, framed, decoded on the device with torch ops.

Plain picks cost ``4 k`` bytes per token and layer (2048 picks: 8 KiB; about 170 KB per token
for a GLM-5-class model's indexer layers). Three formats:

- ``"int32"``: the plain layout (the reference).
- ``"int16"``: positions as int16, ``-1`` padding; only when every key is ``<= 32767`` (sequences
  up to 32768 tokens). Order preserving; decoding is one cast. ``2 k`` bytes.
- ``"delta"``: per row, the valid keys sorted ascending, stored as gaps
  ``d_0 = s_0, d_j = s_j - s_{j-1} - 1`` bit-packed at the row's own width
  ``w = bit_length(max d)`` (0 bits when a row picks every key it can see, i.e. the first ``k``
  positions), plus a 1-byte width and a 2-byte count per row. Any sequence length (keys below
  ``2**31``). Decoding: a prefix sum of the row sizes, two gathers, shifts and a cumulative sum
  per row; no host synchronisation. Rows come back **sorted** (the same set: the package's
  replay reads the picks as a set of keys; ``-1`` padding last).

**Framing.** A :class:`CompactPicks` carries, as host data, its format, the decoded shape, the
bit length of a delta stream and a 64-bit checksum of its payload (every tensor's bytes, their
lengths and the header); the payload tensors may live on any device. What its header declares
is checked against the payload's sizes whenever one is built (host facts, no device work), so a
short, long or reshaped payload is refused; the content against the checksum by
:meth:`CompactPicks.verify` -- always where the payload is on the CPU (a few passes over its
words), on a device only when asked (``validate=True``: one host synchronisation), since a
decoder that never waits for the host cannot raise there. Moving a frame from the CPU to a
device (:meth:`CompactPicks.to`) verifies it first. :meth:`CompactPicks.to_bytes` /
:meth:`CompactPicks.from_bytes` give the frame as one byte string (magic, version, header,
payload, checksum) for a file or a socket; any byte changed, cut or added is refused.

Encoding (at the engine or at storage time) may synchronise; decoding never does.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Literal, cast

import torch

from .digest import _mix64, _mix64_int, _signed64

__all__ = ["FORMATS", "CompactPicks", "Format", "decode_picks", "encode_picks"]

Format = Literal["int32", "int16", "delta"]
FORMATS = ("int32", "int16", "delta")
_WORD = 32
_LOW32 = (1 << 32) - 1
_G = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MAGIC = b"DSAPICK1"
# magic, format code, rows, k, bits, checksum
_HEADER = struct.Struct("<8sBqqqq")
_FORMAT_CODES = {name: i for i, name in enumerate(FORMATS)}
_KEY_LIMIT = 2**31


def _payload_sizes(
    fmt: str, shape: tuple[int, int], bits: int
) -> dict[str, tuple[torch.dtype, int]]:
    """The payload tensors a header declares: name -> (dtype, element count)."""
    t, k = shape
    if fmt == "int32":
        return {"data": (torch.int32, t * k)}
    if fmt == "int16":
        return {"data": (torch.int16, t * k)}
    words = (bits + _WORD - 1) // _WORD + 1  # one word of slack for the decoder's pair read
    count = torch.int16 if k <= 32767 else torch.int32
    return {"data": (torch.int32, words), "width": (torch.uint8, t), "count": (count, t)}


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as int64 words (zero-padded to a multiple of 8 bytes)."""
    raw = t.contiguous().view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat((raw, raw.new_zeros(pad)))
    return raw.view(torch.int64)


def _checksum(
    fmt: str, shape: tuple[int, int], bits: int, parts: list[torch.Tensor]
) -> torch.Tensor:
    """0-d int64 on the payload's device: a position-dependent mix of every payload word, of each
    part's length and of the header, exact integer arithmetic (the same bits on every device; no
    synchronisation: the header's share is a Python int)."""
    header = 0
    for i, value in enumerate((_FORMAT_CODES[fmt], shape[0], shape[1], bits), start=1):
        header = (header + _mix64_int((value * _G + i) & _MASK)) & _MASK
    total = torch.zeros((), dtype=torch.int64, device=parts[0].device)
    for i, part in enumerate(parts, start=1):
        words = _as_words(part)
        index = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        mixed = _mix64(words ^ _mix64(index * _signed64(_G) + i)).sum()
        length = _signed64(_mix64_int((part.numel() * part.element_size() * _G + i) & _MASK))
        total = (total + mixed) ^ length
    return _mix64(total + _signed64(header))


@dataclasses.dataclass(frozen=True)
class CompactPicks:
    """Encoded ``(T, k)`` picks of one layer, framed (see the module docstring).

    Attributes:
        format: ``"int32"``, ``"int16"`` or ``"delta"``.
        shape: ``(T, k)`` of the decoded picks.
        data: ``int32`` / ``int16``: the ``(T, k)`` picks; ``delta``: the int32 words of the bit
            stream (little-endian bit order, one zero word of slack at the end).
        width: ``delta``: ``(T,)`` uint8 bits per gap of each row.
        count: ``delta``: ``(T,)`` int16 (int32 when ``k > 32767``) valid keys per row.
        bits: ``delta``: the stream's length in bits (0 otherwise).
        checksum: the 64-bit checksum :func:`encode_picks` computed (a signed int); ``None`` for
            a payload nobody framed (decoding refuses it).
    """

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    width: torch.Tensor | None = None
    count: torch.Tensor | None = None
    bits: int = 0
    checksum: int | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"CompactPicks.format={self.format!r}: use one of {FORMATS}.")
        shape = self.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) != 2
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise ValueError(f"CompactPicks.shape={shape!r}: give (T, k), two ints >= 0.")
        if type(self.bits) is not int or self.bits < 0 or (self.format != "delta" and self.bits):
            raise ValueError(
                f"CompactPicks.bits={self.bits!r}: the delta stream's bit length (an int >= 0; "
                "0 for int32 / int16)."
            )
        if self.checksum is not None and (
            type(self.checksum) is not int or not -(2**63) <= self.checksum < 2**63
        ):
            raise ValueError(f"CompactPicks.checksum={self.checksum!r}: a signed 64-bit int.")
        given = {"data": self.data, "width": self.width, "count": self.count}
        want = _payload_sizes(self.format, shape, self.bits)
        for name, tensor in given.items():
            if name not in want:
                if tensor is not None:
                    raise ValueError(f"format={self.format!r} has no {name}; pass {name}=None.")
                continue
            dtype, numel = want[name]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"CompactPicks.{name} must be a torch.Tensor, got {type(tensor).__name__}."
                )
            if tensor.dtype != dtype or tensor.numel() != numel:
                what = "short" if tensor.numel() < numel else "long"
                raise ValueError(
                    f"CompactPicks.{name} is {str(tensor.dtype).removeprefix('torch.')} of "
                    f"{tensor.numel()} elements; a {self.format} frame of shape {shape}"
                    f"{f' and {self.bits} bits' if self.format == 'delta' else ''} needs "
                    f"{str(dtype).removeprefix('torch.')} of {numel}"
                    f"{f' (the payload is {what})' if tensor.dtype == dtype else ''}."
                )
        devices = {t.device for t in self.tensors()}
        if len(devices) > 1:
            raise ValueError(f"CompactPicks payload tensors are on several devices: {devices}.")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.width, self.count) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes stored / moved (the payload)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def computed_checksum(self) -> torch.Tensor:
        """The payload's checksum as a 0-d int64 tensor on its device (no synchronisation)."""
        return _checksum(self.format, self.shape, self.bits, self.tensors())

    def verify(self) -> CompactPicks:
        """Raise ``ValueError`` unless the payload is the one framed (its checksum matches);
        returns ``self``. On the CPU a few passes over the words; on a device one host
        synchronisation."""
        if self.checksum is None:
            raise ValueError(
                "CompactPicks without a checksum: nothing says the payload is complete; frame it "
                "with encode_picks (or read it with CompactPicks.from_bytes)."
            )
        got = int(self.computed_checksum())
        if got != self.checksum:
            raise ValueError(
                f"CompactPicks payload is damaged: its checksum is {got:#x}, the frame says "
                f"{self.checksum:#x} ({self.format}, shape {self.shape}); re-send or re-read it."
            )
        return self

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CompactPicks:
        """The same frame on ``device`` (``non_blocking`` from pinned memory); a frame on the
        CPU is verified first (host data: no device work)."""
        if self.data.device.type == "cpu" and torch.device(device).type != "cpu":
            self.verify()
        moved = [
            None if t is None else t.to(device, non_blocking=non_blocking)
            for t in (self.data, self.width, self.count)
        ]
        data = cast(torch.Tensor, moved[0])  # never None
        return dataclasses.replace(self, data=data, width=moved[1], count=moved[2])

    def pin_memory(self) -> CompactPicks:
        pinned = [
            None if t is None else t.pin_memory() for t in (self.data, self.width, self.count)
        ]
        data = cast(torch.Tensor, pinned[0])  # never None
        return dataclasses.replace(self, data=data, width=pinned[1], count=pinned[2])

    def to_bytes(self) -> bytes:
        """The frame as bytes: header (magic, format, shape, bits, checksum), then the payload
        tensors' bytes in order. Refuses an unframed payload."""
        if self.checksum is None:
            raise ValueError("CompactPicks.to_bytes: no checksum; frame it with encode_picks.")
        header = _HEADER.pack(
            _MAGIC, _FORMAT_CODES[self.format], self.shape[0], self.shape[1], self.bits,
            self.checksum,
        )  # fmt: skip
        body = b"".join(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                        for t in self.tensors())  # fmt: skip
        return header + body

    @classmethod
    def from_bytes(cls, buffer: bytes | bytearray | memoryview) -> CompactPicks:
        """A frame of :meth:`to_bytes`, on the CPU, verified: a wrong magic, a header that does
        not fit the payload's length, or a damaged payload raise ``ValueError`` saying which."""
        if not isinstance(buffer, bytes | bytearray | memoryview):
            raise TypeError(f"CompactPicks.from_bytes takes bytes, got {type(buffer).__name__}.")
        raw = bytes(buffer)
        if len(raw) < _HEADER.size or raw[: len(_MAGIC)] != _MAGIC:
            raise ValueError(
                f"not a compact picks frame: {len(raw)} bytes without the {_MAGIC!r} header "
                "(CompactPicks.to_bytes writes it)."
            )
        _, code, rows, k, bits, checksum = _HEADER.unpack_from(raw)
        if code >= len(FORMATS) or rows < 0 or k < 0 or bits < 0 or (code != 2 and bits):
            raise ValueError(
                f"compact picks frame header is damaged (format {code}, shape ({rows}, {k}), "
                f"{bits} bits)."
            )
        fmt = FORMATS[code]
        sizes = _payload_sizes(fmt, (rows, k), bits)
        need = sum(dtype.itemsize * n for dtype, n in sizes.values())
        have = len(raw) - _HEADER.size
        if have != need:
            raise ValueError(
                f"compact picks frame is {'truncated' if have < need else 'extended'}: its header "
                f"({fmt}, shape ({rows}, {k})) needs {need} payload bytes, it holds {have}."
            )
        parts, offset = {}, _HEADER.size
        for name, (dtype, n) in sizes.items():
            chunk = bytearray(raw[offset : offset + dtype.itemsize * n])
            parts[name] = (
                torch.frombuffer(chunk, dtype=torch.uint8).view(dtype).clone()
                if chunk
                else torch.empty(0, dtype=dtype)
            )
            offset += dtype.itemsize * n
        picks = cls(fmt, (rows, k), bits=bits, checksum=checksum, **parts)
        return picks.verify()


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of non-negative int64 values below 2**53 (0 -> 0), exact via frexp."""
    return torch.frexp(x.to(torch.float64)).exponent.to(torch.int64)


def _word_sums(q: torch.Tensor, values: torch.Tensor, n_words: int) -> torch.Tensor:
    """``out[w] = sum(values[q == w])`` for non-decreasing ``q`` (the bit stream is written in
    order): a difference of prefix sums at the run ends, exact integer arithmetic, the same bits
    on every run (no scatter accumulation)."""
    prefix = torch.cat((values.new_zeros(1), torch.cumsum(values, 0)))
    ends = torch.searchsorted(q, torch.arange(n_words, device=q.device), right=True)
    return prefix[ends] - prefix[torch.cat((ends.new_zeros(1), ends[:-1]))]


def _framed(
    fmt: str,
    shape: tuple[int, int],
    data: torch.Tensor,
    width: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    bits: int = 0,
) -> CompactPicks:
    tensors = [t for t in (data, width, count) if t is not None]
    checksum = int(_checksum(fmt, shape, bits, tensors))  # encoding may synchronise
    return CompactPicks(fmt, shape, data, width, count, bits=bits, checksum=checksum)


def encode_picks(
    indices: torch.Tensor, format: Format = "delta", *, rows_per_chunk: int = 8192
) -> CompactPicks:
    """Encode ``(T, k)`` int16/int32/int64 picks (``-1`` padding, distinct keys per row) into a
    framed :class:`CompactPicks`.

    Raises ``ValueError`` for ``"int16"`` when a key exceeds 32767, for keys outside
    ``[-1, 2**31)`` (checked in the picks' own dtype, before any cast), and (``"delta"``) for a
    row that repeats a key. ``rows_per_chunk`` bounds the encoder's temporary memory
    (``delta``).
    """
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dtype not in (torch.int16, torch.int32, torch.int64)
        or indices.ndim != 2
    ):
        raise TypeError(
            f"indices must be a (T, k) int16/int32/int64 tensor, got "
            f"{getattr(indices, 'dtype', type(indices).__name__)} "
            f"{tuple(getattr(indices, 'shape', ()))}."
        )
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: use one of {FORMATS}.")
    if type(rows_per_chunk) is not int or rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk={rows_per_chunk!r} must be a positive int.")
    shape = (int(indices.shape[0]), int(indices.shape[1]))
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < -1 or high >= _KEY_LIMIT:
            bad = low if low < -1 else high
            row = int(((indices == bad).any(-1)).nonzero()[0])
            raise ValueError(
                f"indices: row {row} holds {bad}; keys are -1 (padding) or 0 <= key < 2**31."
            )
    else:
        high = -1
    if format == "int32":
        return _framed("int32", shape, data=indices.to(torch.int32).contiguous())
    if format == "int16":
        if high > 32767:
            raise ValueError(
                f"format='int16' holds keys up to 32767, the picks reach {high}; use 'delta' "
                "(any length) or 'int32'."
            )
        return _framed("int16", shape, data=indices.to(torch.int16).contiguous())
    t, k = shape
    widths, counts, chunks, bit_total = [], [], [], 0
    for r0 in range(0, t, rows_per_chunk):
        v = indices[r0 : r0 + rows_per_chunk].to(torch.int64)
        n = (v >= 0).sum(-1)
        s = torch.where(v < 0, torch.iinfo(torch.int64).max, v).sort(-1).values
        slot = torch.arange(k, device=v.device)
        valid = slot < n[:, None]
        gaps = torch.cat((s[:, :1], s[:, 1:] - s[:, :-1] - 1), dim=1)
        repeated = ((gaps < 0) & valid).any(-1)  # a key twice: gap -1, which no width encodes
        gaps = torch.where(valid, gaps, 0)
        w = _bit_length(gaps.max(-1).values) if k else torch.zeros_like(n)
        sizes = n * w
        start = bit_total + torch.cumsum(sizes, 0) - sizes
        chunk_bits, n_repeated = torch.stack((sizes.sum(), repeated.sum())).tolist()
        if n_repeated:
            row = r0 + int(repeated.nonzero()[0])
            raise ValueError(
                f"indices: row {row} repeats a key ({indices[row].tolist()[:8]}); a top-k row "
                "holds distinct keys (format='delta' stores the gaps between them)."
            )
        base = bit_total // _WORD  # this chunk's words start here (the first may be shared)
        local = (start - base * _WORD)[:, None] + slot * w[:, None]
        pos, gap = local[valid], gaps[valid]
        part = torch.zeros(
            (bit_total - base * _WORD + chunk_bits) // _WORD + 2, dtype=torch.int64, device=v.device
        )
        q, sh = pos >> 5, pos & 31
        part += _word_sums(q, (gap << sh) & _LOW32, part.numel())  # disjoint bits: sum = OR
        part += _word_sums(q + 1, gap >> (_WORD - sh), part.numel())
        chunks.append((base, part))
        widths.append(w)
        counts.append(n)
        bit_total += chunk_bits
    n_words = (bit_total + _WORD - 1) // _WORD + 1  # one word of slack for the decoder's pair read
    words = torch.zeros(n_words + 2, dtype=torch.int64, device=indices.device)
    for base, part in chunks:
        words[base : base + part.numel()] += part  # a shared boundary word: disjoint bits
    data = torch.where(words >= 2**31, words - 2**32, words)[:n_words].to(torch.int32)
    count_dtype = torch.int16 if k <= 32767 else torch.int32
    empty = torch.zeros(0, dtype=torch.int64, device=indices.device)
    return _framed(
        "delta",
        shape,
        bits=bit_total,
        data=data.contiguous(),
        width=torch.cat(widths or [empty]).to(torch.uint8),
        count=torch.cat(counts or [empty]).to(count_dtype),
    )


def decode_picks(picks: CompactPicks, *, validate: bool = False) -> torch.Tensor:
    """``(T, k)`` int32 picks on ``picks``' device, ``-1`` padding.

    The frame's header is checked against its payload whenever a :class:`CompactPicks` is built;
    its content against the checksum here: always when the payload is on the CPU, with
    ``validate=True`` on a device (one host synchronisation; otherwise no synchronisation, and
    the reads of a damaged stream stay inside it). ``delta`` rows come back sorted ascending,
    padding last (the same set of keys)."""
    if not isinstance(picks, CompactPicks):
        raise TypeError(f"expected CompactPicks, got {type(picks).__name__}.")
    if not isinstance(validate, bool):
        raise TypeError(f"decode_picks(validate={validate!r}): pass True or False.")
    if validate or picks.data.device.type == "cpu":
        picks.verify()
    if picks.format in ("int32", "int16"):
        return picks.data.reshape(picks.shape).to(torch.int32)
    t, k = picks.shape
    # delta: both are given (checked when the frame was built)
    w = cast(torch.Tensor, picks.width).to(torch.int64)
    n = cast(torch.Tensor, picks.count).to(torch.int64).clamp_(0, k)
    sizes = n * w
    start = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(k, device=w.device)
    pos = start[:, None] + slot * w[:, None]
    words = picks.data.to(torch.int64) & _LOW32
    last = words.numel() - 1
    q = (pos >> 5).clamp_(0, max(last - 1, 0))
    pair = words[q] | (words[q + 1] << _WORD) if last > 0 else words[q]  # 64 bits; a gap <= 31
    gaps = (pair >> (pos & 31)) & ((1 << w[:, None].clamp(max=31)) - 1)
    keys = torch.cumsum(gaps, -1) + slot
    return torch.where(slot < n[:, None], keys, -1).to(torch.int32).view(t, k)
