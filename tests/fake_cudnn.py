"""A recording stand-in for ``cudnn.DSA`` on machines without an SM90 GPU.

It checks what the package passes to the kernels (dtypes, shapes, precision, scales, offsets)
and answers with a float64 evaluation of the kernels' documented math, so the code around the
launch can run. The real kernels are covered by the ``gpu`` tests.
"""

from __future__ import annotations

import torch


class FakeDSA:
    def __init__(self):
        self.forward_calls: list[dict] = []
        self.topk_calls: list[dict] = []

    # (B, S_q, H, 128) | THD (T, H, 128)
    def indexer_forward_wrapper(
        self,
        q,
        k,
        w,
        ratio=4,
        sm_scale=1.0,
        *,
        q_causal_offsets=None,
        precision="bf16",
        q_scale=None,
        k_scale=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
    ):
        thd = cu_seqlens_q is not None
        call = dict(
            q_dtype=q.dtype,
            k_dtype=k.dtype,
            w_dtype=w.dtype,
            precision=precision,
            sm_scale=sm_scale,
            ratio=ratio,
            q_shape=tuple(q.shape),
            k_shape=tuple(k.shape),
            thd=thd,
            offsets=None if q_causal_offsets is None else q_causal_offsets.tolist(),
            q_scale_shape=None if q_scale is None else tuple(q_scale.shape),
            k_scale_shape=None if k_scale is None else tuple(k_scale.shape),
        )
        self.forward_calls.append(call)
        assert q.is_contiguous() and k.is_contiguous() and w.is_contiguous()
        if precision == "fp8":
            assert q.dtype == k.dtype == torch.float8_e4m3fn and w.dtype == torch.float32
            assert q_scale.dtype == k_scale.dtype == torch.float32
            assert q_scale.shape == q.shape[:-1] and k_scale.shape == k.shape[:-1]
        else:
            assert precision == "bf16" and q.dtype == k.dtype == torch.bfloat16
            assert (
                q_scale is None and k_scale is None and w.dtype in (torch.bfloat16, torch.float32)
            )
        assert q_causal_offsets is None or q_causal_offsets.dtype == torch.int32
        if thd:
            outs = torch.full((q.shape[0], max_seqlen_k), float("-inf"))
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for i in range(len(cq) - 1):
                sub = self._bshd(
                    q[None, cq[i] : cq[i + 1]],
                    k[None, ck[i] : ck[i + 1]],
                    w[None, cq[i] : cq[i + 1]],
                    None if q_scale is None else k_scale[None, ck[i] : ck[i + 1]],
                    ratio,
                    sm_scale,
                    precision,
                    [0 if q_causal_offsets is None else call["offsets"][i]],
                )
                outs[cq[i] : cq[i + 1], : ck[i + 1] - ck[i]] = sub[0]
            return {"scores": outs}
        offsets = call["offsets"] or [0] * q.shape[0]
        return {"scores": self._bshd(q, k, w, k_scale, ratio, sm_scale, precision, offsets)}

    @staticmethod
    def _bshd(q, k, w, k_scale, ratio, sm_scale, precision, offsets):
        dots = torch.einsum("bshd,btd->bsht", q.double(), k[:, :, 0].double())
        s = (dots.clamp_min(0) * w.double().unsqueeze(-1)).sum(2)
        s = s * k_scale[:, None, :, 0].double() if precision == "fp8" else s * sm_scale
        s = s.float()
        sq, sk = s.shape[1], s.shape[2]
        for b, off in enumerate(offsets):
            for i in range(sq):
                s[b, i, min((off + i + 1) // ratio, sk) :] = float("-inf")
        return s

    def indexer_top_k_wrapper(
        self, values, seq_lens, top_k, next_n=1, return_val=True, *, deterministic=False
    ):
        self.topk_calls.append(
            dict(dtype=values.dtype, top_k=top_k, next_n=next_n, deterministic=deterministic)
        )
        assert seq_lens.dtype == torch.int32 and next_n == 1 and values.is_contiguous()
        n = values.shape[0]
        idx = torch.full((n, top_k), -1, dtype=torch.int32)
        val = torch.full((n, top_k), float("-inf"), dtype=values.dtype)
        for r in range(n):
            row = values[r, : int(seq_lens[r])]
            order = torch.sort(row, descending=True, stable=True).indices[:top_k]
            order = order.sort().values  # deterministic mode: ascending local indices
            idx[r, : order.numel()] = order.int()
            val[r, : order.numel()] = row[order]
        return {"indices": idx, "values": val}


def install(monkeypatch) -> FakeDSA:
    """Route the package's cuDNN launches to a FakeDSA and declare the kernels usable."""
    from dsa_precision import _cudnn

    fake = FakeDSA()
    monkeypatch.setattr(_cudnn, "dsa", lambda: fake)
    monkeypatch.setattr(_cudnn, "scoring_unsupported_reason", lambda **kw: None)
    monkeypatch.setattr(_cudnn, "topk_unsupported_reason", lambda **kw: None)
    return fake
