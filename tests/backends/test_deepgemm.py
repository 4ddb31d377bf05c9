"""What reaches DeepGEMM's MQA-logits kernel, checked on the CPU with recording fakes injected
through ``dsa_precision.deepgemm_backend._import``: DeepGEMM 54e2261's
``fp8_fp4_mqa_logits((q, None), (k, k_scales), weights, ks, ke, clean_logits, max_seqlen_k)``
(and its legacy name ``fp8_mqa_logits(q, ...)``, and 2.8's form without ``clean_logits``).

The fake (tests/support/fake_deepgemm.py) answers as the kernel's API does (``csrc/apis/attention.hpp``):
a view of a buffer of
``align(rows, 128 / H)`` rows, ``align(max_seqlen_k, 256)`` floats apart (compressed) or
``align(S_k + 256, 256)`` apart (``max_seqlen_k=0``), written only inside each row's window, the
rest garbage (a huge finite value, which neither the ``-inf`` nor the NaN rule of the top-k would
hide). Its logits are tags (launch, packed row, packed key) or a stand-in function of the operand
bytes, never scores: the kernel's numerics are the ``gpu`` tests' (tests/gpu/test_scoring.py).
The tests check one launch per call, the windows, that the top-k reads DeepGEMM's buffer itself
bounded by each row's length, and that the selection is the deterministic top-k of the logits.
"""

import sys
import types

import pytest
import torch

from dsa_precision import (
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_select_varlen,
    indexer_topk,
    prepare_scoring_operands,
    reset_scoring_calls,
    scoring_calls,
)
from dsa_precision import select as select_module
from dsa_precision.backends import deepgemm as deepgemm_backend
from dsa_precision.config import ScoringPrecision

from ..support.configs import BF16, FP8
from ..support.fake_cudnn import stand_in_scores
from ..support.fake_deepgemm import (
    FP8_FP4_DOC,
    GARBAGE,
    LEGACY_DOC,
    UNCLEANED,
    FakeMqaLogits,
    install,
)
from ..support.helpers import assert_bitwise_equal, causal_counts, cu_seqlens


@pytest.fixture(params=["fp8_fp4_mqa_logits", "fp8_mqa_logits", "2.8"])
def fake(request, monkeypatch):
    """Each test runs against 54e2261's two names and DeepGEMM 2.8's form (no clean_logits)."""
    fn = FakeMqaLogits(q_pair=request.param != "fp8_mqa_logits")
    fn.clean_arg = request.param != "2.8"
    install(monkeypatch, fn, f"deep_gemm.{request.param}", clean=fn.clean_arg)
    return fn


def _ops(b=2, sq=9, sk=13, h=32, sm_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, sq, h, 128, generator=g), torch.randn(b, sk, 128, generator=g)
    w = (torch.randn(b, sq, h, generator=g) * 0.02).to(torch.bfloat16)
    return prepare_scoring_operands(q, k, w, config=FP8, sm_scale=sm_scale)


def _check_operands(call, ops):
    """The launch got every batch row flattened: q (B*S_q, H, 128), k (B*S_k, 128), ..."""
    b, sq, h, d = ops.q.shape
    assert call["contiguous"] and call["aligned"]
    assert call["q_scale"] is None  # FP8 q: its descale is folded into the weights
    assert_bitwise_equal(call["q"], ops.q.reshape(b * sq, h, d), "q (B*S_q, H, 128)")
    assert_bitwise_equal(call["k"], ops.k.reshape(-1, d), "k (B*S_k, 128)")
    assert_bitwise_equal(call["k_scales"], ops.k_descale.reshape(-1), "k descale (B*S_k,)")
    assert_bitwise_equal(call["weights"], ops.weights.reshape(b * sq, h), "weights (B*S_q, H)")


def _bshd_windows(offsets, sq, sk, ratio, r0=0):
    starts, ends = [], []
    for b, off in enumerate(offsets):
        for c in causal_counts(off, range(r0, r0 + sq), ratio, sk):
            starts.append(b * sk)
            ends.append(b * sk + c)
    return starts, ends


# ---------------------------------------------------------------------------------- BSHD


@pytest.mark.parametrize("ratio", [1, 4])
def test_bshd_is_one_launch_over_all_batch_rows(fake, ratio):
    ops = _ops(b=2, sq=9, sk=13, sm_scale=0.5)
    offsets = [0, 5]
    got = indexer_scores(
        ops, ratio=ratio, q_causal_offsets=torch.tensor(offsets), backend="deepgemm"
    )
    (call,) = fake.calls
    _check_operands(call, ops)
    starts, ends = _bshd_windows(offsets, 9, 13, ratio)
    assert call["ks"].tolist() == starts and call["ke"].tolist() == ends
    assert call["max_seqlen_k"] == 13 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
    # DeepGEMM's logits in its own buffer, the unwritten tails -inf.
    assert got.shape == (2, 9, 13) and got.dtype == torch.float32
    assert got.data_ptr() == fake.buffers[0].data_ptr()
    for b in range(2):
        for i, end in enumerate(causal_counts(offsets[b], range(9), ratio, 13)):
            row = b * 9 + i
            want = [row * 1000 + b * 13 + j for j in range(end)] + [float("-inf")] * (13 - end)
            assert got[b, i].tolist() == want, (b, i)


def test_batch_one_is_deepgemms_cleaned_logits(fake):
    ops = _ops(b=1, sq=4, sk=6)
    got = indexer_scores(ops, q_causal_offsets=1, backend="deepgemm")
    (call,) = fake.calls
    _check_operands(call, ops)
    assert call["ks"].tolist() == [0] * 4 and call["ke"].tolist() == [2, 3, 4, 5]
    if fake.clean_arg:  # DeepGEMM cleans its own logits: nothing is masked here
        assert call["clean_logits"] is True and call["max_seqlen_k"] == 0
    else:  # DeepGEMM 2.8: compressed logits, the tails masked here
        assert call["max_seqlen_k"] == 6
    assert got.shape == (1, 4, 6) and got.data_ptr() == fake.buffers[0].data_ptr()
    assert got[0].tolist() == [
        [i * 1000 + j if j <= i + 1 else float("-inf") for j in range(6)] for i in range(4)
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

_LENS_Q, _LENS_K, _OFFSETS = [4, 0, 6, 3], [5, 2, 7, 0], [1, 0, 0, 2]


def _varlen_windows(ratio, lens_q=_LENS_Q, lens_k=_LENS_K, offsets=_OFFSETS):
    cu_k = cu_seqlens(lens_k)
    starts, counts = [], []
    for i, n in enumerate(lens_q):
        starts += [int(cu_k[i])] * n
        counts += [min(c, lens_k[i]) for c in causal_counts(offsets[i], range(n), ratio, 10**9)]
    return starts, counts


@pytest.mark.parametrize("ratio", [1, 2])
def test_varlen_is_one_launch_in_sequence_local_columns(fake, ratio):
    ops = _ops(b=1, sq=13, sk=14)
    got = indexer_scores_varlen(
        ops,
        cu_seqlens_q=cu_seqlens(_LENS_Q),
        cu_seqlens_k=cu_seqlens(_LENS_K),
        max_seqlen_q=6,
        max_seqlen_k=8,  # one padding column past the longest key sequence
        ratio=ratio,
        q_causal_offsets=torch.tensor(_OFFSETS),
        backend="deepgemm",
    )
    (call,) = fake.calls
    _check_operands(call, ops)
    starts, counts = _varlen_windows(ratio)
    assert call["ks"].tolist() == starts
    assert call["ke"].tolist() == [s + c for s, c in zip(starts, counts, strict=True)]
    assert call["max_seqlen_k"] == 8 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
    assert got.shape == (13, 8) and got.data_ptr() == fake.buffers[0].data_ptr()
    for t in range(13):
        want = [t * 1000 + starts[t] + c for c in range(counts[t])]
        assert got[t].tolist() == want + [float("-inf")] * (8 - counts[t]), t


# ------------------------------------------------------------------------- clean=False


def test_uncleaned_bshd_is_the_kernels_buffer_as_it_left_it(fake):
    """``clean=False``: one compressed launch, DeepGEMM's buffer untouched past each row's
    limit (the fake's garbage still there), the limits beside it; the top-k of it is the top-k
    of the cleaned scores."""
    ops, offsets = _ops(b=2, sq=9, sk=13), torch.tensor([0, 5])
    window = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm", clean=False)
    (call,) = fake.calls
    assert call["max_seqlen_k"] == 13 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
    assert window.scores.shape == (2, 9, 13) and window.lengths.shape == (2, 9)
    assert window.scores.data_ptr() == fake.buffers[0].data_ptr()
    for b in range(2):
        counts = causal_counts(int(offsets[b]), range(9), 1, 13)
        assert window.lengths[b].tolist() == counts
        for i, end in enumerate(counts):
            row = b * 9 + i
            assert window.scores[b, i, :end].tolist() == [
                row * 1000 + b * 13 + j for j in range(end)
            ]
            assert (window.scores[b, i, end:] == GARBAGE).all(), (b, i)  # no mask ran
    clean = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
    assert torch.equal(indexer_topk(window, 4), indexer_topk(clean, 4))


def test_uncleaned_batch_one_skips_deepgemms_cleaning(fake):
    window = indexer_scores(_ops(b=1, sq=4, sk=6), q_causal_offsets=1, backend="deepgemm",
                            clean=False)  # fmt: skip
    (call,) = fake.calls
    assert call["max_seqlen_k"] == 6 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
    assert window.lengths.tolist() == [[2, 3, 4, 5]]
    assert window.scores[0, 0, 2:].eq(GARBAGE).all()


def test_uncleaned_varlen_is_the_compressed_call_and_its_windows(fake):
    ops = _ops(b=1, sq=13, sk=14)
    kw = dict(
        cu_seqlens_q=cu_seqlens(_LENS_Q), cu_seqlens_k=cu_seqlens(_LENS_K), max_seqlen_q=6,
        max_seqlen_k=8, ratio=2, q_causal_offsets=torch.tensor(_OFFSETS), backend="deepgemm",
    )  # fmt: skip
    window = indexer_scores_varlen(ops, clean=False, **kw)
    (call,) = fake.calls
    starts, counts = _varlen_windows(2)
    assert call["max_seqlen_k"] == 8 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
    assert window.scores.data_ptr() == fake.buffers[0].data_ptr()
    assert window.scores.shape == (13, 8) and window.lengths.tolist() == counts
    for t in range(13):
        assert window.scores[t, : counts[t]].tolist() == [
            t * 1000 + starts[t] + c for c in range(counts[t])
        ]
        assert window.scores[t, counts[t] :].eq(GARBAGE).all(), t
    clean, masked = indexer_scores_varlen(ops, **kw), window.masked()  # a second launch
    assert masked.data_ptr() == window.scores.data_ptr()  # masked in place
    inside = torch.isfinite(clean)
    assert torch.equal(inside, torch.isfinite(masked))  # -inf where the default has it
    assert torch.equal(masked[inside] + 1e6, clean[inside])  # the fake tags its launches 1e6 apart


# ------------------------------------------------------------------------------ select


@pytest.fixture
def topk_inputs(monkeypatch):
    """Record what reaches the top-k from ``indexer_select``."""
    seen = []

    _select_rows = select_module._select_rows

    def recording_topk(scores, k, seq_lens, deterministic, backend):
        seen.append(dict(scores=scores, seq_lens=seq_lens.clone(), backend=backend))
        return _select_rows(scores, k, seq_lens, deterministic, backend)

    monkeypatch.setattr(select_module, "_select_rows", recording_topk)
    return seen


def _expected_picks(ops, offsets, ratio, topk):
    """The deterministic top-k of the fake's logits under the causal windows (torch reference)."""
    sq = ops.q.shape[1]
    sk = ops.k.shape[1]
    scores = stand_in_scores(ops.q, ops.k.unsqueeze(2))  # (B, S_q, S_k)
    keys = torch.arange(sk)
    for i, off in enumerate(offsets):
        limit = torch.tensor(causal_counts(off, range(sq), ratio, sk))
        scores[i].masked_fill_(keys >= limit.unsqueeze(1), float("-inf"))
    return indexer_topk(scores, topk, backend="torch")


@pytest.mark.parametrize("ratio", [1, 3])
def test_select_is_one_launch_per_chunk_read_in_place(fake, topk_inputs, ratio):
    fake.mode = "operands"
    ops = _ops(b=2, sq=20, sk=20)
    offsets = [0, 3]
    picks = indexer_select(
        ops, topk=5, ratio=ratio, q_causal_offsets=torch.tensor(offsets), backend="deepgemm",
        chunk_bytes=1,
    )  # fmt: skip  # 8-row chunks
    assert len(fake.calls) == 3  # one per chunk, both batch rows in it
    for n, call in enumerate(fake.calls):
        r0 = 8 * n
        rows = min(r0 + 8, 20) - r0
        _check_operands(call, ops.rows(r0, r0 + rows))
        starts, ends = _bshd_windows(offsets, rows, 20, ratio, r0)
        assert call["ks"].tolist() == starts and call["ke"].tolist() == ends, n
        assert call["max_seqlen_k"] == 20 and call["clean_logits"] is UNCLEANED[fake.clean_arg]
        # The top-k reads DeepGEMM's buffer itself, all its row stride, bounded by the windows.
        seen = topk_inputs[n]
        assert seen["scores"].data_ptr() == fake.buffers[n].data_ptr()
        assert seen["scores"].shape == (2 * rows, 256) and seen["scores"].is_contiguous()
        assert seen["seq_lens"].tolist() == [e - s for s, e in zip(starts, ends, strict=True)]
    assert_bitwise_equal(picks, _expected_picks(ops, offsets, ratio, 5), "picks vs top-k")
    fake.calls.clear()
    whole = indexer_select(ops, topk=5, ratio=ratio, q_causal_offsets=torch.tensor(offsets),
                           backend="deepgemm")  # fmt: skip
    assert len(fake.calls) == 1 and torch.equal(picks, whole)


def test_select_with_an_int_offset_builds_its_windows_once(fake, topk_inputs, monkeypatch):
    """B = 1 and an int offset: the windows are shared constants (zeros and the key counts, no
    launch per call), the same tensors every call, the counts the top-k's lengths; the picks are
    those of the same offset as a tensor."""
    from dsa_precision import scoring

    builds = []
    counts = scoring.causal_key_counts
    monkeypatch.setattr(scoring, "causal_key_counts", lambda *a: builds.append(a) or counts(*a))
    fake.mode = "operands"
    ops = _ops(b=1, sq=20, sk=20)
    indexer_select(ops, topk=5, q_causal_offsets=3, backend="deepgemm")
    builds.clear()
    picks = indexer_select(ops, topk=5, q_causal_offsets=3, backend="deepgemm")
    assert builds == []  # the second call computes no key counts
    first, second = fake.calls
    assert (first["ks_ptr"], first["ke_ptr"]) == (second["ks_ptr"], second["ke_ptr"])
    assert first["ks"].tolist() == [0] * 20
    assert first["ke"].tolist() == causal_counts(3, range(20), 1, 20)
    assert topk_inputs[-1]["seq_lens"].tolist() == first["ke"].tolist()
    by_tensor = indexer_select(ops, topk=5, q_causal_offsets=torch.tensor([3]), backend="deepgemm")
    assert fake.calls[-1]["ke_ptr"] != first["ke_ptr"]  # a tensor offset's counts: its own
    assert torch.equal(picks, by_tensor)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_select_frees_each_chunks_logits_before_the_next_launch(fake, layout):
    """At most one chunk of DeepGEMM's logits exists: the peak memory the chunk budget bounds."""
    fake.keep = False
    if layout == "bshd":
        indexer_select(_ops(b=2, sq=20, sk=20), topk=4, backend="deepgemm", chunk_bytes=1)
    else:
        cu = cu_seqlens([9, 11])
        indexer_select_varlen(_ops(b=1, sq=20, sk=20), topk=4, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=11, max_seqlen_k=11, backend="deepgemm",
                              chunk_bytes=1)  # fmt: skip
    assert len(fake.calls) == 3
    assert [c["alive"] for c in fake.calls] == [0, 0, 0]


def test_select_ties_go_to_the_lower_key_and_short_rows_pad_with_minus_one(fake):
    """Every written logit equal (stand-in of all-zero q and k): each row picks its first keys."""
    fake.mode = "operands"
    ops = _ops(b=1, sq=6, sk=6)
    zero = type(ops)(torch.zeros_like(ops.q), torch.zeros_like(ops.k), ops.weights,
                     ops.q_descale, ops.k_descale)  # fmt: skip
    picks = indexer_select(zero, topk=3, backend="deepgemm")
    want = [[j if j <= min(i, 2) else -1 for j in range(3)] for i in range(6)]
    assert picks[0].tolist() == want


def test_select_varlen_is_one_launch_read_in_place(fake, topk_inputs):
    fake.mode = "operands"
    ops = _ops(b=1, sq=13, sk=14)
    picks = indexer_select_varlen(
        ops, topk=4, cu_seqlens_q=cu_seqlens(_LENS_Q), cu_seqlens_k=cu_seqlens(_LENS_K),
        max_seqlen_q=6, max_seqlen_k=8, q_causal_offsets=torch.tensor(_OFFSETS),
        backend="deepgemm",
    )  # fmt: skip
    (call,) = fake.calls
    starts, counts = _varlen_windows(1)
    assert call["ks"].tolist() == starts and call["max_seqlen_k"] == 8
    (seen,) = topk_inputs
    assert seen["scores"].data_ptr() == fake.buffers[0].data_ptr()
    assert seen["seq_lens"].tolist() == counts
    # The deterministic top-k of each row's window of the stand-in scores.
    scores = stand_in_scores(ops.q, ops.k.unsqueeze(2))[0]
    for t in range(13):
        window = scores[t, starts[t] : starts[t] + counts[t]]
        want = indexer_topk(window, 4, backend="torch").tolist()
        assert picks[t].tolist() == want, t


def test_auto_takes_deepgemm_for_fp8_where_it_serves_the_call(fake):
    """'auto' is the fastest exact kernel present: DeepGEMM for FP8 (the fake stands in for an
    importable DeepGEMM on SM90); a call writing into ``out=`` (DeepGEMM returns its own
    buffer) and BF16 operands go elsewhere (here the torch reference: no cuDNN)."""
    ops = _ops()
    reset_scoring_calls()
    indexer_scores(ops)
    indexer_select(ops, topk=4)
    assert len(fake.calls) == 2 and scoring_calls("fp8", "deepgemm") == 2
    out = torch.empty(2, 9, 13)
    assert indexer_scores(ops, out=out) is out and scoring_calls("fp8", "torch") == 1
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 9, 32, 128, generator=g), torch.randn(2, 13, 128, generator=g)
    bf16 = prepare_scoring_operands(q, k, torch.randn(2, 9, 32, generator=g), config=BF16)
    indexer_select(bf16, topk=4)
    assert len(fake.calls) == 2 and scoring_calls("bf16", "torch") == 1


def test_select_counts_its_deepgemm_calls(fake):
    reset_scoring_calls()
    indexer_select(_ops(b=2, sq=20, sk=20), topk=4, backend="deepgemm", chunk_bytes=1)
    assert scoring_calls("fp8", "deepgemm") == 3 == len(fake.calls)


def test_a_layout_other_than_row_major_rows_raises(monkeypatch):
    fn = FakeMqaLogits()

    def transposed(*args, **kwargs):
        return fn(*args, **kwargs).t().contiguous().t()  # column-major (rows, columns)

    transposed.q_pair = True
    install(monkeypatch, transposed)
    with pytest.raises(RuntimeError, match="expected row-major rows"):
        indexer_select(_ops(b=1, sq=8, sk=8), topk=2, backend="deepgemm")


# ------------------------------------------------------------------ DeepGEMM's modes


def _module_with_modes(deterministic, fail=None):
    """A ``deep_gemm`` with DeepGEMM 2.8.1's process-wide modes: each setter
    (``use_deterministic_algorithms(bool)``, ``set_pdl``, ``set_num_sms``, ``set_tc_util``) writes
    ``module.modes`` and records the call in ``module.set_calls`` (2.8.1 has no getter for the
    first: ``modes`` is the test's window on the flags). Its ``fp8_fp4_mqa_logits`` (2.8's
    signature) records in ``module.seen`` the modes each launch runs under, then answers as the
    fake kernel does, or raises ``fail``."""
    module = types.ModuleType("deep_gemm")
    module.modes = {"deterministic": deterministic, "pdl": False, "num_sms": 132, "tc_util": 100}
    module.set_calls, module.seen = [], []
    setters = {"use_deterministic_algorithms": "deterministic", "set_pdl": "pdl",
               "set_num_sms": "num_sms", "set_tc_util": "tc_util"}  # fmt: skip
    for setter, mode in setters.items():

        def set_mode(value, setter=setter, mode=mode):
            module.set_calls.append((setter, value))
            module.modes[mode] = value

        setattr(module, setter, set_mode)
    kernel = FakeMqaLogits()

    def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k,
                           schedule_meta=None):  # fmt: skip
        module.seen.append(dict(module.modes))
        if fail is not None:
            raise fail
        return kernel(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, False, max_seqlen_k)

    module.fp8_fp4_mqa_logits = fp8_fp4_mqa_logits
    return module


@pytest.mark.parametrize("deterministic", [False, True])
def test_deepgemms_modes_are_left_as_the_caller_set_them(fresh_import, deterministic):
    """Issue 49: DeepGEMM's determinism flag is process-wide (an engine's own DeepGEMM GEMMs in
    the same process read it) and its SM90 logits kernel reads it nowhere: every launch runs
    under the modes the caller set, which are the same after; no setter is called."""
    module = _module_with_modes(deterministic)
    entry, _ = _detected(fresh_import, module)
    assert entry.module is module
    before = dict(module.modes)
    indexer_select(_ops(b=2, sq=20, sk=20), topk=4, backend="deepgemm", chunk_bytes=1)  # 3 chunks
    indexer_scores(_ops(b=1), backend="deepgemm")  # full causal scores
    indexer_scores(_ops(b=2), backend="deepgemm", clean=False)
    assert module.seen == [before] * 5
    assert module.modes == before and module.set_calls == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_launch_that_raises_leaves_deepgemms_modes_too(fresh_import, deterministic):
    module = _module_with_modes(deterministic, fail=RuntimeError("DG_HOST_ASSERT failed"))
    _detected(fresh_import, module)
    before = dict(module.modes)
    with pytest.raises(RuntimeError, match="DG_HOST_ASSERT failed"):
        indexer_select(_ops(b=2, sq=20, sk=20), topk=4, backend="deepgemm")
    assert module.seen == [before]
    assert module.modes == before and module.set_calls == []


# ------------------------------------------------------------- why DeepGEMM cannot run


def test_explicit_deepgemm_raises_with_the_reason():
    q, k = torch.randn(1, 4, 32, 128), torch.randn(1, 4, 128)
    w = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*FP8 operands only.*'fp8'"):
        indexer_scores(q, k, w, config=BF16, backend="deepgemm")
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*on cpu.*CUDA"):
        indexer_scores(q, k, w, config=FP8, backend="deepgemm")
    with pytest.raises(RuntimeError, match=r"backend='deepgemm'.*on cpu.*CUDA"):
        indexer_select(q, k, w, topk=2, config=FP8, backend="deepgemm")


def test_unsupported_reasons(monkeypatch):
    reason = deepgemm_backend._mqa_logits_unsupported_reason
    fp8 = ScoringPrecision.FP8
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(10, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (object(), None))
    assert "SM100" in reason(device=cuda, precision=fp8, n_heads=64, head_dim=128)
    capability[0] = (9, 0)
    assert reason(device=cuda, precision=fp8, n_heads=64, head_dim=128) is None
    assert "16 heads" in reason(device=cuda, precision=fp8, n_heads=16, head_dim=128)
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (None, "not importable (hint)"))
    assert reason(device=cuda, precision=fp8, n_heads=64, head_dim=128) == "not importable (hint)"


@pytest.fixture
def fresh_import(monkeypatch):
    """Run ``deepgemm_backend._import`` against stand-in modules, uncached, and restore it after."""
    for name in deepgemm_backend._MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    deepgemm_backend._import.cache_clear()
    yield monkeypatch
    deepgemm_backend._import.cache_clear()


# Never read: the call must fail before it reaches a kernel.
_NO_OPERANDS = (torch.empty(1, 32, 128), (torch.empty(1, 128), torch.empty(1)), torch.empty(1, 32),
                torch.ones(1, dtype=torch.int32))  # fmt: skip


class _NoSignature:
    """A callable without an introspectable signature (as pybind11 functions), its docstring
    ``doc``."""

    __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature")))

    def __init__(self, fn, doc):
        self.fn = fn
        self.calls = fn.calls
        self.__doc__ = doc

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _module(name, legacy=None, fp4=None):
    module = types.ModuleType(name)
    if legacy is not None:
        module.fp8_mqa_logits = legacy
    if fp4 is not None:
        module.fp8_fp4_mqa_logits = fp4
    return module


def _call():
    return indexer_scores(_ops(b=1, sq=3, sk=3), backend="deepgemm")


def _detected(fresh_import, module):
    fresh_import.setitem(sys.modules, "deep_gemm", module)
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)  # import fails
    fresh_import.setattr(deepgemm_backend, "_mqa_logits_unsupported_reason", lambda **kw: None)
    return deepgemm_backend._import()


def test_feature_detection_takes_the_first_module_with_an_entry_point(fresh_import):
    fn = _NoSignature(FakeMqaLogits(), FP8_FP4_DOC)
    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm"))  # neither function
    fresh_import.setitem(sys.modules, "vllm", _module("vllm"))
    fresh_import.setitem(sys.modules, "vllm.third_party", _module("vllm.third_party"))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", _module("vdg", fp4=fn))
    fresh_import.setattr(deepgemm_backend, "_mqa_logits_unsupported_reason", lambda **kw: None)
    assert deepgemm_backend._deepgemm_available()
    assert deepgemm_backend._entry_point() == "vllm.third_party.deep_gemm.fp8_fp4_mqa_logits"
    _call()
    assert len(fn.calls) == 1


def test_54e2261_is_called_through_fp8_fp4_mqa_logits(fresh_import):
    """Both names (54e2261): the current one, with ``(q, None)``; the legacy one is its wrapper."""
    legacy = _NoSignature(FakeMqaLogits(q_pair=False), LEGACY_DOC)
    fp4 = _NoSignature(FakeMqaLogits(), FP8_FP4_DOC)
    entry, _ = _detected(fresh_import, _module("deep_gemm", legacy, fp4))
    assert entry.name == "deep_gemm.fp8_fp4_mqa_logits" and entry.q_pair
    assert entry.clean_logits_arg
    _call()
    assert len(fp4.calls) == 1 and not legacy.calls


def test_the_legacy_name_with_max_seqlen_k_is_called_alone(fresh_import):
    legacy = _NoSignature(FakeMqaLogits(q_pair=False), LEGACY_DOC)
    entry, _ = _detected(fresh_import, _module("deep_gemm", legacy))
    assert entry.name == "deep_gemm.fp8_mqa_logits" and not entry.q_pair
    indexer_select(_ops(b=2, sq=4, sk=4), topk=2, backend="deepgemm")
    (call,) = legacy.calls
    assert call["max_seqlen_k"] == 4 and call["clean_logits"] is False


def test_deepgemm_2_8_is_called_without_clean_logits(fresh_import):
    """DeepGEMM 2.8 (vLLM 0.31+): only ``fp8_fp4_mqa_logits``, ``max_seqlen_k`` required, no
    ``clean_logits``; read from its Python signature."""
    fake = FakeMqaLogits()
    calls = []

    def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k,
                           schedule_meta=None):  # fmt: skip
        calls.append(dict(max_seqlen_k=max_seqlen_k, schedule_meta=schedule_meta))
        return fake(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, False, max_seqlen_k)

    entry, _ = _detected(fresh_import, _module("deep_gemm", fp4=fp8_fp4_mqa_logits))
    assert entry.q_pair and not entry.clean_logits_arg
    assert deepgemm_backend._entry_point() == "deep_gemm.fp8_fp4_mqa_logits"
    got = _call()
    assert calls == [dict(max_seqlen_k=3, schedule_meta=None)]
    assert got[0].tolist() == [[i * 1000 + j if j <= i else float("-inf") for j in range(3)]
                               for i in range(3)]  # fmt: skip


def test_feature_detection_reports_each_failure(fresh_import):
    def unknown(*args):
        """fp8_mqa_logits(a: int) -> int"""

    fresh_import.setitem(sys.modules, "deep_gemm", _module("deep_gemm", unknown))
    fresh_import.setitem(sys.modules, "vllm.third_party.deep_gemm", None)  # import fails
    assert not deepgemm_backend._deepgemm_available() and deepgemm_backend._entry_point() is None
    _, reason = deepgemm_backend._import()
    assert "deep_gemm.fp8_mqa_logits takes no max_seqlen_k" in reason
    assert "vllm.third_party.deep_gemm" in reason and "DeepGEMM" in reason
    with pytest.raises(ImportError, match="not importable"):
        deepgemm_backend._window_logits(*_NO_OPERANDS, torch.ones(1, dtype=torch.int32), 1)


def test_deepgemm_before_2_2_is_reported_not_called(fresh_import):
    """``fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits)`` (DeepGEMM 2.0-2.1): no compressed
    form, so no one-launch packed call; reported with the version needed."""
    called = []

    def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=True):
        called.append(True)

    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits=True):
        called.append(True)

    module = _module("deep_gemm", fp8_mqa_logits, fp8_fp4_mqa_logits)
    entry, reason = _detected(fresh_import, module)
    assert entry is None
    assert "deep_gemm.fp8_fp4_mqa_logits takes no max_seqlen_k" in reason
    assert "deep_gemm.fp8_mqa_logits takes no max_seqlen_k" in reason
    assert "DeepGEMM 2.2 and later" in reason
    with pytest.raises(ImportError, match="takes no max_seqlen_k"):
        deepgemm_backend._causal_logits(*_NO_OPERANDS)
    assert not called
