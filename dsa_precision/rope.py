"""Rotary position embedding of the indexer: the cos/sin tables, the rotation, packed angles.

Layouts follow Megatron: ``x`` is ``[s, b, *, d]`` and ``freqs`` the ``RotaryEmbedding`` output
``[s, 1, 1, rope_dim]`` (float32 angles). The RoPE slice is the first ``rope_dim`` lanes of each
vector (DeepSeek's layout); the remaining lanes pass through.

Two sources of cos/sin tables:

- :func:`rope_tables` of angles the caller hands in (Megatron's ``RotaryEmbedding`` output: its
  bits depend on where Megatron computed ``inv_freq``);
- :class:`EngineRopeTables`: the engine's own tables, rebuilt from the token positions
  (:class:`RopePositions`) by the engine's recipe (:func:`_engine_rope_cache`: the model's formula,
  :class:`RopeSpec`, in float32 on the device the engine builds it on), whatever Megatron's
  angles are. What ``rope_fp32`` uses in the Megatron integration.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Hashable
from typing import get_args

import torch

from .checks import _check_bool, _check_positive_int, _check_real
from .devices import _to_device
from .engines import EngineProfile, RopeFma, YarnMscale
from .exact_math import fma_fp32

__all__ = [
    "EngineRopeTables",
    "RopePositions",
    "RopeSpec",
    "YarnScaling",
    "apply_rope",
    "rope_tables",
]

# A bound on the positions of a RoPE table (exact in float64: YaRN's range reads it as one).
_MAX_POSITIONS = 2**53


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


def _rotate(
    x_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fma: bool, rope_fma: RopeFma
) -> torch.Tensor:
    """``x_pe * cos + rotate_half(x_pe) * sin`` in ``x_pe``'s dtype; ``fma``: float32 with one
    product fused, by ``rope_fma`` (:data:`dsa_precision.engines.RopeFma`): ``"cos"``,
    ``fma(x, cos, fl(rotate_half(x) * sin))`` (vLLM's and LMDeploy's Triton kernels on Hopper);
    ``"cos-sin"``, that on the first half and ``fma(rotate_half(x), sin, fl(x * cos))`` on the
    second (SGLang's CUDA kernels)."""
    rot = _rotate_half(x_pe)
    if not (fma and x_pe.dtype == torch.float32):
        return x_pe * cos + rot * sin
    if rope_fma == "cos":
        return fma_fp32(x_pe, cos, rot * sin)
    if rope_fma != "cos-sin":
        raise ValueError(f"rope_fma={rope_fma!r} is not one of {get_args(RopeFma)}.")
    half = x_pe.shape[-1] // 2
    first = fma_fp32(x_pe[..., :half], cos[..., :half], rot[..., :half] * sin[..., :half])
    second = fma_fp32(rot[..., half:], sin[..., half:], x_pe[..., half:] * cos[..., half:])
    return torch.cat((first, second), dim=-1)


def _apply_rope_tables(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rope_interleaved: bool = False,
    fma: bool = False,
    rope_fma: RopeFma = "cos",
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` lanes of ``x`` in ``x.dtype`` by the tables ``cos`` and
    ``sin`` (``[s, 1, 1, rope_dim]``, the halves repeated as Megatron's angles are, converted to
    ``x.dtype`` first); ``rope_interleaved``, ``fma`` and ``rope_fma`` as for
    :func:`apply_rope`."""
    rope_dim = cos.shape[-1]
    x_pe, x_pass = x[..., :rope_dim], x[..., rope_dim:]
    if rope_interleaved:
        x_pe = torch.cat((x_pe[..., 0::2], x_pe[..., 1::2]), dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((_rotate(x_pe, cos, sin, fma, rope_fma), x_pass), dim=-1)


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    *,
    mscale: float = 1.0,
    rope_interleaved: bool = False,
    table_dtype: torch.dtype | None = None,
    fma: bool = False,
    rope_fma: RopeFma = "cos",
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
        rope_fma: which product ``fma`` fuses on the second half (:attr:`EngineProfile.rope_fma`):
            ``"cos"`` (``x * cos``, as on the first) or ``"cos-sin"`` (``rotate_half(x) * sin``).

    Returns:
        ``x``'s shape and dtype.
    """
    cos, sin = rope_tables(freqs, mscale, table_dtype or x.dtype)
    return _apply_rope_tables(
        x, cos, sin, rope_interleaved=rope_interleaved, fma=fma, rope_fma=rope_fma
    )


def _thd_token_freqs(
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
    validate = _check_bool("validate", validate)
    if total is None:
        total = int(cu_seqlens[-1])
        validate = True  # read on the host already: check the lengths too
    total = _check_positive_int("total", total) if total else 0
    if freqs.shape[0] == total:
        return freqs  # one row per packed token: cu_seqlens is not needed
    if total == 0:
        return freqs[:0]
    if validate or cu_seqlens.device.type == "cpu":
        _check_packed_lengths(cu_seqlens, total, freqs.shape[0])
    return freqs.index_select(0, _packed_positions(cu_seqlens, total, freqs.device))


def _packed_positions(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """int64 ``[total]`` on ``device``: each packed row's position inside its sequence (no host
    synchronisation; rows past ``cu_seqlens[-1]`` count on in the last sequence)."""
    cu = _to_device(cu_seqlens, device, torch.int64)
    rows = torch.arange(total, device=device)
    # Each row's sequence (rows past cu_seqlens[-1] would map to the last one).
    sequence = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=cu.numel() - 2)
    return rows - cu[sequence]


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


# ---------------------------------------------------------------------- the engines' own tables


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN scaling of the RoPE frequencies (HF ``rope_scaling`` of type ``yarn``;
    Megatron's ``rope_type="yarn"`` fields, named as Megatron names them).

    Attributes:
        scaling_factor: ``rotary_scaling_factor`` (HF ``factor``; 40 for DeepSeek-V3.2).
        original_max_position_embeddings: the pre-extension context (4096 for DeepSeek-V3.2); the
            correction range is computed from it.
        beta_fast, beta_slow: the rotation counts bounding the ramp (32 and 1), positive.
        mscale, mscale_all_dim: the magnitude-scale exponents (1 and 1 for DeepSeek-V3.2); the
            magnitude they give (:meth:`magnitude`) must be a positive finite number.
    """

    scaling_factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "scaling_factor",
            _check_real("scaling_factor", self.scaling_factor, positive=True),
        )
        _check_positive_int(
            "original_max_position_embeddings",
            self.original_max_position_embeddings,
            high=_MAX_POSITIONS,
        )
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            positive = name.startswith("beta")  # log(positions / (2 pi beta)) of the range
            object.__setattr__(
                self, name, _check_real(name, getattr(self, name), positive=positive)
            )
        for rule in get_args(YarnMscale):
            try:
                scale = self.magnitude(rule)
            except ZeroDivisionError:
                scale = math.inf
            if not 0.0 < scale < math.inf:
                raise ValueError(
                    f"mscale={self.mscale!r}, mscale_all_dim={self.mscale_all_dim!r} with "
                    f"scaling_factor={self.scaling_factor!r} give the magnitude scale {scale!r} "
                    f"(yarn_mscale={rule!r}: 0.1 * m * ln(factor) + 1 per exponent, a ratio); "
                    "no cos/sin table is built from it: pass exponents whose scales are positive "
                    "(DeepSeek-V3.2: 1 and 1)."
                )

    def magnitude(self, rule: YarnMscale = "ratio") -> float:
        """The factor the engine multiplies cos and sin by (a Python float, as every engine
        computes it: ``0.1 * m * ln(factor) + 1`` per exponent ``m``, 1 for a factor <= 1).

        ``"ratio"``: ``g(mscale) / g(mscale_all_dim)`` (vLLM ``deepseek_scaling_rope.py``, SGLang,
        Megatron); ``"ratio-if-both"``: that ratio when both exponents are non-zero, else
        ``g(1)`` (LMDeploy ``nn/rotary_embedding.py`` ``_get_yarn_parameters``)."""
        f = self.scaling_factor

        def g(m: float) -> float:
            return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

        if rule == "ratio-if-both" and not (self.mscale and self.mscale_all_dim):
            return float(g(1))
        return float(g(float(self.mscale)) / g(float(self.mscale_all_dim)))


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """The model's indexer RoPE, what an engine builds its cos/sin cache from.

    Attributes:
        rope_dim: the rotated lanes (Megatron's ``qk_pos_emb_head_dim``, 64), all of them.
        base: the rotary base (``rotary_base``; HF ``rope_theta``).
        yarn: DeepSeek's YaRN scaling (``rope_type="yarn"``), or ``None`` for plain RoPE.
    """

    rope_dim: int
    base: float
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        rope_dim = _check_positive_int("rope_dim", self.rope_dim)
        if rope_dim % 2:
            raise ValueError(f"rope_dim={rope_dim} must be even: RoPE rotates pairs of lanes.")
        object.__setattr__(self, "base", _check_real("base", self.base, positive=True))
        if self.yarn is not None and not isinstance(self.yarn, YarnScaling):
            raise TypeError(f"yarn={self.yarn!r} must be a YarnScaling or None.")
        if self.yarn is not None:
            y = self.yarn
            try:
                _correction_range(self)
            except (ArithmeticError, ValueError) as exc:  # log(1) = 0, an infinite range
                raise ValueError(
                    f"YaRN's correction range of base={self.base!r} (rotary_base), rope_dim="
                    f"{rope_dim}, original_max_position_embeddings="
                    f"{y.original_max_position_embeddings!r}, beta_fast={y.beta_fast!r}, "
                    f"beta_slow={y.beta_slow!r} cannot be computed ({exc}): it divides by "
                    "log(base) and takes log(original_max_position_embeddings / (2 pi beta)); "
                    "pass a base other than 1 and finite betas (DeepSeek-V3.2: 10000, 32, 1)."
                ) from None
        inv_freq = _rope_inv_freq(self, "cpu")
        if not bool((torch.isfinite(inv_freq) & (inv_freq > 0)).all()):
            raise ValueError(
                f"base={self.base!r} (rotary_base)"
                f"{f' with YaRN scaling_factor={self.yarn.scaling_factor!r}' if self.yarn else ''} gives "
                f"float32 inverse frequencies {inv_freq.tolist()[:4]}...; no cos/sin table is "
                "built from infinite or zero frequencies: pass a base whose float32 powers are "
                "finite and nonzero (the models' are above 1, e.g. 10000)."
            )


def _correction_range(spec: RopeSpec) -> tuple[int, float]:
    """YaRN's ramp ``[low, high]`` over the rotary dimensions (the engines' and Megatron's
    Python arithmetic); raises ``ZeroDivisionError``, ``ValueError`` or ``OverflowError`` where
    the fields give none (a base of 1, a non-positive or infinite beta)."""
    r, y = spec.rope_dim, spec.yarn
    assert y is not None  # YaRN only

    def correction_dim(rotations: float) -> float:
        return (r * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.base)
        )

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(y.beta_slow)), r - 1)
    if low == high:
        high += 0.001  # the engines' guard against a zero-width ramp
    return low, high


def _rope_inv_freq(spec: RopeSpec, device: torch.device | str) -> torch.Tensor:
    """float32 ``[rope_dim / 2]`` inverse frequencies, computed on ``device`` with the engines'
    float32 operations, in their order (vLLM 0.33 ``rotary_embedding/base.py`` and
    ``deepseek_scaling_rope.py`` ``_compute_inv_freq``; the same expressions in SGLang 0.5.23,
    LMDeploy 0.18 and Megatron's ``RotaryEmbedding`` / ``YarnRotaryEmbedding``).

    Plain: ``1 / base ** (arange(0, R, 2) / R)``. YaRN: ``p = base ** (arange(0, R, 2) / R)``,
    ``mask = 1 - clamp((arange(R / 2) - low) / (high - low), 0, 1)`` over the correction range
    ``[low, high]`` of ``beta_fast`` / ``beta_slow`` rotations, ``(1 / (factor * p)) * (1 - mask)
    + (1 / p) * mask``. Each operation runs on ``device`` (CUDA's ``pow`` and division by a
    scalar are not the CPU's, so the device is part of the recipe)."""
    r = spec.rope_dim
    exponent = torch.arange(0, r, 2, dtype=torch.float32, device=device) / r
    if spec.yarn is None:
        return 1.0 / (spec.base**exponent)
    y = spec.yarn
    pos_freqs = spec.base**exponent
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (y.scaling_factor * pos_freqs)
    low, high = _correction_range(spec)
    ramp = (torch.arange(r // 2, dtype=torch.float32, device=device) - low) / (high - low)
    mask = 1 - torch.clamp(ramp, 0, 1)
    return interpolation * (1 - mask) + extrapolation * mask


def _engine_rope_cache(
    spec: RopeSpec,
    n_positions: int,
    *,
    device: torch.device | str,
    engine: EngineProfile,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[n_positions, rope_dim / 2]`` of positions ``0 .. n - 1`` as
    ``engine`` computes them before rounding to its cache dtype (``engine.cos_sin_dtype``).

    The recipe (docs/numerics.md, "RoPE tables"): :func:`_rope_inv_freq` on ``device`` (or on the
    CPU and then copied, ``engine.inv_freq_device="cpu"``: LMDeploy), the angles
    ``fl32(fl32(position) * inv_freq)`` and their ``cos`` / ``sin`` on ``device``, YaRN's
    magnitude scale multiplied in float32 (``engine.yarn_mscale``). On CUDA these are CUDA's
    float32 operations, as vLLM and SGLang build their caches at model load under
    ``with torch.device("cuda")``; on the CPU the CPU's, so a CPU run reproduces an engine cache
    built on the CPU (each entry depends only on its position, not on ``n_positions``).
    """
    n = _check_positive_int("n_positions", n_positions)
    device = torch.device(device)
    if engine.inv_freq_device == "cpu":
        inv_freq = _rope_inv_freq(spec, "cpu").to(device)
    else:
        inv_freq = _rope_inv_freq(spec, device)
    t = torch.arange(n, dtype=torch.float32, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if spec.yarn is not None:
        mscale = spec.yarn.magnitude(engine.yarn_mscale)
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


@dataclasses.dataclass(frozen=True)
class RopePositions:
    """The RoPE position of every row of a forward, and a host bound on them.

    Attributes:
        rows: the number of rows ``s``.
        length: every position is below it (a host fact, so that the tables cover it without
            reading the positions: the sequence length, or the longest packed sequence).
        index: int64 ``[rows]`` positions on the rows' device; ``None``: ``0 .. rows - 1``.
    """

    rows: int
    length: int
    index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows = self.rows
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 0:
            raise ValueError(f"rows={rows!r} must be a non-negative integer.")
        _check_positive_int("length", self.length)
        if self.index is None:
            if rows > self.length:
                raise ValueError(
                    f"rows={rows} positions 0 .. {rows - 1} are not below length={self.length}; "
                    "pass the sequence length."
                )
        elif (
            not isinstance(self.index, torch.Tensor)
            or self.index.dtype != torch.int64
            or tuple(self.index.shape) != (rows,)
        ):
            raise ValueError(
                f"index must be an int64 tensor of shape ({rows},), got "
                f"{getattr(self.index, 'dtype', type(self.index).__name__)} "
                f"{tuple(getattr(self.index, 'shape', ()))}."
            )

    @classmethod
    def first(cls, rows: int) -> RopePositions:
        """Positions ``0 .. rows - 1`` (a sequence, no context parallelism)."""
        return cls(rows, max(rows, 1))

    @classmethod
    def packed(
        cls,
        cu_seqlens: torch.Tensor,
        rows: int,
        length: int,
        *,
        device: torch.device | str,
        validate: bool = False,
    ) -> RopePositions:
        """Packed (THD) rows reading the angles of ``length`` positions:
        each row's position inside its sequence, or the row number itself when ``length ==
        rows`` (one position per packed token). On the CPU, or with ``validate``, the lengths
        are checked on the host (every sequence at most ``length`` tokens); on a device they
        are not read."""
        if rows == 0 or length == rows:
            return cls(rows, max(length, 1))
        if _check_bool("validate", validate) or cu_seqlens.device.type == "cpu":
            _check_packed_lengths(cu_seqlens, rows, length)
        return cls(rows, length, _packed_positions(cu_seqlens, rows, torch.device(device)))


# One table per recipe, spec, dtype, device and power-of-two length, for the process: every layer
# of a model shares it (vLLM's get_rope shares one rotary module between its layers likewise),
# and a CUDA graph may read it where it lies, so it is never evicted.
_ENGINE_TABLES: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
_MIN_TABLE_POSITIONS = 4096


def _table_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class EngineRopeTables:
    """An engine's cos/sin tables for one model's RoPE, decided once (the indexer's, with
    ``rope_fp32``) and built on first use on the rows' device.

    Args:
        spec: the model's RoPE (:class:`RopeSpec`).
        engine: the profile whose recipe builds them (``inv_freq_device``, ``yarn_mscale``) and
            whose cache dtype (``cos_sin_dtype``) they are rounded to.

    :meth:`rows` gathers the rows of the positions from :func:`_engine_rope_cache` of at least
    ``positions.length`` positions (built once per device, dtype and power-of-two length, shared
    by every layer and never evicted; a gather per call, no host synchronisation).
    """

    def __init__(self, spec: RopeSpec, engine: EngineProfile) -> None:
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec={spec!r} must be a RopeSpec.")
        if not isinstance(engine, EngineProfile):
            raise TypeError(f"engine={engine!r} must be an EngineProfile.")
        self.spec = spec
        self.engine = engine

    def __repr__(self) -> str:
        return f"EngineRopeTables({self.spec!r}, engine={self.engine.name!r})"

    @property
    def rope_dim(self) -> int:
        return self.spec.rope_dim

    def rows(
        self, positions: RopePositions, device: torch.device | str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[positions.rows, rope_dim]`` in ``dtype`` (the values of the engine's
        ``cos_sin_dtype`` cache; the halves repeated, Megatron's rotate-half layout), contiguous.

        The cache is built with at least ``positions.length`` rows; ``positions.index`` must lie
        below it (the caller's bound, not read on the host)."""
        if not isinstance(positions, RopePositions):
            raise TypeError(f"positions={positions!r} must be RopePositions.")
        device = _table_device(device)
        n = max(_MIN_TABLE_POSITIONS, 1 << (positions.length - 1).bit_length())
        e = self.engine
        key = (self.spec, e.inv_freq_device, e.yarn_mscale, e.cos_sin_dtype, dtype, device, n)
        table = _ENGINE_TABLES.get(key)
        if table is None:
            with torch.no_grad(), torch.inference_mode(False):
                cos, sin = _engine_rope_cache(self.spec, n, device=device, engine=e)
                cos, sin = cos.to(e.cos_sin_dtype).to(dtype), sin.to(e.cos_sin_dtype).to(dtype)
                table = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            # A build recorded by a CUDA graph capture is not cached (it runs at every replay).
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                _ENGINE_TABLES[key] = table
        cos, sin = table
        if positions.index is None:
            return cos[: positions.rows], sin[: positions.rows]
        index = positions.index
        if index.device != device:
            raise ValueError(
                f"positions.index is on {index.device}, the rows on {device}; build the positions "
                "where the rows are."
            )
        return cos.index_select(0, index), sin.index_select(0, index)
