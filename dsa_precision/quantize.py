"""E4M3 quantization with one FP32 descale per 128-vector, under an engine's exact rules.

The inference indexers quantize each (token, head) vector of 128 values to float8_e4m3fn with one
float32 descale, ``x ~= x_fp8 * descale``, but they form the descale differently
(:class:`dsa_precision.engines.Fp8Rule`); with ``a = max(amax, floor)``:

- ``scale_format="ue8m0"``, ``scale_ratio="exact"``: the smallest power of two ``s`` with
  ``a <= 448 * s``, decided exactly from the exponent bits (``frexp``): the package's original
  contract.
- otherwise the float32 ratio ``r = a / 448`` (``scale_ratio="divide"``, IEEE) or
  ``r = a * fp32(1 / 448)`` (``"reciprocal"``) comes first, then for UE8M0 a power of two from it:
  ``ue8m0_ceil="bits"`` is the exact ceiling (DeepGEMM's ``ceil_to_ue8m0``, DeepSeek's and
  LMDeploy's bit trick), ``"log2"`` is ``exp2(ceil(log2(r)))`` with a correctly rounded float32
  ``log2`` (vLLM on Hopper, SGLang's queries): for ``r = 2**e * (1 + m * 2**-23)`` the float32
  ``log2`` rounds ``e + log2(1 + m * 2**-23)`` back to ``e`` while ``m`` is below a few units
  (:data:`_LOG2_CEIL_BAND`), so such an ``r`` gets ``2**e`` and the largest element saturates at
  448. It is computed here from the bits, so every device gives the same answer; an engine whose
  ``log2`` is not correctly rounded can differ for ``m`` at the edge of that band (about one
  vector in ten million).
- ``scale_format="fp32"``: ``r`` itself.

Values are then divided by the descale (``scale_apply="divide"``, IEEE) or multiplied by its
float32 reciprocal (``"reciprocal"``; the same bits for a power of two), clamped to +-448 and
rounded to nearest even E4M3.
"""

from __future__ import annotations

import torch

from .checks import _check_tensor
from .config import _QUANT_BLOCK
from .devices import _device_constant
from .engines import DEFAULT_ENGINE, Fp8Rule

__all__ = ["dequantize_fp8", "quantize_e4m3_ue8m0", "quantize_fp8", "ue8m0_descale"]

# Largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
_E4M3_MAX = 448.0
_DEFAULT_AMAX_FLOOR = 1e-4
# The smallest floor of the float32-ratio rules: r stays a normal float32 number.
_MIN_RATIO_FLOOR = 2.0**-100
# For r = 2**e * (1 + m * 2**-23), m > 0: the float32 log2 of r rounds to e exactly while
# m <= LOG2_CEIL_BAND[b], b = floor(log2(|e| - (e < 0))) (the binade of the float32 result near
# e); b <= 1 and e in {0, -1} have no band. Derived from m < (2**(2**(b - 24)) - 1) * 2**23: the
# result's half ulp (no tie is possible: log2 of such an r is irrational).
_LOG2_CEIL_BAND = (0, 0, 1, 2, 5, 11, 22)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _next_pow2_exact(a: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``s`` with ``a <= 448 * s``, decided exactly (``a`` float32 > 0)."""
    # a = m * 2**E with m in [0.5, 1). Since 448 = 7 * 2**6:
    #   a <= 448 * 2**e  <=>  m * 2**(E - 6 - e) <= 7.
    # The largest power of two not above 7 / m is 4 when m > 7/8 and 8 otherwise, so the
    # smallest admissible e is E - 8 when m > 0.875 and E - 9 otherwise. All comparisons exact.
    mantissa, exponent = torch.frexp(a)
    e = exponent - torch.where(mantissa > 0.875, 8, 9).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(a), e)


def _pow2_from_ratio(r: torch.Tensor, ceil: str) -> torch.Tensor:
    """The UE8M0 power of two of a normal float32 ratio ``r > 0`` (see the module docstring)."""
    bits = r.view(torch.int32)
    e = (bits >> 23) - 127
    m = bits & 0x7FFFFF
    if ceil == "bits":
        up = m != 0
    else:
        k = e.abs() - (e < 0).to(e.dtype)  # |e| for e > 0, |e| - 1 for e < 0
        band = _device_constant(_LOG2_CEIL_BAND, e.dtype, r.device)
        binade = torch.where(k > 0, torch.log2(k.clamp(min=1).float()).floor().int(), 0)
        up = m > band[binade.clamp(0, len(_LOG2_CEIL_BAND) - 1)]
    return ((e + up.to(e.dtype) + 127) << 23).view(torch.float32)


@torch.no_grad()
def _fp8_descale(amax: torch.Tensor, rule: Fp8Rule = DEFAULT_ENGINE.q_quant) -> torch.Tensor:
    """The float32 descale of vectors with per-vector maxima ``amax`` (any shape, >= 0).

    Non-finite ``amax`` (Inf or NaN) gives a NaN descale: such a vector has no finite scale.
    See the module docstring for the rules.
    """
    _check_tensor("amax", amax)
    a = amax.to(torch.float32).clamp_min(rule.amax_floor)  # the floor is rounded to float32
    if rule.scale_ratio == "exact":
        descale = _next_pow2_exact(a)
    else:
        finite = torch.where(torch.isfinite(a), a, torch.ones_like(a))
        if rule.scale_ratio == "divide":
            # A tensor divisor: torch's CUDA division by a Python scalar multiplies by the
            # scalar's reciprocal instead of dividing (BinaryDivTrueKernel.cu), which is the
            # "reciprocal" ratio, not this one.
            r = finite / torch.full_like(finite, _E4M3_MAX)
        else:
            r = finite * torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32)
        descale = _pow2_from_ratio(r, rule.ue8m0_ceil) if rule.scale_format == "ue8m0" else r
    return torch.where(torch.isfinite(a), descale, torch.full_like(a, float("nan")))


def ue8m0_descale(amax: torch.Tensor, amax_floor: float = _DEFAULT_AMAX_FLOOR) -> torch.Tensor:
    """Smallest power of two ``s`` with ``max(amax, amax_floor) / s <= 448``, exactly."""
    return _fp8_descale(amax, Fp8Rule(amax_floor=amax_floor))


def _check_vectors(x: object) -> None:
    x = _check_tensor("x", x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; FP8 quantization takes bfloat16, float16 or float32 vectors "
            "(cast integer or float64 data first)."
        )
    if x.ndim == 0 or x.shape[-1] != _QUANT_BLOCK:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; the last dimension must be {_QUANT_BLOCK} "
            "(one descale per 128-vector)."
        )


@torch.no_grad()
def quantize_fp8(
    x: torch.Tensor, rule: Fp8Rule = DEFAULT_ENGINE.q_quant
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 128-vectors to E4M3 with one float32 descale each, under ``rule``.

    Args:
        x: ``[..., 128]`` bfloat16, float16 or float32 (an FP32 carrier is quantized from its
            FP32 values, never via BF16).
        rule: an engine's rule (:attr:`dsa_precision.EngineProfile.q_quant` / ``k_quant``); the
            default is the default profile's (``vllm``) q rule; ``Fp8Rule()`` is the package's
            original contract (exact UE8M0, floor 1e-4), ``vllm-exact``'s.

    Returns:
        ``(x_fp8, descale)``: ``x_fp8`` float8_e4m3fn of ``x``'s shape; ``descale`` float32 of
        shape ``x.shape[:-1]`` with ``x ~= x_fp8.float() * descale[..., None]``. A vector holding
        an Inf or NaN gets a NaN descale and all-NaN values, so it can never turn into finite
        scores.
    """
    if not isinstance(rule, Fp8Rule):
        raise TypeError(
            f"rule must be an Fp8Rule, got {type(rule).__name__}; pass an engine's "
            "EngineProfile.q_quant / k_quant or Fp8Rule(...)."
        )
    _check_vectors(x)
    if rule.scale_ratio != "exact" and rule.amax_floor < _MIN_RATIO_FLOOR:
        raise ValueError(
            f"amax_floor={rule.amax_floor!r} is below 2**-100: the float32 ratio rules need a "
            "normal float32 ratio."
        )
    x32 = x.to(torch.float32)  # exact for every input dtype
    descale = _fp8_descale(x32.abs().amax(dim=-1), rule)
    s = descale.unsqueeze(-1)
    scaled = x32 / s if rule.scale_apply == "divide" else x32 * torch.reciprocal(s)
    # torch's E4M3 cast saturates out-of-range values (even Inf) to +-448; a non-finite vector
    # must stay non-finite, so poison it explicitly.
    scaled = torch.where(torch.isfinite(s), scaled, torch.full_like(scaled, float("nan")))
    x_fp8 = scaled.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return x_fp8, descale


def quantize_e4m3_ue8m0(
    x: torch.Tensor, amax_floor: float = _DEFAULT_AMAX_FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8` with exact power-of-two (UE8M0) descales: the package's original
    contract (DeepGEMM ``per_token_cast_to_fp8(..., use_ue8m0=True)`` decided exactly)."""
    return quantize_fp8(x, Fp8Rule(amax_floor=amax_floor))


def dequantize_fp8(x_fp8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x_fp8.float() * descale[..., None]`` as float32 (exact for power-of-two descales)."""
    _check_tensor("x_fp8", x_fp8)
    if _check_tensor("descale", descale).shape != x_fp8.shape[:-1]:
        raise ValueError(
            f"descale has shape {tuple(descale.shape)}; expected one descale per vector of x_fp8 "
            f"{tuple(x_fp8.shape)}, {tuple(x_fp8.shape[:-1])}."
        )
    return x_fp8.to(torch.float32) * descale.unsqueeze(-1)
