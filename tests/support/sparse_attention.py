"""Sparse MLA attention over the indexer's top-k keys (absorbed layout, one shared KV head).

``out[t, h] = softmax_k(scale * q[t, h] . kv[idx[t, k]]) @ kv[idx[t, k], :d_v]`` over the valid
entries of ``idx[t]`` (``-1`` marks padding). Layouts are flat, as FlashMLA and cuDNN take them:
``q`` ``(T, H, D)``, ``kv`` ``(T_k, D)`` (keys and values share storage; values are the first
``d_v`` channels), ``idx`` ``(T, K)`` int32 global row indices into ``kv``.

Kernels, in order of preference:

- forward: FlashMLA's ``flash_mla_sparse_fwd`` when importable (CUDA, SM90+), else the built-in
  implementation below (torch, FP32 softmax, any device);
- backward: cuDNN's ``sparse_attention_backward_wrapper`` on SM90 when nvidia-cudnn-frontend is
  importable, else the built-in implementation. cuDNN's SM90 backward accumulates the key/value
  gradient with atomics, so its bits can differ between runs; under
  ``torch.use_deterministic_algorithms(True)`` the built-in backward (a sorted, deterministic
  ``index_put_`` accumulation) is used instead.

The built-in forward and backward recompute per row chunk from ``(q, kv, idx, lse)``, so memory
stays ``O(chunk * K * D)``; they are checked against a dense masked-attention reference.

Test support, not part of the installed package: the attention of :mod:`.fused_attention`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dsa_precision.backends import cudnn
from dsa_precision.checks import (
    _check_int_tensor,
    _check_positive_int,
    _check_real,
    _check_same_device,
    _check_tensor,
)

__all__ = ["SparseMLAAttentionFunc", "sparse_backward", "sparse_forward", "sparse_mla_attention"]

# Rows per built-in chunk are bounded so the gathered keys stay under this many bytes.
_BUILTIN_CHUNK_BYTES = 256 << 20
# FlashMLA's SM90 sparse prefill kernel packs 64 query heads and top-k in multiples of 512 (as
# megatron-core 0.19's adapter pads them).
_FLASH_MLA_HEAD_ALIGN = 64
_FLASH_MLA_TOPK_ALIGN = 512
# cuDNN's SM90 sparse-attention backward packs 64 query heads.
_CUDNN_BWD_HEAD_ALIGN = 64


@functools.cache
def _flash_mla_sparse_fwd():
    try:
        from flash_mla import flash_mla_sparse_fwd
    except ImportError:
        return None
    return flash_mla_sparse_fwd


def _rows_per_chunk(k: int, d: int, h: int) -> int:
    return max(1, _BUILTIN_CHUNK_BYTES // max(1, k * (4 * d + 8 * h)))


def _pad_heads(x: torch.Tensor, heads: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    pad = x.new_full((x.shape[0], heads - x.shape[1], *x.shape[2:]), value)
    return torch.cat((x, pad), dim=1)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _gather_keys(kv: torch.Tensor, sel: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float32 ``kv`` rows of the picks ``sel`` ``(r, K)``, zero at padding (``-1``): a padding
    slot reads no key, so a non-finite key reaches only the rows that selected it."""
    rows = kv[sel.clamp_min(0)].float()
    return rows.masked_fill_(~valid.unsqueeze(-1), 0.0)


def _probabilities(s: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities ``exp(s - lse)`` ``(r, H, K)``, exactly 0 at padding.

    Only padding is zeroed: a row with no valid key (``lse = -inf``) has probability 0
    everywhere, but a NaN score (a NaN query or selected key) stays NaN, so NaN in gives NaN
    out and NaN gradients, never a finite zero (docs/robustness.md, "Non-finite data").
    """
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.where(valid.unsqueeze(1), p, torch.zeros((), dtype=p.dtype, device=p.device))


def _builtin_forward(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = q.shape
    out = torch.empty(t, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(idx.shape[1], d, h)
    for r0 in range(0, t, step):
        rows = slice(r0, min(r0 + step, t))
        sel = idx[rows].long()
        valid = sel >= 0
        kv_sel = _gather_keys(kv, sel, valid)  # (r, K, D)
        s = torch.einsum("rhd,rkd->rhk", q[rows].float(), kv_sel) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # -inf for a row without valid keys
        p = _probabilities(s, row_lse, valid)
        out[rows] = torch.einsum("rhk,rkv->rhv", p, kv_sel[..., :d_v]).to(q.dtype)
        lse[rows] = row_lse
    return out, lse


def _builtin_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = q.shape
    d_v = out.shape[-1]
    dq = torch.empty_like(q)
    # FP32 accumulator for the key/value gradient; index_put_ with accumulate=True has a
    # deterministic kernel under torch.use_deterministic_algorithms(True).
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    step = _rows_per_chunk(idx.shape[1], d, h)
    for r0 in range(0, t, step):
        rows = slice(r0, min(r0 + step, t))
        sel = idx[rows].long()
        valid = sel >= 0
        safe = sel.clamp_min(0)
        kv_sel = _gather_keys(kv, sel, valid)
        qf, do = q[rows].float(), dout[rows].float()
        s = torch.einsum("rhd,rkd->rhk", qf, kv_sel) * scale
        p = _probabilities(s, lse[rows], valid)
        dp = torch.einsum("rhv,rkv->rhk", do, kv_sel[..., :d_v])
        delta = (do * out[rows].float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[rows] = torch.einsum("rhk,rkd->rhd", ds, kv_sel).to(q.dtype)
        dkv_sel = torch.einsum("rhk,rhd->rkd", ds, qf)
        dkv_sel[..., :d_v] += torch.einsum("rhk,rhv->rkv", p, do)
        dkv_sel = dkv_sel.masked_fill_(~valid.unsqueeze(-1), 0.0)
        dkv.index_put_((safe.reshape(-1),), dkv_sel.reshape(-1, d), accumulate=True)
    return dq, dkv.to(kv.dtype)


def _flash_mla_forward(
    fwd: Any, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill: heads padded to 64, top-k padded to 512 with -1."""
    h = q.shape[1]
    heads = _aligned(h, _FLASH_MLA_HEAD_ALIGN)
    k_pad = _aligned(idx.shape[1], _FLASH_MLA_TOPK_ALIGN)
    idx_p = torch.nn.functional.pad(idx, (0, k_pad - idx.shape[1]), value=-1)
    out, _max_logits, lse = fwd(
        _pad_heads(q, heads).contiguous(),
        kv.unsqueeze(1).contiguous(),
        idx_p.unsqueeze(1).contiguous(),
        scale,
        d_v=d_v,
    )
    return out[:, :h].contiguous(), lse[:, :h].float().contiguous()


def _cudnn_backward_usable(q: torch.Tensor) -> bool:
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return cudnn.dsa_available()


def _cudnn_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN SM90 sparse-attention backward on compacted rows (heads padded to 64)."""
    h = q.shape[1]
    heads = _aligned(h, _CUDNN_BWD_HEAD_ALIGN)
    length = (idx >= 0).sum(-1).to(torch.int32)
    rows = torch.nonzero(length > 0).flatten()
    sink = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    with cudnn._device_scope(q.device):
        res = cudnn.dsa().sparse_attention_backward_wrapper(
            _pad_heads(q, heads).index_select(0, rows).contiguous(),
            kv.contiguous(),
            _pad_heads(out, heads).index_select(0, rows).contiguous(),
            _pad_heads(dout, heads).index_select(0, rows).contiguous(),
            _pad_heads(lse, heads).index_select(0, rows).contiguous(),
            sink,
            idx.clamp_min(0).index_select(0, rows).to(torch.int32).contiguous(),
            softmax_scale=scale,
            topk_length=length.index_select(0, rows).contiguous(),
        )
    dq = torch.zeros_like(q)
    dq.index_copy_(0, rows, res["dq"][:, :h].to(q.dtype))
    return dq, res["dkv"].to(kv.dtype)


def sparse_forward(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, softmax_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (T, H, d_v), lse (T, H) float32)``: FlashMLA when importable, else built-in."""
    fwd = _flash_mla_sparse_fwd() if q.is_cuda else None
    if fwd is not None:
        return _flash_mla_forward(fwd, q, kv, idx, softmax_scale, d_v)
    return _builtin_forward(q, kv, idx, softmax_scale, d_v)


def sparse_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dkv)``: cuDNN's SM90 kernel when usable and determinism is not requested, else
    built-in."""
    dout = dout.contiguous()
    if _cudnn_backward_usable(q) and not torch.are_deterministic_algorithms_enabled():
        return _cudnn_backward(q, kv, idx, out, lse, dout, softmax_scale)
    return _builtin_backward(q, kv, idx, out, lse, dout, softmax_scale)


class SparseMLAAttentionFunc(torch.autograd.Function):
    """Sparse MLA attention; differentiable in ``q`` and ``kv``.

    Forward inputs: ``q`` (T, H, D) bf16, ``kv`` (T_k, D) bf16, ``idx`` (T, K) int32 (-1 padded),
    ``softmax_scale`` float, ``d_v`` int. Output: (T, H, d_v) in ``q``'s dtype.
    """

    @staticmethod
    def forward(ctx, q, kv, idx, softmax_scale, d_v):
        out, lse = sparse_forward(q, kv, idx, softmax_scale, d_v)
        ctx.mark_non_differentiable(lse)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.softmax_scale = softmax_scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, kv, idx, out, lse = ctx.saved_tensors
        dq, dkv = sparse_backward(q, kv, idx, out, lse, dout, ctx.softmax_scale)
        # Slots: q, kv, idx, softmax_scale, d_v.
        return dq, dkv, None, None, None


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, softmax_scale: float, d_v: int
) -> torch.Tensor:
    """Sparse MLA attention (see the module docstring); returns ``(T, H, d_v)``.

    A NaN or Inf in a query head gives that row and head a NaN output (and NaN gradients); one in
    a selected key gives every row that selected it NaN; a padding slot reads no key.
    """
    for name, t in (("q", q), ("kv", kv), ("idx", idx)):
        _check_tensor(name, t)
    if q.ndim != 3 or kv.ndim != 2 or idx.ndim != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(
            "expected q (T, H, D), kv (T_k, D) and idx (T, K); got "
            f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, idx {tuple(idx.shape)}."
        )
    _check_int_tensor("idx", idx, ndim=2)
    _check_same_device(q=q, kv=kv, idx=idx)
    d_v = _check_positive_int("d_v", d_v)
    softmax_scale = _check_real("softmax_scale", softmax_scale)
    if kv.shape[-1] != q.shape[-1] or not 0 < d_v <= kv.shape[-1]:
        raise ValueError(
            f"q and kv widths must match ({q.shape[-1]} vs {kv.shape[-1]}) and 0 < d_v <= width; "
            f"got d_v={d_v}."
        )
    out, _ = SparseMLAAttentionFunc.apply(q, kv, idx, softmax_scale, d_v)
    return out
