"""What reaches DeepGEMM's MQA-logits kernel, checked on the CPU with recording fakes injected
through ``dsa_precision._deepgemm._import``, for both entry points the package calls: the legacy
``fp8_mqa_logits(q, (k, k_scales), weights, ks, ke, clean_logits=True)`` (full logits) and
``fp8_fp4_mqa_logits((q, None), (k, k_scales), weights, ks, ke, max_seqlen_k)`` (DeepGEMM 2.8's
compressed logits, tail unwritten). Per BSHD batch row and for packed windows, the tests check the
arguments and how the package places the kernel's logits: both entry points must give the same
scores. Also the feature detection of the module. The fakes' logits are tags (row, key, launch),
never scores: the kernel's numerics are the ``gpu`` tests' (tests/gpu/test_cudnn_scoring.py)."""

import sys
import types

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
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

BF16, FP8 = IndexerPrecisionConfig(), IndexerPrecisionConfig(scoring_precision="fp8")

# What the compressed entry point leaves past each row's window (DeepGEMM does not write it).
_UNWRITTEN = float("nan")


class FakeMqaLogits:
    """``deep_gemm.fp8_mqa_logits(q, (k, k_scales), weights, ks, ke, clean_logits, max_seqlen_k)``
    or, ``compressed``, DeepGEMM 2.8's ``fp8_fp4_mqa_logits((q, None), kv, weights, ks, ke,
    max_seqlen_k, schedule_meta=None)``.

    Answers with a view of a padded buffer, as DeepGEMM does: full ``(S_q, S_k)`` logits, ``-inf``
    outside each row's window ``[ks, ke)``; compressed ``(S_q, max_seqlen_k)`` logits whose column
    ``j`` is key ``ks + j``, NaN past ``ke - ks``. Inside a window ``tags`` mode writes
    ``launch * 10**6 + row * 1000 + key`` and ``operands`` mode the stand-in function of the
    operand bytes.
    """

    __doc__ += "\n(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)"

    def __init__(self, mode="tags", compressed=False):
        self.mode = mode
        self.compressed = compressed
        self.calls: list[dict] = []

    def __call__(self, q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        q_scale = None
        if self.compressed:
            q, q_scale = q
        k, k_scales = kv
        sq, sk = q.shape[0], k.shape[0]
        self.calls.append(
            dict(
                q=q.clone(),
                q_scale=q_scale,
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
        if self.mode == "tags":
            rows = torch.arange(sq, dtype=torch.float64).unsqueeze(1)
            keys = torch.arange(sk, dtype=torch.float64)
            full = (len(self.calls) - 1) * 1e6 + rows * 1000 + keys
        else:
            full = stand_in_scores(q.unsqueeze(0), k.unsqueeze(0).unsqueeze(2))[0].double()
        if not self.compressed:
            logits = torch.empty(sq, sk + 5)[:, :sk]
            logits.copy_(full)
            keys = torch.arange(sk)
            outside = (keys < ks.long().unsqueeze(1)) | (keys >= ke.long().unsqueeze(1))
            return logits.masked_fill_(outside, float("-inf"))
        assert max_seqlen_k >= int((ke - ks).max())
        logits = torch.full((sq, max_seqlen_k + 3), _UNWRITTEN)[:, :max_seqlen_k]
        for i in range(sq):
            n = int(ke[i] - ks[i])
            logits[i, :n] = full[i, int(ks[i]) : int(ke[i])]
        return logits


@pytest.fixture(params=["fp8_mqa_logits", "fp8_fp4_mqa_logits"])
def fake(request, monkeypatch):
    """Each test runs against both entry points."""
    compressed = request.param == "fp8_fp4_mqa_logits"
    fn = FakeMqaLogits(compressed=compressed)
    entry = _deepgemm._EntryPoint(fn, f"deep_gemm.{request.param}", compressed=compressed)
    monkeypatch.setattr(_deepgemm, "_import", lambda: (entry, None))
    monkeypatch.setattr(_deepgemm, "mqa_logits_unsupported_reason", lambda **kw: None)
    return fn


def _ops(b=2, sq=9, sk=13, h=32, sm_scale=1.0):
    q, k = torch.randn(b, sq, h, 128), torch.randn(b, sk, 128)
    w = (torch.randn(b, sq, h) * 0.02).to(torch.bfloat16)
    return prepare_scoring_operands(q, k, w, config=FP8, sm_scale=sm_scale)


def _check_launch(call, ops, b, ends, starts=None, columns=None, compressed=False):
    sq, h = ops.q.shape[1], ops.q.shape[2]
    if compressed:  # window-local columns, one per key of the widest window that can occur
        assert call["clean_logits"] is False and call["max_seqlen_k"] == columns
        assert call["q_scale"] is None  # FP8 q: its descale is folded into the weights
    else:
        assert call["clean_logits"] is True and call["max_seqlen_k"] == 0
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
        ends = causal_counts(offsets[b], range(9), ratio, 13)
        _check_launch(call, ops, b, ends, columns=13, compressed=fake.compressed)
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
    ends = [s + c for s, c in zip(starts, counts, strict=True)]
    _check_launch(call, ops, 0, ends, starts, columns=8, compressed=fake.compressed)
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
        indexer_scores(q, k, w, config=BF16, backend="deepgemm")
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*on cpu.*CUDA"):
        indexer_scores(q, k, w, config=FP8, backend="deepgemm")


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


# Never read: the call must fail before it reaches a kernel.
_NO_OPERANDS = (torch.empty(1, 32, 128), (torch.empty(1, 128), torch.empty(1)), torch.empty(1, 32),
                torch.ones(1, dtype=torch.int32))  # fmt: skip


def _module(name, fn=None, fp4=None):
    module = types.ModuleType(name)
    if fn is not None:
        module.fp8_mqa_logits = fn
    if fp4 is not None:
        module.fp8_fp4_mqa_logits = fp4
    return module


def _call():
    ops = _ops(b=1, sq=3, sk=3)
    return indexer_scores(ops, backend="deepgemm")


def _detected(fresh_import, module):
    fresh_import.setitem(sys.modules, "deep_gemm", module)
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)  # import fails
    fresh_import.setattr(_deepgemm, "mqa_logits_unsupported_reason", lambda **kw: None)
    return _deepgemm._import()


def test_feature_detection_takes_the_first_module_with_an_entry_point(fresh_import):
    fn = FakeMqaLogits()
    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm"))  # neither function
    fresh_import.setitem(sys.modules, "vllm", _module("vllm"))
    fresh_import.setitem(sys.modules, "vllm.third_party", _module("vllm.third_party"))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", _module("vdg", fn))
    fresh_import.setattr(_deepgemm, "mqa_logits_unsupported_reason", lambda **kw: None)
    assert _deepgemm.deepgemm_available()
    assert _deepgemm.entry_point() == "vllm.third_party.deep_gemm.fp8_mqa_logits"
    _call()
    (call,) = fn.calls
    assert call["clean_logits"] is True


def test_the_legacy_name_is_preferred_when_both_exist(fresh_import):
    legacy, fp4 = FakeMqaLogits(), FakeMqaLogits(compressed=True)
    fp4.__doc__ = "fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)"
    entry, _ = _detected(fresh_import, _module("deep_gemm", legacy, fp4))
    assert entry.name == "deep_gemm.fp8_mqa_logits" and not entry.compressed
    _call()
    assert len(legacy.calls) == 1 and not fp4.calls


def test_deepgemm_2_8_is_called_for_compressed_logits(fresh_import):
    """DeepGEMM 2.8 (vLLM 0.31+): only ``fp8_fp4_mqa_logits``, ``max_seqlen_k`` required, no
    ``clean_logits``; read from its Python signature."""
    fake = FakeMqaLogits(compressed=True)
    calls = []

    def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k,
                           schedule_meta=None):  # fmt: skip
        calls.append(dict(max_seqlen_k=max_seqlen_k, schedule_meta=schedule_meta))
        return fake(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k=max_seqlen_k)

    entry, _ = _detected(fresh_import, _module("deep_gemm", fp4=fp8_fp4_mqa_logits))
    assert entry.compressed and not entry.clean_logits_arg
    assert _deepgemm.entry_point() == "deep_gemm.fp8_fp4_mqa_logits"
    got = _call()
    assert calls == [dict(max_seqlen_k=3, schedule_meta=None)]
    assert got[0].tolist() == [[i * 1000 + j if j <= i else float("-inf") for j in range(3)]
                               for i in range(3)]  # fmt: skip


def test_deepgemm_2_4_to_2_6_fp8_fp4_form_asks_for_uncleaned_compressed_logits(fresh_import):
    """A pybind11 ``fp8_fp4_mqa_logits`` whose docstring names ``clean_logits`` (2.4-2.6) and no
    legacy name: compressed logits need ``clean_logits=False`` there."""
    fake = FakeMqaLogits(compressed=True)
    fake.__doc__ = (
        "fp8_fp4_mqa_logits(q: tuple[torch.Tensor, Optional[torch.Tensor]], kv: tuple, weights: "
        "torch.Tensor, cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor, "
        "clean_logits: bool = True, max_seqlen_k: int = 0, logits_dtype = torch.float32)"
    )
    builtin = types.SimpleNamespace(fp8_fp4_mqa_logits=_NoSignature(fake))
    entry, _ = _detected(fresh_import, builtin)
    assert entry.compressed and entry.clean_logits_arg
    _call()
    (call,) = fake.calls
    assert call["clean_logits"] is False and call["max_seqlen_k"] == 3


class _NoSignature:
    """A callable without an introspectable signature (as pybind11 functions), its docstring the
    wrapped one's."""

    __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature")))

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def test_feature_detection_reports_each_failure(fresh_import):
    def unknown(*args):
        """fp8_mqa_logits(a: int) -> int"""

    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm", unknown))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)  # import fails
    assert not _deepgemm.deepgemm_available() and _deepgemm.entry_point() is None
    _, reason = _deepgemm._import()
    assert "deep_gemm.fp8_mqa_logits has an unknown signature" in reason
    assert "vllm.third_party.deep_gemm" in reason and "DeepGEMM" in reason
    with pytest.raises(ImportError, match="not importable"):
        _deepgemm.causal_logits(*_NO_OPERANDS)


def test_an_fp8_fp4_form_without_max_seqlen_k_is_reported_not_called(fresh_import):
    called = []

    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits=True):
        called.append(True)

    entry, reason = _detected(fresh_import, _module("deep_gemm", fp4=fp8_fp4_mqa_logits))
    assert entry is None
    assert "deep_gemm.fp8_fp4_mqa_logits takes no max_seqlen_k" in reason
    with pytest.raises(ImportError, match="takes no max_seqlen_k"):
        _deepgemm.causal_logits(*_NO_OPERANDS)
    assert not called
