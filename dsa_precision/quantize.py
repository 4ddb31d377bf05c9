"""E4M3 quantization with one power-of-two (UE8M0) descale per 128-vector.

This is the inference indexer's FP8 format on Hopper (vLLM / SGLang / DeepGEMM
``per_token_cast_to_fp8(..., use_ue8m0=True)``): one FP32 descale per (token, head) vector of
128 values, rounded *up* to a power of two, so that ``x ~= x_fp8 * descale``.

The descale is computed exactly from the exponent bits (``frexp``), not with a float32
``exp2(ceil(log2(amax / 448)))``: that formula is wrong for float32 amax values one or a few ulps
above a power-of-two boundary ``448 * 2**e`` (the rounded ``log2`` lands exactly on ``e``), which
halves the scale and saturates the largest element. BF16 carriers never hit this (their amax has
8 significant bits); the FP32 carriers of ``rope_fp32`` do.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "QUANT_BLOCK",
    "dequantize_e4m3_ue8m0",
    "quantize_e4m3_ue8m0",
    "ue8m0_descale",
]

# Largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
E4M3_MAX = 448.0
# One descale per this many contiguous values (the last dimension).
QUANT_BLOCK = 128
DEFAULT_AMAX_FLOOR = 1e-4
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.no_grad()
def ue8m0_descale(amax: torch.Tensor, amax_floor: float = DEFAULT_AMAX_FLOOR) -> torch.Tensor:
    """Smallest power of two ``s`` with ``max(amax, amax_floor) / s <= 448``, exactly.

    Args:
        amax: float32 (or narrower) tensor of non-negative per-vector maxima, any shape.
        amax_floor: positive floor applied before the rule (1e-4 in vLLM / SGLang).

    Returns:
        float32 tensor of the same shape; every finite entry is an exact power of two. Non-finite
        ``amax`` (Inf or NaN) gives a NaN descale: such a vector has no finite scale.
    """
    a = amax.to(torch.float32).clamp_min(amax_floor)
    # a = m * 2**E with m in [0.5, 1). Since 448 = 7 * 2**6:
    #   a <= 448 * 2**e  <=>  m * 2**(E - 6 - e) <= 7.
    # The largest power of two not above 7 / m is 4 when m > 7/8 and 8 otherwise, so the
    # smallest admissible e is E - 8 when m > 0.875 and E - 9 otherwise. All comparisons exact.
    mantissa, exponent = torch.frexp(a)
    e = exponent - torch.where(mantissa > 0.875, 8, 9).to(exponent.dtype)
    descale = torch.ldexp(torch.ones_like(a), e)
    return torch.where(torch.isfinite(a), descale, torch.full_like(a, float("nan")))


@torch.no_grad()
def quantize_e4m3_ue8m0(
    x: torch.Tensor, amax_floor: float = DEFAULT_AMAX_FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 128-vectors to E4M3 with a UE8M0 (power-of-two) descale each.

    Args:
        x: ``[..., 128]`` bfloat16, float16 or float32 (an FP32 carrier is quantized from its
            FP32 values, never via BF16).
        amax_floor: positive floor of the per-vector amax (1e-4 in vLLM / SGLang; some engines
            use 1e-10). A zero vector gets the floor's scale and quantizes to zeros.

    Returns:
        ``(x_fp8, descale)``: ``x_fp8`` is ``float8_e4m3fn`` of ``x``'s shape, the
        round-to-nearest-even E4M3 value of ``x / descale`` (never saturating: ``|x| / descale <=
        448`` by construction); ``descale`` is float32 of shape ``x.shape[:-1]`` with
        ``x ~= x_fp8.float() * descale[..., None]``. A vector holding an Inf or NaN gets a NaN
        descale and all-NaN values, so it can never turn into finite scores.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; quantize_e4m3_ue8m0 takes bfloat16, float16 or float32 "
            "vectors (cast integer or float64 data first)."
        )
    if x.ndim == 0 or x.shape[-1] != QUANT_BLOCK:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; the last dimension must be {QUANT_BLOCK} "
            "(one UE8M0 descale per 128-vector)."
        )
    amax_floor = float(amax_floor)
    if not (amax_floor > 0.0 and amax_floor < float("inf")):
        raise ValueError(
            f"amax_floor={amax_floor!r} must be a positive finite number (e.g. 1e-4 or 1e-10)."
        )
    x32 = x.to(torch.float32)  # exact for every input dtype
    amax = x32.abs().amax(dim=-1)
    descale = ue8m0_descale(amax, amax_floor)
    # Division by a power of two is exact in float32 here (results are >= 2**-126 or round to
    # zero in E4M3 anyway), so the only rounding is the E4M3 cast, which is round-to-nearest-even.
    scaled = x32 / descale.unsqueeze(-1)
    # torch's E4M3 cast saturates out-of-range values (even Inf) to +-448; a non-finite vector
    # must stay non-finite, so poison it explicitly. Finite vectors never reach the clamp.
    bad = ~torch.isfinite(descale).unsqueeze(-1)
    scaled = torch.where(bad, torch.full_like(scaled, float("nan")), scaled)
    x_fp8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x_fp8, descale


def dequantize_e4m3_ue8m0(x_fp8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x_fp8.float() * descale[..., None]`` as float32 (exact: a power-of-two scaling)."""
    return x_fp8.to(torch.float32) * descale.unsqueeze(-1)
