"""IndexerPreprocess: bit-identity with megatron-core's DSAIndexer, and the FP32 path."""

import math

import pytest
import torch

from dsa_precision import IndexerPreprocess

from .support.helpers import exact_hadamard_like_fast_hadamard, sylvester
from .support.megatron import make_config, make_indexer

S, B = 24, 2


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
        return exact_hadamard_like_fast_hadamard(x, scale)

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
        h = sylvester(128) / math.sqrt(128)
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


# ------------------------------------------------- the engines' float32 arithmetic (rope_fp32)


def test_rope_fp32_with_another_k_norm_eps_than_the_engine_is_a_configuration_error():
    norm = torch.nn.LayerNorm(128, eps=1e-5)  # Megatron's default layernorm_epsilon
    with pytest.raises(ValueError, match=r"epsilon 1e-06 .* eps=1e-05"):
        IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine="vllm")
    IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine="vllm-exact")  # any eps
    IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=False, engine="vllm")  # Megatron's path


# ------------------------------------------------------------- packed (THD) per-token angles


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
