"""A recording stand-in for ``cudnn.DSA`` (nvidia-cudnn-frontend 1.32) on machines without an SM90
GPU: it checks and records WHAT REACHES THE KERNELS, and nothing about their numerics.

- Its signatures are the real wrappers', so a misspelt keyword fails as it would on the GPU.
- Every launch is checked against the requirements the real SM90 wrappers assert
  (``indexer_forward/_interface_sm90.py``, ``indexer_top_k/api.py``) plus the package's own
  promises (contiguous, 16-byte aligned operands), and recorded with copies of its arguments.
- The forward answers with stand-in scores: a simple function of the operand bytes it received
  (not the indexer's formula) under cuDNN's documented causal mask, so the code around the launch
  runs and chunked launches can be compared with single ones. The numerics of the real kernel
  are checked by the ``gpu`` tests against the float64 reference.
- The top-k (``indexer_top_k_wrapper``, and the ``IndexerTopK`` plan behind it, which the package
  calls) answers as cuDNN documents its deterministic radix top-k: per row, the ``top_k``
  largest float bit patterns among columns ``< seq_len`` (``-inf`` columns included; NaN above
  ``+inf``), ties toward the lower column, returned in ascending column order, short rows padded
  with ``-1`` / ``-inf``.
"""

from __future__ import annotations

import functools

import torch

SM90_BF16_HEADS = (16, 32, 64)
SM90_FP8_HEADS = (32, 64)
TOPK_MAX_K = 2048


def _check_tensor(name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    assert t.is_contiguous(), f"{name} reaches the kernel non-contiguous: strides {t.stride()}"
    assert t.data_ptr() % 16 == 0, f"{name} reaches the kernel at an unaligned address"


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def stand_in_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., S_q, S_k]``: a function of each query row's and each key's bytes (NOT the
    indexer's scores): ``sum(q_row) / 1024 + sum(k)``, distinct for random operands."""
    qs = q.float().flatten(-2).sum(-1, dtype=torch.float64) / 1024  # [..., S_q]
    ks = k.float().flatten(-2).sum(-1, dtype=torch.float64)  # [..., S_k]
    return (qs.unsqueeze(-1) + ks.unsqueeze(-2)).float()


def _mask(scores: torch.Tensor, offset: int, ratio: int, n_keys: int) -> None:
    """cuDNN's top-left causal mask on ``[S_q, S_k]`` in place: ``-inf`` from key
    ``min(floor((offset + s + 1) / ratio), n_keys)`` of row ``s`` on."""
    for s in range(scores.shape[0]):
        scores[s, min((offset + s + 1) // ratio, n_keys) :] = float("-inf")


def radix_order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering float32 values as an unsigned radix sort of their flipped bit
    patterns does: ``-inf < ... < -0 < +0 < ... < +inf < NaN`` (for a positive NaN)."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


class FakeDSA:
    """``cudnn.DSA`` with ``indexer_forward_wrapper`` and ``indexer_top_k_wrapper``."""

    def __init__(self) -> None:
        self.forward_calls: list[dict] = []
        self.topk_calls: list[dict] = []
        # The class API (IndexerTopK(...)), bound to this fake's call record.
        self.IndexerTopK = functools.partial(FakeIndexerTopK, self)

    # ---------------------------------------------------------------------- scoring
    def indexer_forward_wrapper(
        self,
        q,
        k,
        w,
        ratio=4,
        qhead_per_kv_head=None,
        m_block_size=128,
        n_block_size=128,
        q_stage=2,
        kv_stage=4,
        sm_scale=1.0,
        out=None,
        stream=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        q_causal_offsets=None,
        precision="bf16",
        q_scale=None,
        k_scale=None,
        cu_seqlens_q_scale_padded=None,
        cu_seqlens_k_scale_padded=None,
        sf_vec_size=32,
        return_lse=False,
        lse_out=None,
    ):
        thd = cu_seqlens_q is not None
        assert thd == (cu_seqlens_k is not None), "THD needs both cu_seqlens"
        assert (m_block_size, n_block_size, q_stage, kv_stage) == (128, 128, 2, 4)
        assert not return_lse and lse_out is None and cu_seqlens_q_scale_padded is None
        for name, t in (("q", q), ("k", k), ("w", w), ("q_scale", q_scale), ("k_scale", k_scale)):
            _check_tensor(name, t)
        if precision == "fp8":
            assert q.dtype == k.dtype == torch.float8_e4m3fn, (q.dtype, k.dtype)
            assert q_scale is not None and k_scale is not None, "fp8 needs q_scale and k_scale"
            assert q_scale.dtype == k_scale.dtype == torch.float32
        else:
            assert precision == "bf16", precision
            assert q.dtype == k.dtype == torch.bfloat16, (q.dtype, k.dtype)
            assert q_scale is None and k_scale is None, "bf16 takes no scales"
        assert w.dtype in (torch.bfloat16, torch.float32), w.dtype
        if thd:
            for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                assert cu.dtype == torch.int32 and cu.ndim == 1 and cu.is_contiguous(), name
            assert q.ndim == 3 and k.ndim == 3 and w.ndim == 2, (q.shape, k.shape, w.shape)
            assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
            n_rows, n_heads, head_dim = q.shape
            batch = cu_seqlens_q.numel() - 1
            assert cu_seqlens_k.shape == (batch + 1,)
            out_shape = (n_rows, max_seqlen_k)
            if precision == "fp8":
                assert q_scale.shape == (n_rows, n_heads) and k_scale.shape == (k.shape[0], 1)
        else:
            assert q.ndim == 4 and k.ndim == 4 and w.ndim == 3, (q.shape, k.shape, w.shape)
            batch, sq, n_heads, head_dim = q.shape
            assert k.shape[0] == batch and w.shape == (batch, sq, n_heads)
            out_shape = (batch, sq, k.shape[1])
            if precision == "fp8":
                assert q_scale.shape == q.shape[:3] and k_scale.shape == (batch, k.shape[1], 1)
        assert k.shape[-2] == 1, f"one key head, got {k.shape}"
        assert head_dim == k.shape[-1] == 128, head_dim
        heads = SM90_FP8_HEADS if precision == "fp8" else SM90_BF16_HEADS
        assert n_heads in heads, f"{precision} with {n_heads} heads"
        if q_causal_offsets is not None:
            assert q_causal_offsets.dtype == torch.int32 and q_causal_offsets.shape == (batch,)
            assert q_causal_offsets.device == q.device
        if out is not None:
            assert tuple(out.shape) == out_shape and out.dtype == torch.float32
            assert out.is_contiguous()
        self.forward_calls.append(
            dict(
                q=_clone(q),
                k=_clone(k),
                w=_clone(w),
                q_scale=_clone(q_scale),
                k_scale=_clone(k_scale),
                precision=precision,
                ratio=ratio,
                sm_scale=sm_scale,
                offsets=None if q_causal_offsets is None else q_causal_offsets.tolist(),
                thd=thd,
                cu_seqlens_q=_clone(cu_seqlens_q),
                cu_seqlens_k=_clone(cu_seqlens_k),
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                out=out,
                out_ptr=None if out is None else out.data_ptr(),
            )
        )
        scores = torch.empty(out_shape) if out is None else out
        offsets = [0] * batch if q_causal_offsets is None else q_causal_offsets.tolist()
        if thd:
            scores.fill_(float("-inf"))
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for i in range(batch):
                n_keys = ck[i + 1] - ck[i]
                part = stand_in_scores(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]])
                _mask(part, offsets[i], ratio, n_keys)
                scores[cq[i] : cq[i + 1], :n_keys] = part[:, :max_seqlen_k]
        else:
            scores.copy_(stand_in_scores(q, k))
            for b in range(batch):
                _mask(scores[b], offsets[b], ratio, k.shape[1])
        self.forward_calls[-1]["returned"] = scores
        return {"scores": scores}

    # ------------------------------------------------------------------------ top-k
    def indexer_top_k_wrapper(
        self,
        input_values,
        seq_lens,
        top_k,
        next_n=1,
        return_val=True,
        num_copy_bits=256,
        stream=None,
        tie_break=0,
        deterministic=False,
    ):
        n_rows = input_values.shape[0]
        plan = FakeIndexerTopK(
            self, input_values.contiguous(), seq_lens.contiguous(), top_k, next_n, return_val,
            num_copy_bits, tie_break, deterministic,
        )  # fmt: skip
        assert plan.check_support()
        plan.compile()
        indices = torch.empty(n_rows, top_k, dtype=torch.int32)
        values = torch.empty(n_rows, top_k, dtype=input_values.dtype) if return_val else None
        workspace = torch.empty(plan.scratch_workspace_bytes(), dtype=torch.uint8)
        plan.execute(
            input_values.contiguous(), seq_lens.contiguous(), out_indices=indices,
            out_values=values, workspace=workspace,
        )  # fmt: skip
        return {"indices": indices, "values": values}


class FakeIndexerTopK:
    """``cudnn.DSA.IndexerTopK`` (nvidia-cudnn-frontend 1.32): a plan from sample tensors, checked
    by ``check_support`` as the real one checks it (dtypes, ranks, contiguity, ``n_rows ==
    len(seq_lens) * next_n``, ``0 < top_k <= 2048``), and ``execute`` into the caller's buffers,
    whose shapes, dtypes, contiguity, 32-byte input alignment, workspace size and disjointness it
    asserts; it answers as cuDNN documents its radix top-k (see the module docstring)."""

    def __init__(
        self, fake, sample_input_values, sample_seq_lens, top_k, next_n=1, return_val=True,
        num_copy_bits=256, tie_break=0, deterministic=False,
    ):  # fmt: skip
        self.fake = fake
        self.shape, self.dtype = tuple(sample_input_values.shape), sample_input_values.dtype
        self.strides = sample_input_values.stride()
        self.lens_shape, self.lens_dtype = tuple(sample_seq_lens.shape), sample_seq_lens.dtype
        self.lens_strides = sample_seq_lens.stride()
        self.top_k, self.next_n, self.return_val = top_k, next_n, return_val
        self.tie_break, self.deterministic = tie_break, deterministic
        self.compiled = False

    def check_support(self) -> bool:
        assert len(self.shape) == 2, self.shape
        assert self.dtype in (torch.float32, torch.float16, torch.bfloat16), self.dtype
        assert self.lens_dtype == torch.int32 and len(self.lens_shape) == 1, self.lens_dtype
        n_rows, n_cols = self.shape
        assert n_rows > 0 and n_cols > 0, self.shape
        assert n_rows == self.lens_shape[0] * self.next_n, (self.shape, self.lens_shape)
        assert 0 < self.top_k <= TOPK_MAX_K, self.top_k
        assert self.strides == (n_cols, 1) and self.lens_strides == (1,), "strided plan"
        return True

    def compile(self) -> None:
        self.compiled = True

    def scratch_workspace_bytes(self) -> int:
        n_rows, n_cols = self.shape
        return -(-(n_rows * 3 * n_cols * 4) // 128) * 128

    def execute(
        self, input_values, seq_lens, current_stream=None, *, out_indices, out_values=None,
        workspace=None,
    ):  # fmt: skip
        assert self.compiled, "execute() before compile()"
        n_rows, n_cols = self.shape
        assert tuple(input_values.shape) == self.shape and input_values.dtype == self.dtype
        assert input_values.is_contiguous() and input_values.data_ptr() % 32 == 0
        assert tuple(seq_lens.shape) == self.lens_shape and seq_lens.dtype == torch.int32
        assert seq_lens.is_contiguous()
        assert tuple(out_indices.shape) == (n_rows, self.top_k) and out_indices.is_contiguous()
        assert out_indices.dtype == torch.int32
        if self.return_val:
            assert out_values is not None and out_values.dtype == self.dtype
            assert tuple(out_values.shape) == (n_rows, self.top_k) and out_values.is_contiguous()
        else:
            assert out_values is None
        assert workspace is not None and workspace.dtype == torch.uint8
        assert workspace.numel() >= self.scratch_workspace_bytes()
        spans = [
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for t in (input_values, seq_lens, out_indices, out_values, workspace)
            if t is not None and t.numel()
        ]
        for i, a in enumerate(spans):
            for b in spans[i + 1 :]:
                assert max(a[0], b[0]) >= min(a[1], b[1]), "overlapping buffers"
        self.fake.topk_calls.append(
            dict(
                values=_clone(input_values),
                seq_lens=_clone(seq_lens),
                top_k=self.top_k,
                next_n=self.next_n,
                return_val=self.return_val,
                tie_break=self.tie_break,
                deterministic=self.deterministic,
            )
        )
        out_indices.fill_(-1)
        if out_values is not None:
            out_values.fill_(float("-inf"))
        order_keys = radix_order_keys(input_values)
        for r in range(n_rows):
            n = min(int(seq_lens[r // self.next_n]), n_cols)
            # Largest radix key first, ties toward the lower column (a stable sort).
            order = torch.sort(order_keys[r, :n], descending=True, stable=True).indices
            order = order[: self.top_k]
            order = order.sort().values if self.deterministic else order.flip(0)
            out_indices[r, : order.numel()] = order.to(torch.int32)
            if out_values is not None:
                out_values[r, : order.numel()] = input_values[r, order]
        self.fake.topk_calls[-1]["indices"] = out_indices.clone()
        self.fake.topk_calls[-1]["values_out"] = None if out_values is None else out_values.clone()
        return out_indices, out_values


def install(monkeypatch, fake=None):
    """Stand a FakeDSA (or ``fake``) in for the hardware this machine lacks, and nothing else: the
    library imports (``cudnn_backend._import_dsa`` answers with the fake) and CPU tensors sit on an SM90 device
    (``cudnn_backend``'s device check and ``torch.cuda.get_device_capability`` of a CPU device). Whether
    cuDNN can serve a call (head count, head width, k, dtype) is still the package's decision,
    computed by its own code from the real arguments."""
    from dsa_precision.backends import cudnn as cudnn_backend

    fake = FakeDSA() if fake is None else fake
    device_reason = cudnn_backend._device_reason
    capability = torch.cuda.get_device_capability

    def sm90_capability(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return (9, 0)
        return capability(device)

    monkeypatch.setattr(cudnn_backend, "_import_dsa", lambda: (fake, None))
    monkeypatch.setattr(
        cudnn_backend,
        "_device_reason",
        lambda device: None if device.type == "cpu" else device_reason(device),
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", sm90_capability)
    return fake


def stub_fused_kernel(monkeypatch, launch) -> None:
    """Replace the fused preprocess + quantize Triton kernel's launch by ``launch`` (indexed by
    the grid, then called with the kernel's arguments): a host-time measurement on the CPU."""
    from dsa_precision.kernels import preprocess_quantize

    monkeypatch.setattr(preprocess_quantize, "_preprocess_quantize_kernel", launch)
