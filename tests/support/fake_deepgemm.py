"""A recording stand-in for DeepGEMM's MQA logits (``deep_gemm.fp8_fp4_mqa_logits`` of 54e2261,
its legacy name, DeepGEMM 2.8's form) on machines without an SM90 GPU: it checks and records WHAT
REACHES THE KERNEL, and answers with a view of a padded buffer laid out as the real API's
(``csrc/apis/attention.hpp``): ``align(rows, 128 / H)`` rows, ``align(max_seqlen_k, 256)``
floats apart (compressed) or ``align(S_k + 256, 256)`` apart (``max_seqlen_k=0``), written only
inside each row's window ``[ks, ke)``, the rest garbage (a huge finite value, which neither the
``-inf`` nor the NaN rule of the top-k would hide). Its logits are tags (launch, packed row,
packed key) or a stand-in function of the operand bytes, never scores."""

from __future__ import annotations

import weakref

import torch

from dsa_precision.backends import deepgemm as deepgemm_backend

from .fake_cudnn import stand_in_scores

# What DeepGEMM leaves where it writes nothing (its buffer comes from torch.empty).
GARBAGE = 3.0e38

# What the package passes for compressed logits: clean_logits=False where the entry point takes it.
UNCLEANED = {True: False, False: None}

FP8_FP4_DOC = (
    "fp8_fp4_mqa_logits(q: tuple[torch.Tensor, Optional[torch.Tensor]], kv: tuple, weights: "
    "torch.Tensor, cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor, "
    "clean_logits: bool = True, max_seqlen_k: int = 0, logits_dtype = torch.float32)"
)
LEGACY_DOC = (
    "fp8_mqa_logits(q: torch.Tensor, kv: tuple, weights: torch.Tensor, cu_seq_len_k_start: "
    "torch.Tensor, cu_seq_len_k_end: torch.Tensor, clean_logits: bool = True, max_seqlen_k: int "
    "= 0)"
)


def _align(x, n):
    return (x + n - 1) // n * n


class FakeMqaLogits:
    """DeepGEMM's MQA logits (see the module docstring); ``q_pair``: takes ``(q, q_scales)``."""

    def __init__(self, mode="tags", q_pair=True, events=None):
        self.mode = mode
        self.q_pair = q_pair
        self.calls: list[dict] = []
        self.buffers: list[torch.Tensor] = []
        self.events = events if events is not None else []
        self.keep = True  # False: hold only weak references to the buffers it answered with
        self._refs: list[weakref.ref] = []

    def __call__(self, q, kv, weights, ks, ke, clean_logits=None, max_seqlen_k=0):
        """``clean_logits=None``: not passed (DeepGEMM 2.8 has no such argument; 2.4-2.6 default
        to True, which they assert against for compressed logits)."""
        self.events.append("launch")
        alive = sum(ref() is not None for ref in self._refs)  # earlier answers still referenced
        q_scale = None
        if self.q_pair:
            q, q_scale = q
        k, k_scales = kv
        rows, heads, sk = q.shape[0], q.shape[1], k.shape[0]
        self.calls.append(
            dict(
                q=q.clone(), q_scale=q_scale, k=k.clone(), k_scales=k_scales.clone(),
                weights=weights.clone(), ks=ks.clone(), ke=ke.clone(),
                ks_ptr=ks.data_ptr(), ke_ptr=ke.data_ptr(),
                clean_logits=clean_logits, max_seqlen_k=max_seqlen_k,
                contiguous=all(t.is_contiguous() for t in (q, k, k_scales, weights, ks, ke)),
                aligned=all(t.data_ptr() % 16 == 0 for t in (q, k, k_scales, weights)),
                alive=alive,
            )
        )  # fmt: skip
        assert ks.dtype == ke.dtype == torch.int32 and ks.shape == ke.shape == (rows,)
        if self.mode == "tags":
            r = torch.arange(rows, dtype=torch.float64).unsqueeze(1)
            full = (len(self.calls) - 1) * 1e6 + r * 1000 + torch.arange(sk, dtype=torch.float64)
        else:
            full = stand_in_scores(q.unsqueeze(0), k.unsqueeze(0).unsqueeze(2))[0].double()
        padded_rows = _align(rows, 128 // heads)
        if max_seqlen_k == 0:  # (rows, S_k) columns = keys
            width = sk
            buf = torch.full((padded_rows, _align(sk + 256, 256)), GARBAGE)
            keys = torch.arange(sk)
            inside = (keys >= ks.long().unsqueeze(1)) & (keys < ke.long().unsqueeze(1))
            view = buf[:rows, :sk]
            view[inside] = full.float()[inside]
            if clean_logits or clean_logits is None:
                view[~inside] = float("-inf")
        else:  # compressed: column j = key ks + j, written below ke - ks
            assert clean_logits is not True, (
                "DeepGEMM asserts `not clean_logits` for compressed logits"
            )
            assert max_seqlen_k >= int((ke - ks).max())
            width = max_seqlen_k
            buf = torch.full((padded_rows, _align(max_seqlen_k, 256)), GARBAGE)
            for i in range(rows):
                n = int(ke[i] - ks[i])
                buf[i, :n] = full[i, int(ks[i]) : int(ke[i])].float()
        if self.keep:
            self.buffers.append(buf)
        self._refs.append(weakref.ref(buf))
        return buf[:rows, :width]


def install(monkeypatch, fn, name="deep_gemm.fp8_fp4_mqa_logits", clean=True, module=None):
    entry = deepgemm_backend._EntryPoint(fn, name, fn.q_pair, clean, module)
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (entry, None))
    monkeypatch.setattr(deepgemm_backend, "_mqa_logits_unsupported_reason", lambda **kw: None)
