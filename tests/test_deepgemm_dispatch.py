"""What reaches DeepGEMM's ``fp8_mqa_logits``, checked on the CPU with a recording fake injected
through ``dsa_precision._deepgemm._import``: the five positional arguments and
``clean_logits=True``, per BSHD batch row and for packed windows, how the package places the
kernel's logits (per batch row; packed windows gathered into sequence-local columns), and the
feature detection of the module. The fake's logits are tags (row, column, launch), never scores:
the kernel's numerics are the ``gpu`` tests' (tests/gpu/test_cudnn_scoring.py)."""

import sys
import types

import pytest
import torch

from dsa_precision import (
    _deepgemm,
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    prepare_scoring_operands,
    reset_scoring_calls,
    scoring_calls,
)
from dsa_precision.config import ScoringPrecision

from .fake_cudnn import stand_in_scores
from .helpers import assert_bitwise_equal, causal_counts, cu_seqlens


class FakeMqaLogits:
    """``deep_gemm.fp8_mqa_logits(q, (k, k_scales), weights, ks, ke, clean_logits, max_seqlen_k)``.

    Answers with a padded buffer's ``(S_q, S_k)`` view (as DeepGEMM does), ``-inf`` outside each
    row's window ``[ks, ke)``; inside it ``tags`` mode writes ``launch * 10**6 + row * 1000 +
    column`` and ``operands`` mode the stand-in function of the operand bytes.
    """

    __doc__ += "\n(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)"

    def __init__(self, mode="tags"):
        self.mode = mode
        self.calls: list[dict] = []

    def __call__(self, q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        k, k_scales = kv
        sq, sk = q.shape[0], k.shape[0]
        self.calls.append(
            dict(
                q=q.clone(),
                k=k.clone(),
                k_scales=k_scales.clone(),
                weights=weights.clone(),
                ks=ks.clone(),
                ke=ke.clone(),
                clean_logits=clean_logits,
                max_seqlen_k=max_seqlen_k,
                contiguous=all(t.is_contiguous() for t in (q, k, k_scales, weights, ks, ke)),
            )
        )
        padded = torch.empty(sq, sk + 5)
        logits = padded[:, :sk]
        if self.mode == "tags":
            rows = torch.arange(sq, dtype=torch.float64).unsqueeze(1)
            cols = torch.arange(sk, dtype=torch.float64)
            logits.copy_((len(self.calls) - 1) * 1e6 + rows * 1000 + cols)
        else:
            logits.copy_(stand_in_scores(q.unsqueeze(0), k.unsqueeze(0).unsqueeze(2))[0])
        cols = torch.arange(sk)
        outside = (cols < ks.long().unsqueeze(1)) | (cols >= ke.long().unsqueeze(1))
        logits.masked_fill_(outside, float("-inf"))
        return logits


@pytest.fixture
def fake(monkeypatch):
    fn = FakeMqaLogits()
    monkeypatch.setattr(_deepgemm, "_import", lambda: (fn, None))
    monkeypatch.setattr(_deepgemm, "mqa_logits_unsupported_reason", lambda **kw: None)
    return fn


def _ops(b=2, sq=9, sk=13, h=32, sm_scale=1.0):
    q, k = torch.randn(b, sq, h, 128), torch.randn(b, sk, 128)
    w = (torch.randn(b, sq, h) * 0.02).to(torch.bfloat16)
    return prepare_scoring_operands(q, k, w, scoring_precision="fp8", sm_scale=sm_scale)


def _check_launch(call, ops, b, ends, starts=None):
    sq, h = ops.q.shape[1], ops.q.shape[2]
    assert call["clean_logits"] is True and call["max_seqlen_k"] == 0  # compressed output unused
    assert call["contiguous"]
    assert call["q"].dtype == torch.float8_e4m3fn and call["q"].shape == (sq, h, 128)
    assert_bitwise_equal(call["q"], ops.q[b], "q (S_q, H, 128)")
    assert call["k"].dtype == torch.float8_e4m3fn
    assert_bitwise_equal(call["k"], ops.k[b], "k (S_k, 128)")
    assert call["k_scales"].dtype == torch.float32 and call["k_scales"].ndim == 1
    assert_bitwise_equal(call["k_scales"], ops.k_descale[b], "k descale (S_k,)")
    assert call["weights"].dtype == torch.float32 and call["weights"].shape == (sq, h)
    assert_bitwise_equal(call["weights"], ops.weights[b], "folded weights (S_q, H)")
    assert call["ks"].dtype == call["ke"].dtype == torch.int32
    assert call["ks"].tolist() == ([0] * sq if starts is None else starts)
    assert call["ke"].tolist() == ends


# ---------------------------------------------------------------------------------- BSHD


@pytest.mark.parametrize("ratio", [1, 4])
def test_bshd_launches_once_per_batch_row_with_causal_windows(fake, ratio):
    ops = _ops(b=2, sq=9, sk=13, sm_scale=0.5)
    offsets = [0, 5]
    got = indexer_scores(
        ops, ratio=ratio, q_causal_offsets=torch.tensor(offsets), backend="deepgemm"
    )
    assert len(fake.calls) == 2
    for b, call in enumerate(fake.calls):
        _check_launch(call, ops, b, causal_counts(offsets[b], range(9), ratio, 13))
    # DeepGEMM's logits, untouched, batch row b from launch b.
    assert got.shape == (2, 9, 13) and got.dtype == torch.float32
    for b in range(2):
        for i, end in enumerate(causal_counts(offsets[b], range(9), ratio, 13)):
            want = [b * 1e6 + i * 1000 + j for j in range(end)] + [float("-inf")] * (13 - end)
            assert got[b, i].tolist() == want, (b, i)


def test_batch_one_returns_the_kernels_logits(fake):
    ops = _ops(b=1, sq=4, sk=6)
    got = indexer_scores(ops, backend="deepgemm")
    assert got.shape == (1, 4, 6)
    assert got[0].tolist() == [
        [i * 1000 + j if j <= i else float("-inf") for j in range(6)] for i in range(4)
    ]


def test_deepgemm_rejects_out(fake):
    ops = _ops()
    with pytest.raises(ValueError, match="pass out=None"):
        indexer_scores(ops, backend="deepgemm", out=torch.empty(2, 9, 13))
    cu = cu_seqlens([9])
    with pytest.raises(ValueError, match="pass out=None"):
        indexer_scores_varlen(
            _ops(b=1), cu_seqlens_q=cu, cu_seqlens_k=cu_seqlens([13]), max_seqlen_q=9,
            max_seqlen_k=13, backend="deepgemm", out=torch.empty(9, 13),
        )  # fmt: skip
    assert not fake.calls


# ------------------------------------------------------------------------------- varlen


@pytest.mark.parametrize("ratio", [1, 2])
def test_varlen_is_one_launch_whose_windows_are_gathered_into_local_columns(fake, ratio):
    lens_q, lens_k = [4, 0, 6, 3], [5, 2, 7, 0]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    ops = _ops(b=1, sq=13, sk=14)
    offsets = [1, 0, 0, 2]
    got = indexer_scores_varlen(
        ops,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=6,
        max_seqlen_k=8,  # one padding column past the longest key sequence
        ratio=ratio,
        q_causal_offsets=torch.tensor(offsets),
        backend="deepgemm",
    )
    (call,) = fake.calls
    starts, counts = [], []
    for i, n in enumerate(lens_q):
        starts += [int(cu_k[i])] * n
        counts += [min(c, lens_k[i]) for c in causal_counts(offsets[i], range(n), ratio, 10**9)]
    _check_launch(call, ops, 0, [s + c for s, c in zip(starts, counts, strict=True)], starts)
    assert got.shape == (13, 8)
    for t in range(13):
        want = [t * 1000 + starts[t] + c for c in range(counts[t])]
        assert got[t].tolist() == want + [float("-inf")] * (8 - counts[t]), t


# ------------------------------------------------------------------------------ select


def test_select_scores_each_chunk_with_its_global_rows(fake):
    fake.mode = "operands"
    ops = _ops(b=2, sq=20, sk=20)
    offsets = torch.tensor([0, 3])
    picks = indexer_select(
        ops, topk=5, q_causal_offsets=offsets, backend="deepgemm", chunk_bytes=1
    )  # 8-row chunks
    assert len(fake.calls) == 6  # 3 chunks x 2 batch rows
    for n, call in enumerate(fake.calls):
        r0, b = 8 * (n // 2), n % 2
        rows = range(r0, min(r0 + 8, 20))
        assert call["ke"].tolist() == causal_counts(int(offsets[b]), rows, 1, 20), n
        assert_bitwise_equal(call["q"], ops.q[b, r0 : r0 + 8], f"chunk {n} q")
    fake.calls.clear()
    whole = indexer_select(ops, topk=5, q_causal_offsets=offsets, backend="deepgemm")
    assert len(fake.calls) == 2 and torch.equal(picks, whole)


def test_auto_never_chooses_deepgemm(fake):
    ops = _ops()
    reset_scoring_calls()
    indexer_scores(ops)  # CPU: cuDNN cannot run, and auto does not pick DeepGEMM
    assert not fake.calls and scoring_calls("fp8", "torch") == 1


# ------------------------------------------------------------- why DeepGEMM cannot run


def test_explicit_deepgemm_raises_with_the_reason():
    q, k = torch.randn(1, 4, 32, 128), torch.randn(1, 4, 128)
    w = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*FP8 operands only.*'fp8'"):
        indexer_scores(q, k, w, scoring_precision="bf16", backend="deepgemm")
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*on cpu.*CUDA"):
        indexer_scores(q, k, w, scoring_precision="fp8", backend="deepgemm")


def test_unsupported_reasons(monkeypatch):
    reason = _deepgemm.mqa_logits_unsupported_reason
    fp8 = ScoringPrecision.FP8
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(10, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(_deepgemm, "_import", lambda: (object(), None))
    assert "SM100" in reason(device=cuda, precision=fp8, n_heads=64, head_dim=128)
    capability[0] = (9, 0)
    assert reason(device=cuda, precision=fp8, n_heads=64, head_dim=128) is None
    assert "16 heads" in reason(device=cuda, precision=fp8, n_heads=16, head_dim=128)
    monkeypatch.setattr(_deepgemm, "_import", lambda: (None, "not importable (hint)"))
    assert reason(device=cuda, precision=fp8, n_heads=64, head_dim=128) == "not importable (hint)"


@pytest.fixture
def fresh_import(monkeypatch):
    """Run ``_deepgemm._import`` against stand-in modules, uncached, and restore it after."""
    for name in _deepgemm._MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    _deepgemm._import.cache_clear()
    yield monkeypatch
    _deepgemm._import.cache_clear()


def _module(name, fn=None):
    module = types.ModuleType(name)
    if fn is not None:
        module.fp8_mqa_logits = fn
    return module


def test_feature_detection_takes_the_first_module_with_the_function(fresh_import):
    fn = FakeMqaLogits()
    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm"))  # no fp8_mqa_logits
    fresh_import.setitem(sys.modules, "vllm", _module("vllm"))
    fresh_import.setitem(sys.modules, "vllm.third_party", _module("vllm.third_party"))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", _module("vdg", fn))
    assert _deepgemm.deepgemm_available()
    ops = _ops(b=1, sq=3, sk=3)
    _deepgemm.fp8_mqa_logits(
        ops.q[0], (ops.k[0], ops.k_descale[0]), ops.weights[0],
        torch.zeros(3, dtype=torch.int32), torch.full((3,), 3, dtype=torch.int32),
    )  # fmt: skip
    (call,) = fn.calls
    assert call["clean_logits"] is True


def test_feature_detection_reports_each_failure(fresh_import):
    def unknown(*args):
        """fp8_mqa_logits(a: int) -> int"""

    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm", unknown))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)  # import fails
    assert not _deepgemm.deepgemm_available()
    _, reason = _deepgemm._import()
    assert "deep_gemm.fp8_mqa_logits has an unknown signature" in reason
    assert "vllm.third_party.deep_gemm" in reason and "DeepGEMM" in reason
    with pytest.raises(ImportError, match="not importable"):
        _deepgemm.fp8_mqa_logits(None, (None, None), None, None, None)


def test_deepgemm_2_8_without_the_legacy_name_is_reported_not_called(fresh_import):
    called = []
    module = types.ModuleType("deep_gemm")
    module.fp8_fp4_mqa_logits = lambda *args: called.append(args)
    fresh_import.setitem(sys.modules, "deep_gemm", module)
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)
    assert not _deepgemm.deepgemm_available()
    assert "only fp8_fp4_mqa_logits (DeepGEMM 2.8+" in _deepgemm._import()[1]
    with pytest.raises(ImportError, match=r"use a DeepGEMM 2\.0-2\.6 build"):
        _deepgemm.fp8_mqa_logits(None, (None, None), None, None, None)
    assert not called
