"""Inductor's Welford LayerNorm (``exact_math.layer_norm_fp32_welford``, vllm-legacy's key) against
a scalar model written from Triton 3.6's PTX of Inductor's kernel, and the profile that takes it."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from dsa_precision import ENGINE_PROFILES
from dsa_precision.exact_math import DIV_FULL_ONE_THIRD, layer_norm_fp32_welford
from dsa_precision.kernels.preprocess_quantize import _LN_ARITH


def _f(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _bits(v: float) -> int:
    return struct.unpack("I", struct.pack("f", v))[0]


def _fma(a: float, b: float, c: float) -> float:
    """float32 ``a * b + c`` rounded once (to nearest, ties to even), from the exact rational."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = _f(float(exact))
    if exact == 0 or near == 0:
        return near
    step = 1 if near >= 0 else -1
    around = [struct.unpack("f", struct.pack("I", _bits(near) + d))[0] for d in (-step, 0, step)]
    return min(around, key=lambda v: (abs(Fraction(v) - exact), _bits(v) & 1))


def _scalar_lanes(x: list[float]) -> list[tuple[float, float]]:
    """One row's per-lane ``(mean, m2)``, every float32 operation of the PTX (fma.rn, mul, sub,
    add) in its order."""
    state = []
    for lane in range(32):
        e = x[4 * lane : 4 * lane + 4]
        mean, m2 = e[0], 0.0
        for i, r in ((1, 0.5), (2, DIV_FULL_ONE_THIRD), (3, 0.25)):
            delta = _f(e[i] - mean)
            mean, m2 = _fma(r, delta, mean), _fma(r, _f(_f(delta * delta) * i), m2)
        state.append((mean, m2))
    count = 4.0
    for s in (16, 8, 4, 2, 1):
        new = []
        for lane in range(32):
            (m, v), (mo, vo) = state[lane], state[lane ^ s]
            delta = _f(mo - m)
            new.append((_fma(0.5, delta, m), _fma(0.5, _f(_f(delta * delta) * count), _f(v + vo))))
        state, count = new, count * 2
    return state


def _scalar_row(x: list[float], w: list[float], b: list[float], eps: float) -> list[float]:
    state, out = _scalar_lanes(x), []
    for j in range(128):
        mean, m2 = state[j // 4]
        rstd = _f(1.0 / _f(math.sqrt(_f(m2 / 128 + _f(eps)))))  # IEEE off CUDA (rsqrt_fp32)
        out.append(_fma(_f(_f(x[j] - mean) * rstd), w[j], b[j]))
    return out


def test_welford_layer_norm_matches_its_scalar_model():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 128, generator=g) * 3 + 1.5).bfloat16().float()
    w, b = 1 + 0.2 * torch.randn(128, generator=g), 0.2 * torch.randn(128, generator=g)
    got = layer_norm_fp32_welford(x, w, b, 1e-6, fma=True)
    for row in range(x.shape[0]):
        want = _scalar_row(x[row].tolist(), w.tolist(), b.tolist(), 1e-6)
        assert got[row].tolist() == want, row


def test_each_lane_keeps_statistics_of_its_own():
    """The butterfly's combine is not symmetric: rows exist whose lanes end with different
    statistics (the rule then normalises each element with its own lane's), and the result is
    not the float64 LayerNorm rounded once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).bfloat16().float()
    spread = [len(set(_scalar_lanes(r))) for r in x.tolist()]
    assert max(spread) > 1
    y = layer_norm_fp32_welford(x, None, None, 1e-6, fma=True)
    row = spread.index(max(spread))
    assert y[row].tolist() == _scalar_row(x[row].tolist(), [1.0] * 128, [0.0] * 128, 1e-6)
    ref = torch.nn.functional.layer_norm(x.double(), (128,), eps=1e-6).float()
    assert not torch.equal(y, ref)
    assert (y - ref).abs().max() < 1e-5


def test_welford_refuses_other_widths():
    with pytest.raises(ValueError, match="128-wide"):
        layer_norm_fp32_welford(torch.zeros(2, 64), None, None, 1e-6, fma=True)


def test_vllm_legacy_takes_the_welford_rule():
    assert ENGINE_PROFILES["vllm-legacy"].layernorm == "fp32-welford"
    assert ENGINE_PROFILES["vllm-legacy"].k_norm_eps == 1e-6
    assert "fp32-welford" in _LN_ARITH  # the fused kernel evaluates it (interpreter tests)
