"""Built-in sparse MLA attention against a dense masked-attention reference (values, gradients)."""

import pytest
import torch

from dsa_precision import sparse_attention as sa


def dense_reference(q, kv, idx, scale, d_v):
    """float64 softmax attention over a dense mask built from idx."""
    t = q.shape[0]
    mask = torch.zeros(t, kv.shape[0], dtype=torch.bool)
    for r in range(t):
        valid = idx[r][idx[r] >= 0].long()
        mask[r, valid] = True
    s = torch.einsum("thd,kd->thk", q.double(), kv.double()) * scale
    s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("thk,kv->thv", p, kv[:, :d_v].double())


def _case(t=33, tk=40, h=4, d=72, d_v=64, k=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    kv = torch.randn(tk, d, generator=g).to(torch.bfloat16)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for r in range(t):
        n = min(k, 1 + r % (k + 3))  # some rows short, causal-like
        idx[r, :n] = torch.randperm(tk, generator=g)[:n].sort().values.int()
    idx[5] = -1  # an empty row: zero output, zero gradient
    return q, kv, idx, d_v


def test_forward_matches_dense_reference():
    q, kv, idx, d_v = _case()
    out = sa.sparse_mla_attention(q, kv, idx, 0.125, d_v)
    ref = dense_reference(q, kv, idx, 0.125, d_v)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 4, d_v)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert torch.all(out[5] == 0)


def test_gradients_match_dense_reference():
    q, kv, idx, d_v = _case()
    qf = q.double().requires_grad_()
    kvf = kv.double().requires_grad_()
    dense_reference(qf, kvf, idx, 0.125, d_v).pow(2).sum().backward()
    q2 = q.clone().requires_grad_()
    kv2 = kv.clone().requires_grad_()
    out = sa.sparse_mla_attention(q2, kv2, idx, 0.125, d_v)
    # Same upstream gradient as the reference: d/d out of sum(out_ref**2) = 2 * out_ref.
    ref_out = dense_reference(q, kv, idx, 0.125, d_v)
    out.backward((2 * ref_out).to(out.dtype))
    for got, want in ((q2.grad, qf.grad), (kv2.grad, kvf.grad)):
        scale = want.abs().max()
        assert (got.double() - want).abs().max() <= 3e-2 * scale
    assert torch.all(q2.grad[5] == 0)


def test_chunked_builtin_is_chunk_invariant(monkeypatch):
    q, kv, idx, d_v = _case(t=50)
    full = sa._builtin_forward(q, kv, idx, 0.1, d_v)
    monkeypatch.setattr(sa, "_BUILTIN_CHUNK_BYTES", 1)
    small = sa._builtin_forward(q, kv, idx, 0.1, d_v)
    assert torch.equal(full[0], small[0]) and torch.equal(full[1], small[1])


def test_flash_mla_adapter_pads_heads_and_topk():
    """FlashMLA is absent here: a recording stand-in checks the padded shapes it would get."""
    q, kv, idx, d_v = _case(h=16, d=576, d_v=512, k=256, t=8, tk=16)
    seen = {}

    def fake_fwd(qq, kk, ii, scale, d_v):
        seen.update(
            q=tuple(qq.shape), kv=tuple(kk.shape), idx=tuple(ii.shape), dtype=qq.dtype, d_v=d_v
        )
        out, lse = sa._builtin_forward(qq, kk[:, 0], ii[:, 0], scale, d_v)
        return out, None, lse

    out, lse = sa._flash_mla_forward(fake_fwd, q, kv, idx, 0.05, d_v)
    assert seen == dict(
        q=(8, 64, 576), kv=(16, 1, 576), idx=(8, 1, 512), dtype=torch.bfloat16, d_v=512
    )
    ref_out, ref_lse = sa._builtin_forward(q, kv, idx, 0.05, d_v)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_bad_shapes():
    q, kv, idx, d_v = _case()
    with pytest.raises(ValueError, match="expected q"):
        sa.sparse_mla_attention(q[0], kv, idx, 0.1, d_v)
    with pytest.raises(ValueError, match="d_v"):
        sa.sparse_mla_attention(q, kv, idx, 0.1, 1000)
