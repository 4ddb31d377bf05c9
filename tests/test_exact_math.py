"""The emulated float32 arithmetic (dsa_precision.exact_math) against exact references in Python rationals: fixed reduction orders, fused multiply-adds rounded once, the engines' LayerNorm."""

import pytest
import torch


def _python_pairwise(values: list[float]) -> float:
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def test_pairwise_sum_has_a_fixed_order():
    from dsa_precision.exact_math import _pairwise_sum

    x = torch.randn(6, 128, dtype=torch.float64) * torch.logspace(-30, 30, 128, dtype=torch.float64)
    got = _pairwise_sum(x)[:, 0].tolist()
    assert got == [_python_pairwise(row) for row in x.tolist()]
    # An order-dependent sum: the tree cancels 1 - 1 first, so the tiny term survives.
    v = torch.zeros(128, dtype=torch.float64)
    v[0], v[1], v[2] = 1.0, -1.0, 2.0**-60
    assert _pairwise_sum(v).item() == 2.0**-60


def test_layer_norm_fp32_is_layout_independent():
    from dsa_precision.preprocess import layer_norm_fp32

    k = (torch.randn(64, 3, 128) * torch.logspace(-12, 2, 128)).to(torch.bfloat16)
    w, b = torch.randn(128).to(torch.bfloat16), torch.randn(128).to(torch.bfloat16)
    contiguous = layer_norm_fp32(k, w, b, 1e-6)
    strided = layer_norm_fp32(k.transpose(0, 1).contiguous().transpose(0, 1), w, b, 1e-6)
    one_row = torch.stack([layer_norm_fp32(k[i], w, b, 1e-6) for i in range(k.shape[0])])
    assert torch.equal(contiguous, strided) and torch.equal(contiguous, one_row)


def _f32_exact(x) -> float:
    """An exact rational rounded to the nearest float32 (ties to even), via numpy's rounding of
    a double that holds it exactly or lies on the right side of every float32 midpoint."""
    from fractions import Fraction

    import numpy as np

    lo = float(np.float32(float(x)))
    # float(x) rounds once to double; settle a float32 tie the double could have created.
    mid_up = (Fraction(lo) + Fraction(float(np.nextafter(np.float32(lo), np.float32(np.inf))))) / 2
    mid_dn = (Fraction(lo) + Fraction(float(np.nextafter(np.float32(lo), np.float32(-np.inf))))) / 2
    if x > mid_up or (x == mid_up and (np.float32(lo).view(np.int32) & 1)):
        return float(np.nextafter(np.float32(lo), np.float32(np.inf)))
    if x < mid_dn or (x == mid_dn and (np.float32(lo).view(np.int32) & 1)):
        return float(np.nextafter(np.float32(lo), np.float32(-np.inf)))
    return lo


def test_fma_fp32_rounds_once():
    """fma_fp32 is the correctly rounded a * b + c, including the cases where rounding the
    float64 sum to float32 rounds twice (the exact value just off a float32 midpoint)."""
    from fractions import Fraction

    from dsa_precision.exact_math import fma_fp32

    g = torch.Generator().manual_seed(3)
    a = torch.randn(4000, generator=g)
    b = torch.randn(4000, generator=g) * 2.0 ** torch.randint(-30, 30, (4000,), generator=g)
    c = -(a * b) * (1 + torch.randn(4000, generator=g) * 1e-6)  # heavy cancellation
    # Double-rounding traps: (1 + 2**-12)**2 = 1 + 2**-11 + 2**-24 is a float32 midpoint, and
    # +-2**-60 is below float64's precision there: the float64 sum lands on the midpoint.
    t = 1.0 + 2.0**-12
    a = torch.cat((a, torch.tensor([t, t, -t])))
    b = torch.cat((b, torch.tensor([t, t, t])))
    c = torch.cat((c, torch.tensor([2.0**-60, -(2.0**-60), -(2.0**-60)])))
    got = fma_fp32(a, b, c)
    naive = (a.double() * b.double() + c.double()).float()
    want = [
        _f32_exact(Fraction(x) * Fraction(y) + Fraction(z))
        for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)
    ]
    assert got.tolist() == want
    assert not torch.equal(naive, got)  # the double rounding it avoids happens here
    assert got[-3].item() == 1.0 + 2.0**-11 + 2.0**-23 and naive[-3].item() == 1.0 + 2.0**-11


def _warp_sum(values, *, squares: bool, fma: bool):
    """A simulation of Triton's tl.sum over 128 float32 values, one per thread of 4 warps,
    lane by lane as the PTX reads (shfl.bfly 16 ... 1 in each warp, lane 0 writes the warp's
    partial, then shfl.bfly 2, 1 over the 4 partials)."""
    from fractions import Fraction

    import numpy as np

    f = np.float32
    out = []
    for w in range(4):
        lane = [f(v) for v in values[32 * w : 32 * w + 32]]
        first = True
        for m in (16, 8, 4, 2, 1):
            new = []
            for i in range(32):
                a, b = lane[i], lane[i ^ m]
                if first and squares:
                    if fma:  # fma(d_i, d_i, fl(d_j * d_j)): lane i's multiply fused
                        new.append(f(_f32_exact(Fraction(float(a)) ** 2 + Fraction(float(b * b)))))
                    else:
                        new.append(f(a * a) + f(b * b))
                else:
                    new.append(f(a + b))
            lane, first = new, False
        out.append(lane[0])
    for m in (2, 1):
        out = [f(out[i] + out[i ^ m]) for i in range(4)]
    return float(out[0])


@pytest.mark.parametrize("fma", [False, True])
def test_triton_block_sum_is_tritons_reduction_order(fma):
    from dsa_precision.exact_math import _pairwise_sum, _triton_block_sum

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=g) * 2.0 ** torch.randint(-12, 12, (6, 128), generator=g)
    sums = _triton_block_sum(x)[:, 0]
    squares = _triton_block_sum(x, squares_of=x, fma=fma)[:, 0]
    for i in range(6):
        assert sums[i].item() == _warp_sum(x[i].tolist(), squares=False, fma=fma)
        assert squares[i].item() == _warp_sum(x[i].tolist(), squares=True, fma=fma)
    assert not torch.equal(sums, _pairwise_sum(x)[:, 0])  # another order, other bits
    with pytest.raises(ValueError, match="128-wide"):
        _triton_block_sum(torch.ones(2, 64))


@pytest.mark.parametrize("fma", [False, True])
def test_layer_norm_fp32_ops_is_the_engines_float32_sequence(fma):
    """layer_norm_fp32_ops against the float32 operations written out (CPU rsqrt: 1 / sqrt)."""
    from dsa_precision.exact_math import (
        _triton_block_sum,
        fma_fp32,
        layer_norm_fp32,
        layer_norm_fp32_ops,
    )

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(64, 128, generator=g) * 3 + 1).to(torch.bfloat16).float()
    w = (1 + 0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    got = layer_norm_fp32_ops(x, w, b, 1e-6, fma=fma)
    mean = _triton_block_sum(x) / 128
    d = x - mean
    var = _triton_block_sum(d, squares_of=d, fma=fma) / 128
    root = torch.sqrt((var + torch.tensor(1e-6, dtype=torch.float32)).double()).float()  # IEEE
    y = d * (1 / root)
    want = fma_fp32(y, w.float(), b.float()) if fma else y * w.float() + b.float()
    assert torch.equal(got, want)
    exact = layer_norm_fp32(x, w, b, 1e-6)
    assert (got - exact).abs().max() < 1e-5 and not torch.equal(got, exact)


def _cuda_warp_layer_norm(values, w, b, eps, *, fma: bool, up: bool = False):
    """A simulation of SGLang 0.5.23's fused key LayerNorm over one 128-vector as its SASS reads
    (nvcc 13.0, sm_90a; docs/numerics.md, section 8.5): lane ``l`` holds elements ``4l .. 4l+3``;
    ``FADD`` from zero over them, ``SHFL.BFLY`` 16 ... 1; ``d = FFMA(sum, -2**-7, x)``; the
    squares ``FFMA(d, d, v)`` from zero; ``FFMA(var_sum, 2**-7, eps)``; ``MUFU.RSQ`` (here
    1 / sqrt, the CPU's); ``FFMA(gamma, FMUL(d, rstd), beta)``. ``fma=False``: each product and
    sum rounded. ``up``: the butterfly 1 ... 16 (FlashInfer 0.7.2's CuTe DSL LayerNorm, whose
    PTX for sm_90a has the same sequence with ``shfl.sync.bfly`` 1, 2, 4, 8, 16)."""
    from fractions import Fraction

    import numpy as np

    f = np.float32

    def fused(a, b, c):
        return f(_f32_exact(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))))

    def butterfly(lane):
        for m in (1, 2, 4, 8, 16) if up else (16, 8, 4, 2, 1):
            lane = [f(lane[i] + lane[i ^ m]) for i in range(32)]
        return lane[0]

    x = [f(v) for v in values]
    lanes = []
    for lane in range(32):
        s = f(0.0)
        for i in range(4):
            s = f(s + x[4 * lane + i])
        lanes.append(s)
    total = butterfly(lanes)
    d = [fused(total, f(-(2.0**-7)), v) for v in x]  # one rounding: total * 2**-7 is exact
    lanes = []
    for lane in range(32):
        v = f(0.0)
        for i in range(4):
            e = d[4 * lane + i]
            v = fused(e, e, v) if fma else f(v + f(e * e))
        lanes.append(v)
    var = butterfly(lanes)
    var_eps = fused(var, f(2.0**-7), f(eps)) if fma else f(f(var * f(2.0**-7)) + f(eps))
    rstd = f(1.0 / np.sqrt(var_eps, dtype=np.float32))
    return [
        float(fused(f(wi), f(di * rstd), f(bi)) if fma else f(f(f(di * rstd) * f(wi)) + f(bi)))
        for di, wi, bi in zip(d, w, b, strict=True)
    ]


@pytest.mark.parametrize("fma", [False, True])
def test_layer_norm_fp32_warp_up_is_flashinfers_kernel_sequence(fma):
    """butterfly_up: the same simulation with the lanes' steps 1 ... 16; other bits than 16 ... 1
    on some rows (the profile's "fp32-warp-up" is a rule of its own)."""
    from dsa_precision.exact_math import _layer_norm_fp32_warp, _warp_block_sum

    g = torch.Generator().manual_seed(9)
    x = torch.randn(24, 128, generator=g) * 2.0 ** torch.randint(-6, 6, (24, 128), generator=g)
    x = (x + 3).to(torch.bfloat16).float()
    w = (1 + 0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    got = _layer_norm_fp32_warp(x, w, b, 1e-6, fma=fma, butterfly_up=True)
    for i in range(x.shape[0]):
        want = _cuda_warp_layer_norm(
            x[i].tolist(), w.float().tolist(), b.float().tolist(), 1e-6, fma=fma, up=True
        )
        assert got[i].tolist() == want, i
    r = torch.randn(64, 128, generator=g)
    assert not torch.equal(_warp_block_sum(r, butterfly_up=True), _warp_block_sum(r))


@pytest.mark.parametrize("fma", [False, True])
def test_layer_norm_fp32_warp_is_sglangs_kernel_sequence(fma):
    """layer_norm_fp32_warp (and warp_block_sum) against the scalar simulation of SGLang's fused
    key kernel as compiled; a different order from Triton's tree (layer_norm_fp32_ops)."""
    from dsa_precision.exact_math import (
        _layer_norm_fp32_warp,
        _triton_block_sum,
        _warp_block_sum,
        layer_norm_fp32_ops,
    )

    g = torch.Generator().manual_seed(8)
    x = torch.randn(24, 128, generator=g) * 2.0 ** torch.randint(-6, 6, (24, 128), generator=g)
    x = (x + 3).to(torch.bfloat16).float()
    w = (1 + 0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    got = _layer_norm_fp32_warp(x, w, b, 1e-6, fma=fma)
    for i in range(x.shape[0]):
        want = _cuda_warp_layer_norm(
            x[i].tolist(), w.float().tolist(), b.float().tolist(), 1e-6, fma=fma
        )
        assert got[i].tolist() == want, i
    r = torch.randn(24, 128, generator=g)  # other orders, other bits
    assert not torch.equal(_warp_block_sum(r, squares_of=r), _triton_block_sum(r, squares_of=r))
    assert not torch.equal(got, layer_norm_fp32_ops(x, w, b, 1e-6, fma=fma))
    with pytest.raises(ValueError, match="128-wide"):
        _warp_block_sum(torch.ones(2, 64))


def test_rsqrt_fp32_on_the_cpu_is_the_ieee_root_and_division():
    """The interpreter's (numpy's) correctly rounded float32 root, then the IEEE division: the
    value torch's own float32 CPU sqrt misses by an ulp (torch 2.14, 98.84222412109375)."""
    import numpy as np

    from dsa_precision.exact_math import rsqrt_fp32

    x = torch.cat((torch.tensor([98.84222412109375]), torch.rand(20000) * 1000 + 1e-3))
    want = np.float32(1.0) / np.sqrt(x.numpy())
    assert np.array_equal(rsqrt_fp32(x).numpy(), want)
