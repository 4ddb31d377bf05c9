"""Rotary position embedding of the indexer: the cos/sin tables, the rotation, packed angles.

Layouts follow Megatron: ``x`` is ``[s, b, *, d]`` and ``freqs`` the ``RotaryEmbedding`` output
``[s, 1, 1, rope_dim]`` (float32 angles). The RoPE slice is the first ``rope_dim`` lanes of each
vector (DeepSeek's layout); the remaining lanes pass through.
"""

from __future__ import annotations

import itertools

import torch

from .checks import check_bool, check_positive_int
from .devices import to_device
from .exact_math import fma_fp32

__all__ = ["apply_rope", "rope_tables", "thd_token_freqs"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the two halves of the last dimension."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(
    freqs: torch.Tensor, mscale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``freqs``, scaled by ``mscale`` in float32, cast to ``dtype``.

    The one definition of the RoPE tables: :func:`apply_rope` uses it, and so do the fused kernels
    (which must not evaluate trigonometry themselves to stay bit-identical). Megatron rounds
    cos/sin to the compute dtype before the products; so do we (a no-op in FP32).
    """
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def _rotate(x_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fma: bool) -> torch.Tensor:
    """``x_pe * cos + rotate_half(x_pe) * sin`` in ``x_pe``'s dtype; ``fma``: float32 with the
    first product fused, ``fma(x, cos, fl(rotate_half(x) * sin))`` (vLLM's kernels on Hopper)."""
    if fma and x_pe.dtype == torch.float32:
        return fma_fp32(x_pe, cos, _rotate_half(x_pe) * sin)
    return x_pe * cos + _rotate_half(x_pe) * sin


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    *,
    mscale: float = 1.0,
    rope_interleaved: bool = False,
    table_dtype: torch.dtype | None = None,
    fma: bool = False,
) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` lanes of ``x`` in ``x.dtype``.

    Args:
        x: ``[s, b, *, d]``; its dtype is the compute dtype (every product and sum rounds to it).
        freqs: ``[s, 1, 1, rope_dim]`` float32 angles (broadcast over batch and heads).
        mscale: YaRN magnitude scale folded into cos/sin (in float32, then cast to ``x.dtype``).
        table_dtype: dtype the cos/sin tables are rounded to before the products (an engine's
            cos/sin cache dtype); default ``x.dtype``.
        rope_interleaved: Megatron's ``dsa_indexer_rope_interleaved`` (MLA style): the RoPE lanes
            arrive as (even, odd) pairs and are de-interleaved into halves before rotation, so the
            output RoPE slice is in rotate-half order. (Megatron forbids ``rotary_interleaved``
            with MLA, so the rotation itself is always rotate-half.)
        fma: float32 only: ``fma(x, cos, fl(rotate_half(x) * sin))``, the multiply-add an
            engine's compiler contracts (:attr:`EngineProfile.fma`).

    Returns:
        ``x``'s shape and dtype.
    """
    rope_dim = freqs.shape[-1]
    x_pe, x_pass = x[..., :rope_dim], x[..., rope_dim:]
    if rope_interleaved:
        x_pe = torch.cat((x_pe[..., 0::2], x_pe[..., 1::2]), dim=-1)
    cos, sin = rope_tables(freqs, mscale, table_dtype or x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((_rotate(x_pe, cos, sin, fma), x_pass), dim=-1)


def thd_token_freqs(
    freqs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    total: int | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Per-token RoPE angles ``[total, 1, 1, rope_dim]`` for packed (THD) sequences.

    As Megatron's unfused THD RoPE without context parallelism: positions restart at 0 in each
    sequence, unless ``freqs`` already holds one row per packed token (``freqs.shape[0] ==
    total``), in which case it is used as is.

    Arguments:
        freqs: ``[max_s, 1, 1, rope_dim]`` angles of positions ``0..max_s-1`` (or one row per
            packed token).
        cu_seqlens: ``[n + 1]`` integer cumulative sequence lengths.
        total: the packed token count (the rows of ``q``). ``None``: ``cu_seqlens[-1]``, read on
            the host (a synchronisation when ``cu_seqlens`` is on a device), and then checked.
        validate: check ``cu_seqlens`` on a device too (one synchronisation). On the CPU, or
            with ``total=None``, the lengths the angles are gathered by are always checked: at
            least ``total`` tokens, no sequence longer than ``freqs``. Unchecked, a sequence
            longer than ``freqs`` fails the device's index bounds check.
    """
    validate = check_bool("validate", validate)
    if total is None:
        total = int(cu_seqlens[-1])
        validate = True  # read on the host already: check the lengths too
    total = check_positive_int("total", total) if total else 0
    if freqs.shape[0] == total:
        return freqs  # one row per packed token: cu_seqlens is not needed
    if total == 0:
        return freqs[:0]
    if validate or cu_seqlens.device.type == "cpu":
        _check_packed_lengths(cu_seqlens, total, freqs.shape[0])
    cu = to_device(cu_seqlens, freqs.device, torch.int64)
    rows = torch.arange(total, device=freqs.device)
    # Each row's sequence (rows past cu_seqlens[-1] would map to the last one; checked above).
    sequence = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=cu.numel() - 2)
    return freqs.index_select(0, rows - cu[sequence])


def _check_packed_lengths(cu_seqlens: torch.Tensor, total: int, positions: int) -> None:
    """``ValueError`` unless ``cu_seqlens`` (read on the host) packs at least ``total`` tokens in
    sequences of at most ``positions`` tokens each."""
    cu = cu_seqlens.to(dtype=torch.int64).tolist()
    if len(cu) < 2 or cu[-1] < total:
        raise ValueError(
            f"cu_seqlens {cu} packs {cu[-1] if cu else 0} tokens but the input has {total} "
            "packed rows; pass the cumulative lengths of these rows."
        )
    longest = max(b - a for a, b in itertools.pairwise(cu))
    if longest > positions:
        raise ValueError(
            f"freqs covers {positions} positions but a packed sequence has {longest} tokens; "
            "build freqs for the longest sequence."
        )
