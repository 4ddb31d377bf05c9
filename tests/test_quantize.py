"""E4M3 / UE8M0 quantization against an exact computation in Python floats (no torch math)."""

import math
import struct

import numpy as np
import pytest
import torch

from dsa_precision import dequantize_fp8, quantize_e4m3_ue8m0, ue8m0_descale


def _e4m3_table() -> list[tuple[float, int]]:
    """(value, bit pattern) of every finite non-negative float8_e4m3fn: bias 7, subnormals,
    0x7F is NaN. Decoded by hand from the format's definition."""
    out = []
    for bits in range(0x7F):
        exp, man = bits >> 3, bits & 7
        value = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        out.append((value, bits))
    return out


E4M3 = _e4m3_table()
assert E4M3[-1][0] == 448.0


def exact_e4m3_bits(v: float) -> int:
    """Round-to-nearest-even of an exactly known value (|v| <= 448) to an E4M3 bit pattern."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    assert a <= 448.0
    best = min(E4M3, key=lambda vb: (abs(vb[0] - a), vb[1] & 1))  # ties: even mantissa
    return sign | best[1]


def exact_descale(amax: float, floor32: float) -> float:
    """Smallest power of two s with max(amax, floor) / s <= 448, by exact comparisons."""
    a = max(amax, floor32)
    e = -200
    while not a <= 448.0 * 2.0**e:  # exact in Python floats: power-of-two scaling of 448
        e += 1
    return 2.0**e


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def check_exact(x: torch.Tensor, amax_floor: float = 1e-4):
    x_fp8, descale = quantize_e4m3_ue8m0(x, amax_floor)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == x.shape[:-1]
    rows = x.float().reshape(-1, 128).tolist()
    got_bits = x_fp8.view(torch.uint8).reshape(-1, 128).tolist()
    got_scale = descale.reshape(-1).tolist()
    for row, bits, scale in zip(rows, got_bits, got_scale, strict=True):
        s = exact_descale(max(abs(v) for v in row), f32(amax_floor))
        assert scale == s, (max(abs(v) for v in row), scale, s)
        want = [exact_e4m3_bits(v / s) for v in row]  # v / s exact: power-of-two scaling
        assert bits == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_vectors_exact(dtype):
    top = 3 if dtype == torch.float16 else 6  # keep float16 finite
    x = torch.randn(3, 5, 128) * torch.logspace(-6, top, 5).view(1, 5, 1)
    check_exact(x.to(dtype))


def test_zero_vector_uses_floor_scale():
    x = torch.zeros(2, 128)
    x_fp8, descale = quantize_e4m3_ue8m0(x)
    assert torch.all(x_fp8.float() == 0)
    assert descale.tolist() == [exact_descale(0.0, f32(1e-4))] * 2
    check_exact(x)
    check_exact(x, amax_floor=1e-10)


def test_subnormal_inputs():
    tiny = torch.tensor([1e-40, -1e-41, 2.0**-149, 0.0] * 32, dtype=torch.float32)
    check_exact(tiny.view(1, 128))
    check_exact(tiny.view(1, 128), amax_floor=1e-42)  # the scale itself subnormal-sized
    bf = torch.full((1, 128), 1e-39, dtype=torch.bfloat16)  # bf16 subnormal
    check_exact(bf)


def test_448_edge_and_mixed_signs():
    x = torch.linspace(-448, 448, 128).view(1, 128)
    x[0, 0] = -448.0
    check_exact(x)
    x_fp8, descale = quantize_e4m3_ue8m0(x)
    assert descale.item() == 1.0 and x_fp8[0, 0].float().item() == -448.0
    # amax exactly 448 * 2**e keeps scale 2**e; one ulp above needs the next power.
    for e in (-10, 0, 7):
        v = torch.zeros(1, 128)
        v[0, 3] = 448.0 * 2.0**e
        assert quantize_e4m3_ue8m0(v)[1].item() == 2.0**e
        v[0, 3] = float(np.nextafter(np.float32(448.0 * 2.0**e), np.float32(np.inf)))
        assert quantize_e4m3_ue8m0(v)[1].item() == 2.0 ** (e + 1)


def test_float32_amax_just_above_power_of_two_boundaries():
    """amax one to a few ulps above 448 * 2**e: the naive float32 exp2(ceil(log2(amax / 448)))
    gets some of these wrong; the exact rule must not."""
    rows, naive_wrong = [], 0
    for e in range(-20, 21):
        boundary = np.float32(448.0 * 2.0**e)
        for ulps in range(1, 5):
            amax = boundary
            for _ in range(ulps):
                amax = np.nextafter(amax, np.float32(np.inf))
            row = torch.full((128,), float(amax) / 3)
            row[17] = -float(amax)
            rows.append(row)
            a = torch.tensor(float(amax), dtype=torch.float32)
            naive = torch.exp2(torch.ceil(torch.log2(a / 448.0)))
            naive_wrong += naive.item() != exact_descale(float(amax), f32(1e-4))
    x = torch.stack(rows)
    check_exact(x)
    assert naive_wrong > 0, "the boundary cases no longer exercise the float32 log2 pitfall"
    # No element saturates: the largest magnitude maps to at most 448 without clamping.
    x_fp8, descale = quantize_e4m3_ue8m0(x)
    assert torch.all(
        dequantize_fp8(x_fp8, descale).abs().amax(-1) <= x.abs().amax(-1) * (1 + 2**-4)
    )


def test_descale_is_power_of_two_and_bounds():
    amax = torch.rand(1000) * torch.logspace(-8, 8, 1000)
    s = ue8m0_descale(amax)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)
    a = amax.clamp_min(torch.tensor(1e-4, dtype=torch.float32))
    assert torch.all(a / s <= 448) and torch.all(a / (s / 2) > 448)


def test_round_trip_error_bound():
    x = torch.randn(64, 128)
    x_fp8, descale = quantize_e4m3_ue8m0(x)
    err = (dequantize_fp8(x_fp8, descale) - x).abs()
    # E4M3 has 3 mantissa bits: half an ulp is 2**-4 relative for normals; subnormal step 2**-9 * s.
    bound = torch.maximum(x.abs() * 2**-4, descale.unsqueeze(-1) * 2**-10)
    assert torch.all(err <= bound)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_vector_never_becomes_finite(bad):
    x = torch.randn(3, 128)
    x[1, 5] = bad
    x_fp8, descale = quantize_e4m3_ue8m0(x)
    assert torch.isnan(descale[1]) and torch.all(torch.isnan(x_fp8[1].float()))
    assert torch.isfinite(descale[[0, 2]]).all()
    check_exact(x[[0, 2]])


@pytest.mark.parametrize(
    "x, err, match",
    [
        (torch.zeros(2, 64), ValueError, "last dimension must be 128"),
        (torch.zeros(()), ValueError, "last dimension must be 128"),
        (torch.zeros(2, 128, dtype=torch.int32), TypeError, "dtype torch.int32"),
        (torch.zeros(2, 128, dtype=torch.float64), TypeError, "float64"),
        ([0.0] * 128, TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs(x, err, match):
    with pytest.raises(err, match=match):
        quantize_e4m3_ue8m0(x)


@pytest.mark.parametrize("floor", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_floor(floor):
    with pytest.raises(ValueError, match="amax_floor"):
        quantize_e4m3_ue8m0(torch.zeros(1, 128), amax_floor=floor)
