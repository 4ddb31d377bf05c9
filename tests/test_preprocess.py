"""IndexerPreprocess: bit-identity with megatron-core's DSAIndexer, and the FP32 path."""

import itertools
import math

import pytest
import torch

from dsa_precision import IndexerPreprocess
from dsa_precision.hadamard import hadamard_transform, rotate_activation

from .megatron_utils import make_config, make_indexer

S, B = 24, 2


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _exact_hadamard_like_fast_hadamard(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Stand-in for the CUDA-only fast_hadamard_transform (absent here): a dense float64
    Sylvester product, rounded once to the input dtype."""
    h = _sylvester(x.shape[-1])
    return ((x.double() @ h) * scale).to(x.dtype)


def _projections(indexer, x, qr):
    s, b, _ = x.shape
    q, _ = indexer.linear_wq_b(qr)
    k, _ = indexer.linear_wk(x)
    return q.reshape(s, b, indexer.index_n_heads, indexer.index_head_dim), k


def _ours(indexer, config, rope_fp32=False):
    return IndexerPreprocess(
        indexer.index_head_dim,
        indexer.qk_pos_emb_head_dim,
        k_norm=indexer.k_norm,
        rope_interleaved=config.dsa_indexer_rope_interleaved,
        rotate_activation=config.dsa_indexer_rotate_activation,
        k_norm_fp32=config.dsa_indexer_k_norm_fp32,
        rope_fp32=rope_fp32,
    )


@pytest.mark.parametrize("rope_interleaved", [False, True], ids=["rotate_half", "rope_interleaved"])
@pytest.mark.parametrize("k_norm_fp32", [False, True], ids=["k_norm_bf16", "k_norm_fp32"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["no_hadamard", "hadamard"])
def test_bit_identical_to_megatron(
    megatron_parallel, cpu_rotary, monkeypatch, rope_interleaved, k_norm_fp32, hadamard
):
    from megatron.core.transformer.experimental_attention_variant import dsa

    calls = []

    def fake_fast_hadamard(x, scale):
        calls.append(x.dtype)
        return _exact_hadamard_like_fast_hadamard(x, scale)

    monkeypatch.setattr(dsa, "hadamard_transform", fake_fast_hadamard)
    config = make_config(
        dsa_indexer_rope_interleaved=rope_interleaved,
        dsa_indexer_k_norm_fp32=k_norm_fp32,
        dsa_indexer_rotate_activation=hadamard,
    )
    indexer = make_indexer(config)
    x = torch.randn(S, B, config.hidden_size, dtype=torch.bfloat16)
    qr = torch.randn(S, B, config.q_lora_rank, dtype=torch.bfloat16)
    with torch.no_grad():
        q_ref, k_ref, _ = indexer.forward_before_topk(x, qr)
        q_in, k_in = _projections(indexer, x, qr)
        freqs = indexer.rotary_pos_emb(S)
        q, k = _ours(indexer, config)(q_in, k_in, freqs)
    assert calls == ([torch.bfloat16] * 2 if hadamard else [])
    assert q.dtype == q_ref.dtype == torch.bfloat16 and k.dtype == k_ref.dtype
    assert torch.equal(q, q_ref)
    assert torch.equal(k, k_ref)


def test_bit_identical_with_bf16_norm_params(megatron_parallel, cpu_rotary):
    """Megatron's Float16Module casts the k_norm parameters to BF16 too."""
    config = make_config()
    indexer = make_indexer(config).to(torch.bfloat16)
    x = torch.randn(S, B, config.hidden_size, dtype=torch.bfloat16)
    qr = torch.randn(S, B, config.q_lora_rank, dtype=torch.bfloat16)
    with torch.no_grad():
        q_ref, k_ref, _ = indexer.forward_before_topk(x, qr)
        q, k = _ours(indexer, config)(*_projections(indexer, x, qr), indexer.rotary_pos_emb(S))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_bit_identical_packed_thd(megatron_parallel, cpu_rotary):
    from megatron.core.packed_seq_params import PackedSeqParams

    config = make_config()
    indexer = make_indexer(config)
    cu = torch.tensor([0, 7, 7, 20, 24], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13
    )
    x = torch.randn(24, 1, config.hidden_size, dtype=torch.bfloat16)
    qr = torch.randn(24, 1, config.q_lora_rank, dtype=torch.bfloat16)
    with torch.no_grad():
        q_ref, k_ref, _ = indexer.forward_before_topk(x, qr, packed_seq_params=params)
        freqs = indexer.rotary_pos_emb(13, packed_seq=True)
        q, k = _ours(indexer, config)(*_projections(indexer, x, qr), freqs, cu_seqlens=cu)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def _float64_pipeline(q_in, k_in, norm, freqs, *, rotate):
    """Independent float64 evaluation of LayerNorm -> RoPE (rotate-half) -> Hadamard."""
    k = k_in.double()
    mu = k.mean(-1, keepdim=True)
    var = ((k - mu) ** 2).mean(-1, keepdim=True)
    k = (k - mu) / torch.sqrt(var + norm.eps) * norm.weight.double() + norm.bias.double()

    def rope(t):
        r = freqs.shape[-1]
        pe, rest = t[..., :r], t[..., r:]
        x1, x2 = pe.chunk(2, -1)
        c, s = torch.cos(freqs.double()), torch.sin(freqs.double())
        return torch.cat((pe * c + torch.cat((-x2, x1), -1) * s, rest), -1)

    q = rope(q_in.double())
    k = rope(k.unsqueeze(2)).squeeze(2)
    if rotate:
        h = _sylvester(128) / math.sqrt(128)
        q, k = q @ h, k @ h
    return q, k


@pytest.mark.parametrize("hadamard", [False, True])
def test_rope_fp32_has_no_bf16_rounding(hadamard):
    """The literal all-FP32 contract (vllm-exact): nothing rounded to BF16 after the projections."""
    pre = IndexerPreprocess(
        128, 64, rotate_activation=hadamard, rope_fp32=True, engine="vllm-exact"
    )
    with torch.no_grad():
        pre.k_norm.weight.normal_(1.0, 0.2)
        pre.k_norm.bias.normal_(0.0, 0.2)
        pre.k_norm.to(torch.bfloat16)  # as in training: BF16 parameters
    q_in = torch.randn(S, B, 8, 128).to(torch.bfloat16)
    k_in = torch.randn(S, B, 128).to(torch.bfloat16)
    pos = torch.arange(S, dtype=torch.float32)
    inv = 10000 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    freqs = torch.cat([torch.outer(pos, inv)] * 2, -1).view(S, 1, 1, 64)
    with torch.no_grad():
        q, k = pre(q_in, k_in, freqs)
        q_bf, k_bf = IndexerPreprocess(128, 64, k_norm=pre.k_norm, rotate_activation=hadamard)(
            q_in, k_in, freqs
        )
    assert q.dtype == k.dtype == torch.float32
    assert q_bf.dtype == k_bf.dtype == torch.bfloat16
    q64, k64 = _float64_pipeline(q_in, k_in, pre.k_norm, freqs, rotate=hadamard)
    # FP32 end to end: errors at float32 rounding level, far below one BF16 ulp (2**-8).
    assert (q.double() - q64).abs().max() <= 1e-5 * q64.abs().max()
    assert (k.double() - k64).abs().max() <= 1e-5 * k64.abs().max()
    assert (k_bf.double() - k64).abs().max() > 1e-3 * k64.abs().max()
    # The FP32 outputs are not BF16 values in disguise.
    assert (k != k.to(torch.bfloat16).float()).float().mean() > 0.9


@pytest.mark.parametrize("engine", ["vllm-exact", "vllm", "lmdeploy"])
def test_rope_fp32_is_differentiable_into_bf16_params(engine):
    """Every rope_fp32 path, the engines' float32 LayerNorm and fused multiply-adds included."""
    pre = IndexerPreprocess(128, 64, rope_fp32=True, rotate_activation=True, engine=engine)
    pre.k_norm.to(torch.bfloat16)
    q_in = torch.randn(4, 1, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    k_in = torch.randn(4, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 64)
    q, k = pre(q_in, k_in, freqs)
    (q.sum() + (k * k).sum()).backward()
    assert q_in.grad.dtype == torch.bfloat16 and k_in.grad is not None
    assert pre.k_norm.weight.grad is not None and pre.k_norm.weight.grad.dtype == torch.bfloat16


def test_hadamard_matches_dense_float64_and_is_orthogonal():
    x = torch.randn(50, 128)
    y = hadamard_transform(x, torch.float32)
    dense = (x.double() @ _sylvester(128)) / math.sqrt(128)
    assert torch.equal(y, dense.float())  # exact sums, one rounding: the same bits
    back = hadamard_transform(y, torch.float64)
    assert torch.allclose(back, x.double(), atol=1e-6)
    xb = x.to(torch.bfloat16)
    assert torch.equal(
        rotate_activation(xb, fp32=False), _exact_hadamard_like_fast_hadamard(xb, 128**-0.5)
    )
    with pytest.raises(TypeError, match="float32"):
        rotate_activation(xb, fp32=True)


@pytest.mark.parametrize(
    "q_shape, k_shape, match",
    [
        ((4, 1, 8, 128), (4, 1, 64), "does not match"),
        ((4, 1, 8, 128), (5, 1, 128), "does not match"),
        ((4, 8, 128), (4, 1, 128), r"q must be \[s, b, h, d\]"),
    ],
)
def test_bad_shapes(q_shape, k_shape, match):
    pre = IndexerPreprocess(128, 64)
    with pytest.raises(ValueError, match=match):
        pre(torch.randn(q_shape), torch.randn(k_shape), torch.rand(4, 1, 1, 64))


def test_bad_construction():
    with pytest.raises(ValueError, match="rope_dim"):
        IndexerPreprocess(128, 130)
    with pytest.raises(TypeError, match="rope_fp32 must be a bool"):
        IndexerPreprocess(128, 64, rope_fp32="yes")
    pre = IndexerPreprocess(128, 64, k_norm=torch.nn.RMSNorm(128), rope_fp32=True)
    with pytest.raises(TypeError, match="RMSNorm"):
        pre(torch.randn(2, 1, 4, 128), torch.randn(2, 1, 128), torch.rand(2, 1, 1, 64))


def _python_pairwise(values: list[float]) -> float:
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def test_pairwise_sum_has_a_fixed_order():
    from dsa_precision.exact_math import pairwise_sum

    x = torch.randn(6, 128, dtype=torch.float64) * torch.logspace(-30, 30, 128, dtype=torch.float64)
    got = pairwise_sum(x)[:, 0].tolist()
    assert got == [_python_pairwise(row) for row in x.tolist()]
    # An order-dependent sum: the tree cancels 1 - 1 first, so the tiny term survives.
    v = torch.zeros(128, dtype=torch.float64)
    v[0], v[1], v[2] = 1.0, -1.0, 2.0**-60
    assert pairwise_sum(v).item() == 2.0**-60


def test_layer_norm_fp32_is_layout_independent():
    from dsa_precision.preprocess import layer_norm_fp32

    k = (torch.randn(64, 3, 128) * torch.logspace(-12, 2, 128)).to(torch.bfloat16)
    w, b = torch.randn(128).to(torch.bfloat16), torch.randn(128).to(torch.bfloat16)
    contiguous = layer_norm_fp32(k, w, b, 1e-6)
    strided = layer_norm_fp32(k.transpose(0, 1).contiguous().transpose(0, 1), w, b, 1e-6)
    one_row = torch.stack([layer_norm_fp32(k[i], w, b, 1e-6) for i in range(k.shape[0])])
    assert torch.equal(contiguous, strided) and torch.equal(contiguous, one_row)


# ------------------------------------------------- the engines' float32 arithmetic (rope_fp32)


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
    from dsa_precision.exact_math import pairwise_sum, triton_block_sum

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=g) * 2.0 ** torch.randint(-12, 12, (6, 128), generator=g)
    sums = triton_block_sum(x)[:, 0]
    squares = triton_block_sum(x, squares_of=x, fma=fma)[:, 0]
    for i in range(6):
        assert sums[i].item() == _warp_sum(x[i].tolist(), squares=False, fma=fma)
        assert squares[i].item() == _warp_sum(x[i].tolist(), squares=True, fma=fma)
    assert not torch.equal(sums, pairwise_sum(x)[:, 0])  # another order, other bits
    with pytest.raises(ValueError, match="128-wide"):
        triton_block_sum(torch.ones(2, 64))


@pytest.mark.parametrize("fma", [False, True])
def test_layer_norm_fp32_ops_is_the_engines_float32_sequence(fma):
    """layer_norm_fp32_ops against the float32 operations written out (CPU rsqrt: 1 / sqrt)."""
    from dsa_precision.exact_math import (
        fma_fp32,
        layer_norm_fp32,
        layer_norm_fp32_ops,
        triton_block_sum,
    )

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(64, 128, generator=g) * 3 + 1).to(torch.bfloat16).float()
    w = (1 + 0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    got = layer_norm_fp32_ops(x, w, b, 1e-6, fma=fma)
    mean = triton_block_sum(x) / 128
    d = x - mean
    var = triton_block_sum(d, squares_of=d, fma=fma) / 128
    y = d * (1 / torch.sqrt(var + torch.tensor(1e-6, dtype=torch.float32)))
    want = fma_fp32(y, w.float(), b.float()) if fma else y * w.float() + b.float()
    assert torch.equal(got, want)
    exact = layer_norm_fp32(x, w, b, 1e-6)
    assert (got - exact).abs().max() < 1e-5 and not torch.equal(got, exact)


def test_rope_fp32_with_another_k_norm_eps_than_the_engine_is_a_configuration_error():
    norm = torch.nn.LayerNorm(128, eps=1e-5)  # Megatron's default layernorm_epsilon
    with pytest.raises(ValueError, match=r"epsilon 1e-06 .* eps=1e-05"):
        IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine="vllm")
    IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine="vllm-exact")  # any eps
    IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=False, engine="vllm")  # Megatron's path


def test_hot_path_constants_are_built_once(monkeypatch):
    """The float32 LayerNorm epsilon, the float32 Hadamard constant and the log2 UE8M0 band are
    device constants built once, not a ``torch.tensor(..., device=...)`` per call (on CUDA a
    blocking host-to-device copy: a host synchronisation on every forward)."""
    from dsa_precision.engines import Fp8Rule
    from dsa_precision.hadamard import hadamard_transform
    from dsa_precision.preprocess import layer_norm_fp32_ops
    from dsa_precision.quantize import fp8_descale

    x = torch.randn(4, 128)
    rule = Fp8Rule(scale_ratio="divide", ue8m0_ceil="log2")
    amax = x.abs().amax(-1)

    def run():
        return (
            layer_norm_fp32_ops(x, None, None, 1e-6, fma=False),
            hadamard_transform(x, torch.float32, scale_fp32=True),
            fp8_descale(amax, rule),
        )

    first = run()
    built = []
    real = torch.tensor

    def counting(*args, **kwargs):
        built.append(args[:1])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    again = run()
    assert built == []
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_device_constant_made_in_inference_mode_serves_backward():
    """A cached constant first built under inference mode is a normal tensor: a later training
    step can save it for backward (the float32 Hadamard scale multiplies a tensor with grad)."""
    from dsa_precision.hadamard import hadamard_transform

    with torch.inference_mode():
        hadamard_transform(torch.randn(2, 64), torch.float32, scale_fp32=True)
    x = torch.randn(2, 64, requires_grad=True)
    hadamard_transform(x, torch.float32, scale_fp32=True).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


# ------------------------------------------------------------- packed (THD) per-token angles


def _positions_reference(cu: list[int]) -> list[int]:
    return [t - a for a, b in itertools.pairwise(cu) for t in range(a, b)]


@pytest.mark.parametrize("cu", [[0, 5], [0, 3, 3, 10], [0, 1, 2, 3, 4], [0, 7, 8, 16]])
def test_thd_token_freqs_restarts_positions_per_sequence(cu):
    from dsa_precision.preprocess import thd_token_freqs

    freqs = torch.randn(9, 1, 1, 8)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    want = freqs[_positions_reference(cu)] if longest <= 9 else None
    for total in (None, cu[-1]):
        if want is None:
            with pytest.raises(ValueError, match="freqs covers 9 positions but a packed sequence"):
                thd_token_freqs(freqs, cu_t, total)
            continue
        got = thd_token_freqs(freqs, cu_t, total)
        assert torch.equal(got, want), (cu, total)
    table = torch.randn(cu[-1], 1, 1, 8)  # one row per packed token: used as is
    assert thd_token_freqs(table, cu_t, cu[-1]) is table


def test_thd_token_freqs_checks_host_lengths_against_the_rows():
    from dsa_precision.preprocess import thd_token_freqs

    freqs = torch.randn(8, 1, 1, 8)
    with pytest.raises(ValueError, match=r"packs 6 tokens but the input has 7 packed rows"):
        thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 7)
    # more packed tokens than rows (a padded tail past the input): the first rows' angles
    assert torch.equal(thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 3), freqs[[0, 1, 0]])
    with pytest.raises(ValueError, match="total=-1 must be a positive integer"):
        thd_token_freqs(freqs, torch.tensor([0, 2]), -1)


def test_packed_preprocess_reads_the_rows_from_q_not_cu_seqlens():
    """The preprocessing passes q's row count, so cu_seqlens is never read for it."""
    from dsa_precision.preprocess import IndexerPreprocess

    pre = IndexerPreprocess(head_dim=64, rope_dim=16, k_norm=torch.nn.LayerNorm(64))
    q, k = torch.randn(6, 1, 2, 64), torch.randn(6, 1, 64)
    freqs = torch.randn(4, 1, 1, 16)
    out = pre(q, k, freqs, cu_seqlens=torch.tensor([0, 4, 6], dtype=torch.int32))
    assert out[0].shape == q.shape
    with pytest.raises(ValueError, match="packs 5 tokens but the input has 6 packed rows"):
        pre(q, k, freqs, cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32))


def test_thd_token_freqs_of_no_rows_and_a_models_own_rope_with_padded_rows():
    from dsa_precision.preprocess import IndexerPreprocess, thd_token_freqs

    freqs = torch.randn(4, 1, 1, 16)
    assert thd_token_freqs(freqs, torch.tensor([0]), 0).shape == (0, 1, 1, 16)
    # A model's own RoPE (rope_fn) takes freqs and cu_seqlens itself: rows past cu_seqlens[-1]
    # (padding) are its business, no per-token table is built.
    seen = []

    def rope_fn(x, f, mscale, cu):
        seen.append(cu.tolist())
        return x

    pre = IndexerPreprocess(
        head_dim=64, rope_dim=16, k_norm=torch.nn.LayerNorm(64), rope_fn=rope_fn
    )
    q, k = torch.randn(6, 1, 2, 64), torch.randn(6, 1, 64)
    pre(q, k, freqs, cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32))
    assert seen == [[0, 4, 5], [0, 4, 5]]
