"""Verify without the payload: a 64-bit digest per top-k row, the same on both sides.

The digest of a row is a function of its *set* of keys (padding dropped; order and slot
positions do not matter), so the engine may hash its picks in whatever order its kernel left
them, and training hashes its own. Exact definition (all arithmetic on unsigned 64-bit integers,
modulo ``2**64``; ``>>>`` a logical right shift):

.. code-block:: text

    G = 0x9E3779B97F4A7C15
    mix(z) = z ^= z >>> 30; z *= 0xBF58476D1CE4E5B9
             z ^= z >>> 27; z *= 0x94D049BB133111EB
             z ^= z >>> 31                              (SplitMix64's finaliser)
    digest(row) = mix( (sum over valid keys v of mix((v + 1) * G))  XOR  (n * G) )

with ``n`` the number of valid keys (``v >= 0``; ``-1`` pads are dropped) and the result read as
a two's-complement signed int64 (torch's ``int64``). An empty row's digest is ``0``.

:func:`digest_rows` computes it with torch ops on any device, without host synchronisation
(int64 multiplication and sums wrap modulo ``2**64`` in torch; logical shifts are arithmetic
shifts masked); :func:`digest_row_reference` is the pure-Python reference an engine hook can
call, or port. 8 bytes per row instead of ``4 k``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..checks import _describe
from ..kernels import triton_unavailable_reason

__all__ = ["digest_mismatches", "digest_row_reference", "digest_rows"]

_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed64(u: int) -> int:
    """An unsigned 64-bit value as the signed int64 torch stores."""
    return u - (1 << 64) if u >> 63 else u


def _mix64_int(z: int) -> int:
    """SplitMix64's finaliser of a Python int (unsigned 64-bit result)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def digest_row_reference(keys: Iterable[int]) -> int:
    """The digest of one row (pure Python): ``keys`` any iterable of ints, ``-1`` (any negative)
    pads dropped, order irrelevant; returns a signed int64 as a Python int."""
    total, n = 0, 0
    for v in keys:
        v = int(v)
        if v < 0:
            continue
        total = (total + _mix64_int((v + 1) * _G)) & _MASK
        n += 1
    return _signed64(_mix64_int(total ^ ((n * _G) & _MASK)))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of int64 bit patterns, elementwise, on any device."""
    z = (z ^ _shr(z, 30)) * _signed64(_M1)
    z = (z ^ _shr(z, 27)) * _signed64(_M2)
    return z ^ _shr(z, 31)


def digest_rows(indices: torch.Tensor, *, validate: bool = False) -> torch.Tensor:
    """Per-row digest of ``indices`` ``(..., k)`` int16/int32/int64 picks (``-1`` padding) ->
    ``(...)`` int64 on the same device. No host synchronisation on a device.

    A key below ``-1`` would digest as padding; it is refused (``ValueError`` naming the row):
    always for picks on the CPU, on a device with ``validate=True`` (one host synchronisation).
    """
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (
        torch.int16,
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            f"indices must be an int16/int32/int64 tensor of (..., k) picks, got "
            f"{getattr(indices, 'dtype', type(indices).__name__)}."
        )
    if indices.ndim < 1:
        raise ValueError("indices must be (..., k), got a 0-d tensor.")
    if not isinstance(validate, bool):
        raise TypeError(f"digest_rows(validate={validate!r}): pass True or False.")
    if (validate or indices.device.type == "cpu") and indices.numel():
        bad = (indices < -1).reshape(-1, indices.shape[-1]).any(-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            values = indices.reshape(-1, indices.shape[-1])[row].tolist()
            raise ValueError(
                f"digest_rows: row {row} holds {min(values)} ({values[:8]}); keys are >= 0 and "
                "-1 pads (a negative key would digest as padding)."
            )
    if indices.is_cuda and indices.numel() and triton_unavailable_reason() is None:
        from ..kernels.digest import _digest_picks  # one pass over the picks, the same bits

        rows = indices.reshape(-1, indices.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return _digest_picks(rows).view(indices.shape[:-1])
    v = indices.to(torch.int64)
    valid = v >= 0
    mixed = torch.where(valid, _mix64((v + 1) * _signed64(_G)), 0)
    total = mixed.sum(-1)  # int64 sums wrap modulo 2**64
    n = valid.sum(-1)
    return _mix64(total ^ (n * _signed64(_G)))


def digest_mismatches(
    ours: Mapping[int, torch.Tensor],
    engine_digests: Mapping[int, torch.Tensor],
    engine_rows: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Rows whose digest differs, per layer, on the device (no host synchronisation).

    Args:
        ours: layer number -> training's ``(T, k)`` picks, or their ``(T,)`` int64 digests.
        engine_digests: layer number -> the engine's ``(T,)`` int64 digests of the same rows.
        engine_rows: ``(T,)`` bool, the rows the engine computed (``pack_digests``); other rows
            never count as mismatches.

    Returns:
        layer number -> ``(T,)`` bool, ``True`` where the row differs (``mask.sum()`` counts
        them; mask or replay those rows).
    """
    for name, given in (("ours", ours), ("engine_digests", engine_digests)):
        if not isinstance(given, Mapping):
            raise TypeError(
                f"digest_mismatches: {name} is {_describe(given)}; pass {{layer_number: tensor}} "
                "(a dict keyed by Megatron's layer numbers, as TopkPicks.indices / digests)."
            )
    if engine_rows is not None and not isinstance(engine_rows, torch.Tensor):
        raise TypeError(
            f"digest_mismatches: engine_rows is {_describe(engine_rows)}; pass a (T,) bool tensor "
            "(pack_digests' engine_rows) or None."
        )
    if sorted(ours) != sorted(engine_digests):
        raise ValueError(
            f"digest_mismatches: layers differ: ours {sorted(ours)}, engine "
            f"{sorted(engine_digests)}."
        )
    out = {}
    for n, mine in ours.items():
        theirs = engine_digests[n]
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != torch.int64 or theirs.ndim != 1:
            raise TypeError(
                f"engine digests of layer {n} must be a (T,) int64 tensor (digest_rows' output), "
                f"got {_describe(theirs)}; digests of another width are other numbers, not the same digests."
            )
        if not isinstance(mine, torch.Tensor):
            raise TypeError(
                f"our picks of layer {n} must be a (T, k) tensor or (T,) int64 digests, got "
                f"{type(mine).__name__}."
            )
        if mine.ndim == 2:
            mine = digest_rows(mine)
        elif mine.ndim != 1 or mine.dtype != torch.int64:
            raise TypeError(
                f"our digests of layer {n} must be (T,) int64 (digest_rows' output), got "
                f"{str(mine.dtype).removeprefix('torch.')} {tuple(mine.shape)}; pass the "
                "(T, k) picks to digest them here."
            )
        if mine.shape != theirs.shape:
            raise ValueError(
                f"layer {n}: {tuple(mine.shape)} training digests vs {tuple(theirs.shape)} "
                "engine digests; digest the same rows."
            )
        differs = mine != theirs.to(mine.device)
        if engine_rows is not None:
            if engine_rows.shape != differs.shape or engine_rows.dtype != torch.bool:
                raise ValueError(f"engine_rows must be a {tuple(differs.shape)} bool tensor.")
            differs = differs & engine_rows.to(differs.device)
        out[n] = differs
    return out
