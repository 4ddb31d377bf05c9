"""Built-in sparse MLA attention against a dense masked-attention reference (values, gradients)."""

import pytest
import torch

from .support import sparse_attention as sa


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


@pytest.mark.parametrize("d_v, scale, exc, pattern", [
    (2.5, 0.1, ValueError, "d_v=2.5 must be a positive integer"),
    (64.0, 0.1, ValueError, "d_v=64.0 must be a positive integer"),
    (64, "0.1", TypeError, r"softmax_scale='0.1' \(str\) must be a real number"),
])  # fmt: skip
def test_loose_numbers_are_refused(d_v, scale, exc, pattern):
    """``int(2.5)`` used to truncate d_v silently; a string scale failed deep inside torch."""
    q, kv, idx, _ = _case()
    with pytest.raises(exc, match=pattern):
        sa.sparse_mla_attention(q, kv, idx, scale, d_v)


# ------------------------------------------------- non-finite data: NaN in gives NaN out


def _forward_backward(q, kv, idx, d_v, dout):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = sa.sparse_mla_attention(q, kv, idx, 0.125, d_v)
    out.backward(dout)
    return out.detach(), q.grad, kv.grad


def _selected_by(idx, row):
    return idx[row][idx[row] >= 0].long()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_query_gives_nan_output_and_gradients(bad):
    """A NaN (or Inf) query head: that (row, head) outputs NaN and gets a NaN gradient, and the
    keys the row selected get NaN gradients, never a finite zero; every other row and head is
    bit for bit the clean run's."""
    q, kv, idx, d_v = _case()
    dout = torch.randn(q.shape[0], q.shape[1], d_v, generator=torch.Generator().manual_seed(1))
    dout = dout.to(torch.bfloat16)
    clean = _forward_backward(q, kv, idx, d_v, dout)
    row, head = 7, 2
    q_bad = q.clone()
    q_bad[row, head, 3] = bad
    out, dq, dkv = _forward_backward(q_bad, kv, idx, d_v, dout)
    assert torch.isnan(out[row, head]).all()
    assert torch.isnan(dq[row, head]).all()
    keys = _selected_by(idx, row)
    assert torch.isnan(dkv[keys]).all(-1).all()
    others = torch.ones(q.shape[:2], dtype=torch.bool)
    others[row, head] = False
    assert torch.equal(out[others], clean[0][others])
    other_rows = torch.arange(q.shape[0]) != row
    assert torch.equal(dq[other_rows], clean[1][other_rows])
    untouched = torch.ones(kv.shape[0], dtype=torch.bool)
    untouched[keys] = False
    assert torch.equal(dkv[untouched], clean[2][untouched])


def test_non_finite_key_reaches_only_the_rows_that_selected_it():
    """A NaN key: every row that selected it outputs NaN; a row that did not (padding slots
    included: they read no key, and key 0 is what padding used to read) is unchanged."""
    q, kv, idx, d_v = _case()
    dout = torch.ones(q.shape[0], q.shape[1], d_v, dtype=torch.bfloat16)
    clean = _forward_backward(q, kv, idx, d_v, dout)
    kv_bad = kv.clone()
    kv_bad[0, 5] = float("nan")
    out, dq, _ = _forward_backward(q, kv_bad, idx, d_v, dout)
    chose = (idx == 0).any(-1)
    assert chose.any() and (~chose & (idx < 0).any(-1)).any()  # both kinds of rows exist
    assert torch.isnan(out[chose]).all() and torch.isnan(dq[chose]).all()
    assert torch.equal(out[~chose], clean[0][~chose])
    assert torch.equal(dq[~chose], clean[1][~chose])


def test_a_row_without_keys_is_zero_not_nan():
    """The one case that is finite by definition: a row that selects nothing (all ``-1``)
    outputs 0 with a zero gradient, also when key 0 is NaN."""
    q, kv, idx, d_v = _case()
    kv = kv.clone()
    kv[0] = float("nan")
    out, dq, _ = _forward_backward(q, kv, idx, d_v, torch.ones(q.shape[0], q.shape[1], d_v))
    assert torch.all(out[5] == 0) and torch.all(dq[5] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_non_finite_query_stays_non_finite_on_the_gpu_kernels():
    """FlashMLA's forward and cuDNN's backward (when present; else the built-in on CUDA) keep a
    NaN query row NaN, as the built-in implementation does."""
    q, kv, idx, d_v = _case(h=64, d=576, d_v=512, k=64, t=32, tk=64)
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    q[7, 2, 3] = float("nan")
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out = sa.sparse_mla_attention(q, kv, idx, 0.05, d_v)
    out.backward(torch.ones_like(out))
    assert torch.isnan(out[7, 2]).all() and torch.isnan(q.grad[7, 2]).all()
    assert torch.isfinite(out[8]).all()


def test_indices_must_be_integers_on_the_same_device():
    q, kv, idx, d_v = _case()
    with pytest.raises(TypeError, match=r"idx has dtype torch\.float32; expected int32 or int64"):
        sa.sparse_mla_attention(q, kv, idx.float(), 0.1, d_v)
    with pytest.raises(ValueError, match=r"different devices \(q on cpu, kv on cpu, idx on meta"):
        sa.sparse_mla_attention(q, kv, idx.to("meta"), 0.1, d_v)
