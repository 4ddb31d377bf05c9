"""IndexerPreprocess: bit-identity with megatron-core's DSAIndexer, and the FP32 path."""

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
    pre = IndexerPreprocess(128, 64, rotate_activation=hadamard, rope_fp32=True)
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


def test_rope_fp32_is_differentiable_into_bf16_params():
    pre = IndexerPreprocess(128, 64, rope_fp32=True, rotate_activation=True)
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
    from dsa_precision.preprocess import pairwise_sum

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
