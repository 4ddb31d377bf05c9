"""What reaches cuDNN's kernels, checked on the CPU with the recording fake of ``cudnn.DSA``
(tests/support/fake_cudnn.py): operand dtypes, bytes, shapes and layout, precision, descales, folded
weights, offsets, cu_seqlens, max lengths, the ``out=`` buffer, launch counts per chunk, and the
package's post-processing of the top-k kernel's answer. The numerics of the real kernels are the
``gpu`` tests' (tests/gpu/test_scoring.py); nothing here compares numbers computed by the
fake with the reference."""

import pytest
import torch

from dsa_precision import (
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_select_varlen,
    indexer_topk,
    prepare_scoring_operands,
    quantize_e4m3_ue8m0,
    reset_scoring_calls,
    scoring_calls,
)
from dsa_precision.backends import cudnn as cudnn_backend
from dsa_precision.config import ScoringPrecision

from ..support import fake_cudnn
from ..support.configs import BF16, CONFIGS, FP8
from ..support.helpers import assert_bitwise_equal, causal_counts, cu_seqlens


@pytest.fixture
def fake(monkeypatch):
    return fake_cudnn.install(monkeypatch)


def _inputs(b=2, sq=20, sk=23, h=64, w_dtype=torch.bfloat16):
    return (
        torch.randn(b, sq, h, 128),  # FP32 carriers, as with rope_fp32
        torch.randn(b, sk, 128),
        (torch.randn(b, sq, h) * 0.01).to(w_dtype),
    )


# ------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize("sm_scale", [1.0, 0.3])
@pytest.mark.parametrize("h", [32, 64])
def test_fp8_launch_gets_e4m3_operands_descales_and_folded_weights(fake, sm_scale, h):
    q, k, w = _inputs(h=h)
    got = indexer_scores(q, k, w, config=FP8, sm_scale=sm_scale, ratio=4, backend="cudnn")
    (call,) = fake.forward_calls
    assert call["precision"] == "fp8" and call["ratio"] == 4 and not call["thd"]
    q8, qs = quantize_e4m3_ue8m0(q)
    k8, ks = quantize_e4m3_ue8m0(k)
    assert call["q"].dtype == call["k"].dtype == torch.float8_e4m3fn
    assert_bitwise_equal(call["q"], q8, "q")
    assert_bitwise_equal(call["k"], k8.unsqueeze(2), "k (B, S_k, 1, 128)")
    # float32 weights with the q descale and sm_scale folded in, in this order; sm_scale 1.0.
    assert_bitwise_equal(call["w"], (w.float() * qs) * sm_scale, "folded weights")
    assert call["sm_scale"] == 1.0
    assert_bitwise_equal(call["q_scale"], qs, "q_scale (B, S_q, H)")
    assert_bitwise_equal(call["k_scale"], ks.unsqueeze(-1), "k_scale (B, S_k, 1)")
    assert call["offsets"] == [0, 0]  # int32 (checked by the fake)
    assert got is call["returned"]  # cuDNN's buffer, no copy


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_bf16_launch_gets_bf16_operands_and_sm_scale(fake, w_dtype):
    q, k, w = _inputs(h=16, w_dtype=w_dtype)
    indexer_scores(q, k, w, config=BF16, sm_scale=0.5, backend="cudnn")
    (call,) = fake.forward_calls
    assert call["precision"] == "bf16" and call["sm_scale"] == 0.5
    assert_bitwise_equal(call["q"], q.to(torch.bfloat16), "q")
    assert_bitwise_equal(call["k"], k.to(torch.bfloat16).unsqueeze(2), "k")
    assert_bitwise_equal(call["w"], w, "weights keep their dtype")
    assert call["q_scale"] is None and call["k_scale"] is None


def test_prepared_operands_reach_the_kernel_unchanged(fake):
    q, k, w = _inputs()
    ops = prepare_scoring_operands(q, k, w, config=FP8, sm_scale=0.25)
    indexer_scores(ops, backend="cudnn")
    (call,) = fake.forward_calls
    assert_bitwise_equal(call["q"], ops.q, "q")
    assert_bitwise_equal(call["w"], ops.weights, "weights")
    assert_bitwise_equal(call["k_scale"][..., 0], ops.k_descale, "k_scale")


@pytest.mark.parametrize("offsets", [7, torch.tensor([3, 11]), torch.tensor([3, 11]).int()])
def test_offsets_reach_the_kernel_as_int32(fake, offsets):
    q, k, w = _inputs()
    indexer_scores(q, k, w, config=FP8, q_causal_offsets=offsets, backend="cudnn")
    want = [7, 7] if isinstance(offsets, int) else [3, 11]
    assert fake.forward_calls[0]["offsets"] == want


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_out_is_passed_through_and_returned(fake, precision):
    q, k, w = _inputs()
    out = torch.empty(2, 20, 23)
    got = indexer_scores(q, k, w, config=CONFIGS[precision], out=out, backend="cudnn")
    (call,) = fake.forward_calls
    assert call["out"] is out and got is out


def test_row_slices_reach_the_kernel_contiguous_and_aligned(fake):
    """Batch-2 row slices are strided views; the kernel gets contiguous aligned copies of them."""
    q, k, w = _inputs()
    ops = prepare_scoring_operands(q, k, w, config=FP8).rows(3, 9)
    assert not ops.q.is_contiguous()
    indexer_scores(ops, q_causal_offsets=torch.tensor([3, 3]), backend="cudnn")
    (call,) = fake.forward_calls  # the fake asserts contiguity and 16-byte alignment
    assert_bitwise_equal(call["q"], ops.q.contiguous(), "q rows 3:9")
    assert_bitwise_equal(call["q_scale"], ops.q_descale.contiguous(), "q_scale rows 3:9")


def test_auto_takes_cudnn_when_it_can(fake):
    """The fake stands in for an SM90 GPU; whether cuDNN's kernel can serve each call is the
    package's decision from the call's shapes: FP8 64 heads and BF16 16 heads yes, BF16 with 8
    heads or 64-wide heads no (the torch reference then)."""
    reset_scoring_calls()
    indexer_scores(*_inputs(h=64), config=FP8)
    indexer_scores(*_inputs(h=16), config=BF16)
    assert len(fake.forward_calls) == 2 and scoring_calls(backend="cudnn") == 2
    q, k, w = _inputs(h=8)
    indexer_scores(q, k, w, config=BF16)
    indexer_scores(q[..., :64], k[..., :64], w, config=BF16)
    assert len(fake.forward_calls) == 2 and scoring_calls("bf16", "torch") == 2
    with pytest.raises(RuntimeError, match="n_heads=8"):
        indexer_scores(q, k, w, config=BF16, backend="cudnn")


def test_empty_calls_launch_nothing(fake):
    q, k, w = _inputs(sq=0)
    assert indexer_scores(q, k, w, config=FP8, backend="cudnn").shape == (2, 0, 23)
    assert not fake.forward_calls


# -------------------------------------------------------------------------------- THD


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_thd_is_one_launch_with_int32_cu_seqlens_and_the_callers_max_lengths(fake, precision):
    lens_q, lens_k = [6, 0, 10], [6, 3, 12]
    cu_q, cu_k = cu_seqlens(lens_q, torch.int64), cu_seqlens(lens_k, torch.int64)
    q, k, w = torch.randn(16, 32, 128), torch.randn(21, 128), torch.randn(16, 32).bfloat16()
    out = torch.empty(16, 15)
    got = indexer_scores_varlen(
        q,
        k,
        w,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=13,  # looser than the data: passed as given
        max_seqlen_k=15,
        config=CONFIGS[precision],
        ratio=2,
        q_causal_offsets=torch.tensor([0, 4, 2]),
        out=out,
        backend="cudnn",
    )
    (call,) = fake.forward_calls
    assert call["thd"] and call["precision"] == precision and call["ratio"] == 2
    assert call["q"].shape == (16, 32, 128) and call["k"].shape == (21, 1, 128)
    assert call["w"].shape == (16, 32)
    assert call["cu_seqlens_q"].tolist() == cu_q.tolist()  # int32 (checked by the fake)
    assert call["cu_seqlens_k"].tolist() == cu_k.tolist()
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (13, 15)
    assert call["offsets"] == [0, 4, 2]
    assert call["out"] is out and got is out
    if precision == "fp8":
        q8, qs = quantize_e4m3_ue8m0(q)
        assert_bitwise_equal(call["q"], q8, "q")
        assert_bitwise_equal(call["q_scale"], qs, "q_scale (T_q, H)")
        assert call["k_scale"].shape == (21, 1)
        assert_bitwise_equal(call["w"], w.float() * qs, "folded weights")


# ------------------------------------------------------------------------------- top-k


def test_topk_launch_and_post_processing(fake):
    """-inf and NaN picks of the kernel become -1; the answer is padded to k and reshaped."""
    scores = torch.randn(2, 3, 10)
    scores[0, 0, 2:] = float("-inf")  # 2 finite keys, k = 4: the kernel picks -inf keys
    scores[0, 1, 4] = float("nan")  # a positive NaN: the radix order ranks it first
    scores[1, 2] = float("-inf")  # 3 finite keys between -inf ones
    scores[1, 2, 1:6:2] = torch.tensor([1.0, 2.0, 3.0])
    seq_lens = torch.tensor([[10, 10, 7], [3, 10, 10]])
    got = indexer_topk(scores, 4, seq_lens=seq_lens, backend="cudnn")
    (call,) = fake.topk_calls
    assert call["top_k"] == 4 and call["deterministic"] is True and call["next_n"] == 1
    assert call["seq_lens"].tolist() == seq_lens.reshape(-1).tolist()  # int32 (fake checks)
    assert_bitwise_equal(call["values"], scores.reshape(6, 10), "scores")
    picked, values = call["indices"], call["values_out"]
    want = picked.masked_fill(~(values > float("-inf")), -1).reshape(2, 3, 4)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert got[0, 0].tolist() == [0, 1, -1, -1] and not (got[0, 1] == 4).any()
    # The kernel picks the lowest -inf key to fill the row; its -1 comes first (the torch path
    # skips -inf keys and pads at the end: [1, 3, 5, -1]; both select the same set).
    assert got[1, 2].tolist() == [-1, 1, 3, 5]


def test_topk_k_above_the_key_count_asks_for_s_k_and_pads(fake):
    scores = torch.randn(3, 5)
    got = indexer_topk(scores, 8, backend="cudnn", deterministic=False)
    (call,) = fake.topk_calls
    assert call["top_k"] == 5 and call["deterministic"] is False
    assert call["seq_lens"].tolist() == [5, 5, 5]  # every key read without seq_lens
    assert got.shape == (3, 8) and (got[:, 5:] == -1).all()
    assert sorted(got[0, :5].tolist()) == list(range(5))


def test_topk_auto_and_empty(fake):
    scores = torch.randn(4, 6)
    indexer_topk(scores, 2)
    assert len(fake.topk_calls) == 1  # auto takes cuDNN when it can
    wide = torch.randn(2, 4100)
    assert torch.equal(indexer_topk(wide, 4096), indexer_topk(wide, 4096, backend="torch"))
    assert len(fake.topk_calls) == 1  # k above cuDNN's 2048: the torch path
    assert indexer_topk(torch.empty(0, 6), 2, backend="cudnn").shape == (0, 2)
    assert len(fake.topk_calls) == 1  # nothing to launch


def test_topk_plans_get_aligned_contiguous_scores_and_are_reused(fake):
    """The top-k runs cuDNN's IndexerTopK plan into buffers the package allocates: the plan's
    class API binds only contiguous, 32-byte aligned scores (the fake asserts both), so a strided
    or misaligned view is copied first, as indexer_top_k_wrapper would; a plan is built once per
    shape, k and mode, and its picks are the torch path's (tie-free scores)."""
    from dsa_precision.backends import cudnn as cudnn_backend

    cudnn_backend._TOPK_PLANS.clear()
    g = torch.Generator().manual_seed(4)
    base = torch.rand(6 * 40 + 1, generator=g).argsort().float()  # distinct values: no ties
    aligned = base[:240].view(6, 40)
    misaligned = base[1:].view(6, 40)  # contiguous, 4 bytes past an aligned address
    strided = base[:240].view(6, 40)[:, ::2]  # (6, 20), column stride 2
    lens = torch.tensor([40, 3, 0, 17, 40, 25], dtype=torch.int32)
    for scores, n in ((aligned, 40), (misaligned, 40), (strided, 20)):
        seq = lens.clamp(max=n)
        got = indexer_topk(scores, 5, seq_lens=seq, backend="cudnn")
        want = indexer_topk(scores, 5, seq_lens=seq, backend="torch")
        assert torch.equal(got, want)
        assert_bitwise_equal(fake.topk_calls[-1]["values"], scores.contiguous(), "bound scores")
    assert len(cudnn_backend._TOPK_PLANS) == 2  # (6, 40) twice, (6, 20)
    indexer_topk(aligned, 5, seq_lens=lens, backend="cudnn", deterministic=False)
    indexer_topk(aligned, 7, seq_lens=lens, backend="cudnn")
    indexer_topk(aligned, 7, seq_lens=lens, backend="cudnn")
    assert len(cudnn_backend._TOPK_PLANS) == 4  # another mode, another k; the last one reused
    assert [c["top_k"] for c in fake.topk_calls] == [5, 5, 5, 5, 7, 7]


# ------------------------------------------------------------------------------ select


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_select_launches_one_scoring_and_one_topk_call_per_chunk(fake, precision):
    q, k, w = _inputs(b=2, sq=20, sk=23, h=32)
    offsets = torch.tensor([0, 5])
    picks = indexer_select(
        q,
        k,
        w,
        topk=4,
        config=CONFIGS[precision],
        ratio=2,
        q_causal_offsets=offsets,
        backend="cudnn",
        chunk_bytes=8 * 2 * 23 * 12,  # 8 rows: float32 scores + top-k scratch, 12 B a score
    )
    starts = [0, 8, 16]
    assert [c["offsets"] for c in fake.forward_calls] == [[r, 5 + r] for r in starts]
    assert [c["q"].shape[1] for c in fake.forward_calls] == [8, 8, 4]
    assert {c["precision"] for c in fake.forward_calls} == {precision}
    # One score buffer, reused: every chunk's scores live at the same address.
    assert len({c["out_ptr"] for c in fake.forward_calls}) == 1
    assert len(fake.topk_calls) == 3
    for r0, call in zip(starts, fake.topk_calls, strict=True):
        rows = range(r0, min(r0 + 8, 20))
        want = causal_counts(0, rows, 2, 23) + causal_counts(5, rows, 2, 23)
        assert call["seq_lens"].tolist() == want, r0
        assert call["deterministic"] is True and call["top_k"] == 4
    assert picks.shape == (2, 20, 4) and picks.dtype == torch.int32
    # The chunks are stitched in place: one chunk through the same fake gives the same picks.
    whole = indexer_select(
        q, k, w, topk=4, config=CONFIGS[precision], ratio=2, q_causal_offsets=offsets,
        backend="cudnn",
    )  # fmt: skip
    assert torch.equal(picks, whole)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_select_varlen_chunks_cut_sequences_on_the_device(fake, precision):
    lens_q, lens_k = [5, 0, 17, 9], [5, 2, 17, 12]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, w = torch.randn(31, 32, 128), torch.randn(36, 128), torch.randn(31, 32).bfloat16()
    offsets = torch.tensor([0, 1, 2, 3])
    kw = dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=17,
        max_seqlen_k=17,
        config=CONFIGS[precision],
        q_causal_offsets=offsets,
        backend="cudnn",
    )
    picks = indexer_select_varlen(q, k, w, topk=6, chunk_bytes=8 * 17 * 12, **kw)
    # 8-row chunks [0, 8), [8, 16), [16, 24), [24, 31).
    calls = fake.forward_calls
    assert len(calls) == 4 and all(c["thd"] for c in calls)
    assert [c["cu_seqlens_q"].tolist() for c in calls] == [
        [0, 5, 5, 8, 8],
        [0, 0, 0, 8, 8],
        [0, 0, 0, 6, 8],
        [0, 0, 0, 0, 7],
    ]
    assert all(c["cu_seqlens_k"].tolist() == cu_k.tolist() for c in calls)
    # Each cut sequence starts at its global causal row: offset + its rows already scored.
    in_chunk = [
        {i: c["offsets"][i] for i in range(4) if c["cu_seqlens_q"][i + 1] > c["cu_seqlens_q"][i]}
        for c in calls
    ]
    assert in_chunk == [{0: 0, 2: 2}, {2: 2 + 3}, {2: 2 + 11, 3: 3}, {3: 3 + 2}]
    assert [(c["max_seqlen_q"], c["max_seqlen_k"]) for c in calls] == [(8, 17)] * 3 + [(7, 17)]
    assert len({c["out_ptr"] for c in calls}) == 1
    lens = []
    for i, n in enumerate(lens_q):
        lens += [min(c, lens_k[i]) for c in causal_counts(int(offsets[i]), range(n), 1, 10**9)]
    topk_lens = [c["seq_lens"].tolist() for c in fake.topk_calls]
    assert topk_lens == [lens[0:8], lens[8:16], lens[16:24], lens[24:31]]
    assert all(c["deterministic"] and c["top_k"] == 6 for c in fake.topk_calls)
    whole = indexer_select_varlen(q, k, w, topk=6, **kw)
    assert torch.equal(picks, whole)


# ---------------------------------------------------------------- why cuDNN cannot run


def test_reasons_name_the_device_and_the_limits(monkeypatch):
    cpu = torch.device("cpu")
    fp8, bf16 = ScoringPrecision.FP8, ScoringPrecision.BF16
    args = dict(n_heads=64, head_dim=128, n_kv_heads=1)
    assert "on cpu" in cudnn_backend._scoring_unsupported_reason(device=cpu, precision=fp8, **args)
    assert "on cpu" in cudnn_backend._topk_unsupported_reason(device=cpu, k=8, dtype=torch.float32)
    # A CUDA device of a given architecture, without touching a GPU.
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(cudnn_backend, "_import_dsa", lambda: (object(), None))
    assert "SM80" in cudnn_backend._scoring_unsupported_reason(device=cuda, precision=fp8, **args)
    assert "SM80" in cudnn_backend._topk_unsupported_reason(device=cuda, k=8, dtype=torch.float32)
    capability[0] = (9, 0)
    reason = cudnn_backend._scoring_unsupported_reason
    assert reason(device=cuda, precision=fp8, **args) is None
    assert "n_heads=16" in reason(device=cuda, precision=fp8, **{**args, "n_heads": 16})
    assert reason(device=cuda, precision=bf16, **{**args, "n_heads": 16}) is None
    assert "head_dim=64" in reason(device=cuda, precision=bf16, **{**args, "head_dim": 64})
    assert "2 heads" in reason(device=cuda, precision=bf16, **{**args, "n_kv_heads": 2})
    assert "k=4096" in cudnn_backend._topk_unsupported_reason(
        device=cuda, k=4096, dtype=torch.float32
    )
    capability[0] = (10, 0)  # Blackwell: BF16 yes, the per-128-vector FP8 kernel no
    assert "SM100" in reason(device=cuda, precision=fp8, **args)
    assert reason(device=cuda, precision=bf16, **args) is None
    monkeypatch.setattr(cudnn_backend, "_import_dsa", lambda: (None, "not importable (hint)"))
    assert reason(device=cuda, precision=bf16, **args) == "not importable (hint)"


def test_the_hot_path_asks_once_per_cuda_device_and_arguments(monkeypatch):
    """``_scoring_reason`` / ``_topk_reason`` (what the scoring and top-k entry points ask) remember
    the answer for a CUDA device, whose facts are fixed for the process, keyed on every argument;
    another device type is asked every time (the stand-ins of SM90 hardware change its answers)."""
    fp8, bf16 = ScoringPrecision.FP8, ScoringPrecision.BF16
    cuda = torch.device("cuda", 0)
    queries = []

    def capability(device=None):
        queries.append(device)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(cudnn_backend, "_import_dsa", lambda: (object(), None))
    cudnn_backend._cuda_scoring_reason.cache_clear()
    cudnn_backend._cuda_topk_reason.cache_clear()
    try:
        assert cudnn_backend._scoring_reason(cuda, fp8, 64, 128, 1) is None
        assert cudnn_backend._scoring_reason(cuda, fp8, 64, 128, 1) is None
        assert len(queries) == 1  # remembered
        assert "n_heads=16" in cudnn_backend._scoring_reason(cuda, fp8, 16, 128, 1)  # another key
        assert cudnn_backend._scoring_reason(cuda, bf16, 16, 128, 1) is None
        assert "head_dim=64" in cudnn_backend._scoring_reason(cuda, bf16, 16, 64, 1)
        assert "k=4096" in cudnn_backend._topk_reason(cuda, 4096, torch.float32)
        assert cudnn_backend._topk_reason(cuda, 2048, torch.float32) is None
        assert cudnn_backend._topk_reason(cuda, 2048, torch.float32) is None
        assert len(queries) == 6
        # the public functions are not cached: they see the architecture change
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert "SM80" in cudnn_backend._scoring_unsupported_reason(
            device=cuda, precision=fp8, n_heads=64, head_dim=128, n_kv_heads=1
        )
        cpu = torch.device("cpu")
        assert "on cpu" in cudnn_backend._scoring_reason(cpu, fp8, 64, 128, 1)
        monkeypatch.setattr(cudnn_backend, "_device_reason", lambda device: None)
        assert "SM80" in cudnn_backend._scoring_reason(cpu, fp8, 64, 128, 1)  # asked again
    finally:  # no answer of this fake CUDA device outlives the test
        cudnn_backend._cuda_scoring_reason.cache_clear()
        cudnn_backend._cuda_topk_reason.cache_clear()


def test_cudnn_entry_points_are_looked_up_once():
    """``cudnn.DSA`` re-imports an entry point's module on every attribute access; the package's
    handle keeps each entry point after its first lookup (and still fails for a missing one)."""
    lookups = []

    class Namespace:
        def __getattr__(self, name):
            lookups.append(name)
            if name == "missing":
                raise AttributeError(name)
            return f"<{name}>"

    dsa = cudnn_backend._Resolved(Namespace())
    assert dsa.indexer_forward_wrapper == "<indexer_forward_wrapper>"
    assert dsa.indexer_forward_wrapper == dsa.indexer_forward_wrapper
    assert dsa.indexer_top_k_wrapper == "<indexer_top_k_wrapper>"
    assert lookups == ["indexer_forward_wrapper", "indexer_top_k_wrapper"]
    with pytest.raises(AttributeError):
        dsa.missing  # noqa: B018
    assert cudnn_backend.dsa_available() == (cudnn_backend.dsa_unavailable_reason() is None)


def test_auto_select_scores_on_cudnn_and_selects_beyond_its_top_k_with_torch(fake):
    """``backend="auto"`` decides for each kernel: scored by cuDNN, a top-k larger than cuDNN's
    2048 runs on the torch top-k; an explicit ``backend="cudnn"`` raises instead."""
    q, k, w = _inputs(b=1, sq=4, sk=2100, h=32)
    picks = indexer_select(
        q, k, w, topk=2100, config=CONFIGS["fp8"], q_causal_offsets=2096, backend="auto"
    )
    assert len(fake.forward_calls) == 1 and fake.topk_calls == []
    assert picks.shape == (1, 4, 2100)
    assert (picks[0, :, :2097] >= 0).all() and (picks[0, 0, 2097:] == -1).all()
    with pytest.raises(RuntimeError, match=r"backend='cudnn' cannot run this top-k: k=2100"):
        indexer_select(
            q, k, w, topk=2100, config=CONFIGS["fp8"], q_causal_offsets=2096, backend="cudnn"
        )
