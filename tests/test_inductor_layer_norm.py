"""Inductor's key LayerNorm as vLLM 0.26-0.28 compile it, against scalar models written from Triton
3.6's PTX of Inductor's kernels: the looped Welford reduction (``exact_math.layer_norm_fp32_welford``,
vllm-legacy's ``fp32-welford``) and the persistent two-pass reduction of either configuration its
autotuner picks from (``layer_norm_fp32_ops(..., inductor_xblock=1 / 8)``, ``fp32-inductor-x1`` /
``-x8``), and the profile that takes them."""

from __future__ import annotations

import dataclasses
import math
import struct
from fractions import Fraction

import pytest
import torch

from dsa_precision import ENGINE_PROFILES, vllm_legacy_profile
from dsa_precision.exact_math import (
    _DIV_FULL_ONE_THIRD,
    _triton_block_sum,
    inductor_block_sum,
    layer_norm_fp32_ops,
    layer_norm_fp32_welford,
)
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
        for i, r in ((1, 0.5), (2, _DIV_FULL_ONE_THIRD), (3, 0.25)):
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


def _butterfly(values: list[float], steps: tuple[int, ...]) -> float:
    """``shfl.sync.bfly`` then ``add.f32`` for each step: every lane ends with the same sum."""
    for s in steps:
        values = [_f(values[i] + values[i ^ s]) for i in range(len(values))]
    return values[0]


def _scalar_persistent_sum(v: list[float], xblock: int, squares: bool) -> float:
    """One row's ``tl.sum`` as the PTX of Inductor's persistent kernel adds it (``squares``: of
    ``v * v``, the multiplies contracted as ptxas received them)."""
    if xblock == 1:  # thread t = 32 w + l holds v[2t], v[2t + 1]
        if squares:
            part = [_fma(v[2 * t], v[2 * t], _f(v[2 * t + 1] * v[2 * t + 1])) for t in range(64)]
        else:
            part = [_f(v[2 * t] + v[2 * t + 1]) for t in range(64)]
        warps = [_butterfly(part[32 * w : 32 * w + 32], (16, 8, 4, 2, 1)) for w in range(2)]
        return _f(warps[0] + warps[1])
    part = []  # xblock 8 (and 32): thread t holds v[8t .. 8t + 7]
    for t in range(16):
        e = v[8 * t : 8 * t + 8]
        if squares:
            acc = _fma(e[0], e[0], _f(e[1] * e[1]))
            for a in e[2:]:
                acc = _fma(a, a, acc)
        else:
            acc = e[0]
            for a in e[1:]:
                acc = _f(acc + a)
        part.append(acc)
    return _butterfly(part, (8, 4, 2, 1))


def _scalar_persistent_row(x, w, b, eps: float, xblock: int) -> list[float]:
    """``mean = div.full(sum, 128)``; ``d = x - mean``; ``var = div.full(sum(d * d), 128)``;
    ``rstd = rsqrt(var + eps)``; ``fma(fl(d * rstd), w, b)``."""
    mean = _f(_scalar_persistent_sum(x, xblock, False) / 128)
    d = [_f(v - mean) for v in x]
    var = _f(_scalar_persistent_sum(d, xblock, True) / 128)
    rstd = _f(1.0 / _f(math.sqrt(_f(var + _f(eps)))))  # IEEE off CUDA (rsqrt_fp32)
    return [_fma(_f(dj * rstd), wj, bj) for dj, wj, bj in zip(d, w, b, strict=True)]


@pytest.mark.parametrize("xblock", [1, 8])
def test_persistent_layer_norm_matches_its_scalar_model(xblock):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 128, generator=g) * 2.0 ** torch.randint(-6, 6, (8, 128), generator=g)
    x = (x + 3).bfloat16().float()
    w, b = 1 + 0.2 * torch.randn(128, generator=g), 0.2 * torch.randn(128, generator=g)
    got = layer_norm_fp32_ops(x, w, b, 1e-6, fma=True, inductor_xblock=xblock)
    for row in range(x.shape[0]):
        want = _scalar_persistent_row(x[row].tolist(), w.tolist(), b.tolist(), 1e-6, xblock)
        assert got[row].tolist() == want, row


def test_the_three_reductions_add_in_different_orders():
    """XBLOCK 1, XBLOCK 8 / 32 and vLLM 0.33's tree (fp32-ops) give other sums on some rows, so
    the configuration the autotuner keeps decides the key's bits; each matches its scalar model."""
    g = torch.Generator().manual_seed(6)
    r = torch.randn(64, 128, generator=g) * 2.0 ** torch.randint(-8, 8, (64, 128), generator=g)
    sums = {xb: inductor_block_sum(r, xblock=xb)[:, 0] for xb in (1, 8)}
    assert not torch.equal(sums[1], sums[8])
    assert not torch.equal(sums[1], _triton_block_sum(r)[:, 0])
    assert not torch.equal(sums[8], _triton_block_sum(r)[:, 0])
    for xb, got in sums.items():
        for row in range(0, 64, 7):
            assert got[row].item() == _scalar_persistent_sum(r[row].tolist(), xb, False), (xb, row)
    squares = inductor_block_sum(r, xblock=8, squares_of=r, fma=True)[:, 0]
    assert squares[5].item() == _scalar_persistent_sum(r[5].tolist(), 8, True)
    with pytest.raises(ValueError, match="must be 1 or 8"):
        inductor_block_sum(r, xblock=32)
    with pytest.raises(ValueError, match="128-wide"):
        inductor_block_sum(torch.ones(2, 64), xblock=8)
    with pytest.raises(ValueError, match="powers of two"):
        _triton_block_sum(r, distances=(1, 2, 4, 8, 16, 32, 32))


def test_vllm_legacy_profile_follows_the_size_vllm_compiled_for():
    """From 64 rows per SM (8,448 tokens on 132 SMs) Inductor loops with Welford: the registered
    profile; below, the autotuned XBLOCK decides and must be named (8 and 32 add alike)."""
    assert (
        vllm_legacy_profile(compiled_tokens=16384, sm_count=132) is ENGINE_PROFILES["vllm-legacy"]
    )
    assert vllm_legacy_profile(compiled_tokens=8448, sm_count=132).layernorm == "fp32-welford"
    assert vllm_legacy_profile(compiled_tokens=8192, sm_count=114).layernorm == "fp32-welford"
    for xblock, rule in (
        (1, "fp32-inductor-x1"),
        (8, "fp32-inductor-x8"),
        (32, "fp32-inductor-x8"),
    ):
        p = vllm_legacy_profile(compiled_tokens=8192, sm_count=132, xblock=xblock)
        assert p.layernorm == rule and p.name == f"vllm-legacy-xblock{xblock}"
        assert (
            dataclasses.replace(p, layernorm="fp32-welford", name="vllm-legacy")
            == ENGINE_PROFILES["vllm-legacy"]
        )
        assert rule in _LN_ARITH  # the fused kernel evaluates it
    with pytest.raises(
        ValueError, match=r"xblock=None: .* 8192 tokens, below 64 \* sm_count = 8448"
    ):
        vllm_legacy_profile(compiled_tokens=8192, sm_count=132)
    with pytest.raises(ValueError, match="xblock=4"):
        vllm_legacy_profile(compiled_tokens=2048, sm_count=132, xblock=4)
    with pytest.raises(ValueError, match="sm_count=0 must be a positive int"):
        vllm_legacy_profile(compiled_tokens=2048, sm_count=0)
