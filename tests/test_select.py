"""indexer_select / indexer_select_varlen on the torch backend (CPU) against scoring everything and
selecting (indexer_topk(indexer_scores(...))), bit for bit, for chunk budgets that split the query
rows (and cut packed sequences), and against the per-row Python top-k reference."""

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
from dsa_precision.rows import causal_key_counts

from .support.configs import BF16, CONFIGS, FP8
from .support.helpers import causal_counts, cu_seqlens, reference_topk_rows

# 8-row chunks (the smallest), a few 8-row tiles, and one chunk.
CHUNK_BYTES = [1, 40 * 2 * 41 * 12, 1 << 30]


def _inputs(b=2, sq=37, sk=41, h=32):
    q = torch.randn(b, sq, h, 128)
    k = torch.randn(b, sk, 128)
    w = (torch.randn(b, sq, h) * 0.02).to(torch.bfloat16)
    return q, k, w


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("chunk_bytes", CHUNK_BYTES, ids=["8rows", "some_tiles", "one_chunk"])
@pytest.mark.parametrize(
    "ratio, offsets",
    [(1, None), (1, 4), (4, "tensor")],
    ids=["ratio1", "ratio1_int_offset", "ratio4_tensor_offsets"],
)
def test_select_equals_scores_then_topk(precision, chunk_bytes, ratio, offsets):
    q, k, w = _inputs(sk=41 if ratio == 1 else 13)
    if offsets == "tensor":
        offsets = torch.tensor([0, 9])
    kw = dict(config=CONFIGS[precision], ratio=ratio, q_causal_offsets=offsets, backend="torch")
    scores = indexer_scores(q, k, w, **kw)
    want = indexer_topk(scores, 6, backend="torch")
    got = indexer_select(q, k, w, topk=6, chunk_bytes=chunk_bytes, **kw)
    assert got.dtype == torch.int32 and got.shape == (2, 37, 6)
    assert torch.equal(got, want), f"{precision} chunk_bytes={chunk_bytes}"
    assert got.reshape(-1, 6).tolist() == reference_topk_rows(scores, 6)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_causal_seq_lens_select_what_the_masked_scores_select(precision):
    q, k, w = _inputs(sq=21, sk=29)
    scores = indexer_scores(q, k, w, config=CONFIGS[precision], q_causal_offsets=3)
    lens = causal_key_counts(torch.tensor([3, 3]), 0, 21, 1, 29)
    assert lens.tolist() == [causal_counts(3, range(21), 1, 29)] * 2
    a = indexer_topk(scores, 5, seq_lens=lens, backend="torch")
    assert torch.equal(a, indexer_topk(scores, 5, backend="torch"))
    got = indexer_select(
        q, k, w, topk=5, config=CONFIGS[precision], q_causal_offsets=3, chunk_bytes=1
    )
    assert torch.equal(got, a)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_prepared_operands_select_exactly_like_carriers(precision):
    q, k, w = _inputs(sq=19, sk=19)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision], sm_scale=0.5)
    a = indexer_select(ops, topk=4, chunk_bytes=1, backend="torch")
    b = indexer_select(
        q, k, w, topk=4, config=CONFIGS[precision], sm_scale=0.5, chunk_bytes=1, backend="torch"
    )
    assert torch.equal(a, b)


def test_select_counts_one_scoring_call_per_chunk():
    q, k, w = _inputs(sq=37, sk=41)
    reset_scoring_calls()
    indexer_select(q, k, w, topk=3, config=FP8, chunk_bytes=1, backend="torch")
    assert scoring_calls("fp8", "torch") == 5  # ceil(37 / 8) chunks of 8 rows


def test_topk_above_the_key_count_pads_with_minus_one():
    q, k, w = _inputs(b=1, sq=5, sk=5)
    got = indexer_select(q, k, w, topk=8, config=BF16, backend="torch")
    for row in range(5):
        assert got[0, row].tolist() == list(range(row + 1)) + [-1] * (7 - row)


def test_deterministic_false_selects_a_valid_set():
    q, k, w = _inputs(sq=17, sk=17)
    scores = indexer_scores(q, k, w, config=FP8, backend="torch")
    exact = indexer_select(q, k, w, topk=5, config=FP8, chunk_bytes=1)
    loose = indexer_select(q, k, w, topk=5, config=FP8, chunk_bytes=1, deterministic=False)
    for b in range(2):
        for r in range(17):
            picks = [i for i in loose[b, r].tolist() if i != -1]
            assert len(picks) == len(set(picks)) == min(5, r + 1)
            assert all(0 <= i <= r for i in picks)
            # The same scores where the picks differ (exact ties only).
            assert sorted(scores[b, r, picks].tolist()) == sorted(
                scores[b, r, [i for i in exact[b, r].tolist() if i != -1]].tolist()
            )


@pytest.mark.parametrize("sq, sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_bshd(sq, sk):
    q, k, w = _inputs(b=2, sq=sq, sk=sk)
    got = indexer_select(q, k, w, topk=4, config=FP8, backend="torch")
    assert got.shape == (2, sq, 4) and (got == -1).all()


# -------------------------------------------------------------------------------- varlen


def _packed(lens_q, lens_k, h=32):
    q = torch.randn(sum(lens_q), h, 128)
    k = torch.randn(sum(lens_k), 128)
    w = (torch.randn(sum(lens_q), h) * 0.02).to(torch.bfloat16)
    return q, k, w, cu_seqlens(lens_q), cu_seqlens(lens_k)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("chunk_bytes", [1, 16 * 19 * 12, 1 << 30], ids=["8rows", "16rows", "one"])
@pytest.mark.parametrize(
    "ratio, offsets", [(1, None), (2, 3), (1, "tensor")], ids=["plain", "ratio2_int", "tensor"]
)
def test_select_varlen_equals_scores_then_topk(precision, chunk_bytes, ratio, offsets):
    """8- and 16-row chunks cut the packed sequences [5, 0, 17, 9, 3] inside 3 of them."""
    lens_q, lens_k = [5, 0, 17, 9, 3], [5, 2, 17, 12, 0]
    q, k, w, cu_q, cu_k = _packed(lens_q, lens_k)
    if offsets == "tensor":
        offsets = torch.tensor([0, 1, 0, 3, 2])
    kw = dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=17,
        max_seqlen_k=19,
        config=CONFIGS[precision],
        ratio=ratio,
        q_causal_offsets=offsets,
        backend="torch",
    )
    scores = indexer_scores_varlen(q, k, w, **kw)
    want = indexer_topk(scores, 7, backend="torch")
    got = indexer_select_varlen(q, k, w, topk=7, chunk_bytes=chunk_bytes, **kw)
    assert got.dtype == torch.int32 and got.shape == (34, 7)
    assert torch.equal(got, want), f"{precision} chunk_bytes={chunk_bytes} offsets={offsets}"
    assert got.tolist() == reference_topk_rows(scores, 7)
    # Sequence-local key indices: never past the sequence's own keys.
    for i, n in enumerate(lens_q):
        rows = got[int(cu_q[i]) : int(cu_q[i]) + n]
        assert (rows < lens_k[i]).all()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_select_varlen_operands_and_carriers_agree(precision):
    lens = [11, 4, 9]
    q, k, w, cu, _ = _packed(lens, lens)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11, max_seqlen_k=11, topk=3)
    ops = prepare_scoring_operands(q[None], k[None], w[None], config=CONFIGS[precision])
    a = indexer_select_varlen(ops, chunk_bytes=1, backend="torch", **kw)
    b = indexer_select_varlen(
        q, k, w, config=CONFIGS[precision], chunk_bytes=1, backend="torch", **kw
    )
    assert torch.equal(a, b)


def test_select_varlen_empty():
    empty = cu_seqlens([0, 0])
    q, k, w, _, _ = _packed([0], [0])
    got = indexer_select_varlen(
        q, k, w, topk=4, cu_seqlens_q=empty, cu_seqlens_k=empty, max_seqlen_q=0, max_seqlen_k=0,
        config=BF16, backend="torch",
    )  # fmt: skip
    assert got.shape == (0, 4)
    q, k, w, cu_q, cu_k = _packed([3], [0])
    got = indexer_select_varlen(
        q, k, w, topk=2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=0,
        config=FP8, backend="torch",
    )  # fmt: skip
    assert got.tolist() == [[-1, -1]] * 3


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_non_finite_keys_and_queries_are_never_selected(precision):
    lens = [9, 14]
    q, k, w, cu, _ = _packed(lens, lens)
    q[3, 2, 5] = float("nan")  # sequence 0, row 3
    k[9 + 4, 1] = float("inf")  # sequence 1, key 4
    got = indexer_select_varlen(
        q, k, w, topk=20, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=14, max_seqlen_k=14,
        config=CONFIGS[precision], chunk_bytes=1, backend="torch",
    )  # fmt: skip
    assert (got[3] == -1).all()
    assert not (got[9:] == 4).any()
    assert got[9 + 5].tolist() == [0, 1, 2, 3, 5] + [-1] * 15


def test_default_chunking_is_one_launch_up_to_4_gib_then_4_gib_chunks():
    from dsa_precision.select import _DEFAULT_CHUNK_BYTES, _chunk_rows

    assert _DEFAULT_CHUNK_BYTES == 4 << 30
    per_row = 16384 * 12  # S_k = 16384, 12 bytes per score
    assert _chunk_rows(None, 16384, per_row) == 16384  # S = 16384: 3 GiB, one launch
    assert _chunk_rows(None, 0, per_row) == 1
    for s in (32768, 65536, 131072):  # 4 GiB chunks of whole 512-row tiles
        rows = _chunk_rows(None, s, s * 12)
        assert rows * s * 12 <= _DEFAULT_CHUNK_BYTES < (rows + 512) * s * 12 and rows % 512 == 0
    assert _chunk_rows(None, 65536, 65536 * 12) == 5120  # 13 chunks at S = 65536
    assert _chunk_rows(1 << 30, 16384, per_row) == 5120  # an explicit budget binds
    assert _chunk_rows(1 << 30, 1000, 1 << 20) == 1000  # a call that fits is one chunk


# ---------------------------------------------------------------- margins from the one selection


def _reference_margins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``(rows,)``: the ``k``-th minus ``(k + 1)``-th largest valid score of each row of
    ``scores`` ``(rows, S_k)`` (valid: not ``-inf``, not NaN), by sorting; NaN with fewer than
    ``k + 1`` valid keys."""
    valid = scores.masked_fill(scores.isnan(), float("-inf"))
    top = valid.sort(dim=-1, descending=True).values
    if top.shape[-1] <= k:
        return torch.full(scores.shape[:-1], float("nan"))
    gap = top[:, k - 1] - top[:, k]
    return torch.where(top[:, k] > float("-inf"), gap, float("nan"))


def _tricky(q, k):
    """Ties (key 3 duplicated at 5 and 7; all keys of the last sequence equal: every score of a
    row ties) and a NaN query row (row 2: no valid key at all)."""
    k[..., [5, 7], :] = k[..., [3], :] if k.ndim == 3 else k[[3]]
    q[..., 2, :, :] = float("nan")
    return q, k


@pytest.fixture(params=["torch", "cudnn"], ids=["torch", "fake_cudnn"])
def select_backend(request, monkeypatch):
    if request.param == "cudnn":
        from .support import fake_cudnn

        fake_cudnn.install(monkeypatch)
    return request.param


@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["8rows", "one"])
def test_margins_keep_the_plain_picks_and_are_the_exact_gap(select_backend, chunk_bytes):
    q, k, w = _inputs(b=2, sq=21, sk=21)
    q, k = _tricky(q, k)
    k[1] = k[1, :1]  # batch row 1: every key the same, every row one tie
    reset_scoring_calls()
    kw = dict(config=FP8, topk=6, backend=select_backend, chunk_bytes=chunk_bytes)
    picks, margins = indexer_select(q, k, w, margins=True, **kw)
    calls = scoring_calls()
    plain = indexer_select(q, k, w, **kw)
    assert calls == scoring_calls() - calls  # one scoring call per chunk, margins or not
    assert torch.equal(picks, plain)
    assert margins.dtype == torch.float32 and margins.shape == (2, 21)
    scores = indexer_scores(q, k, w, config=FP8, backend=select_backend)
    want = _reference_margins(scores.reshape(-1, 21), 6).view(2, 21)
    torch.testing.assert_close(margins, want, rtol=0, atol=0, equal_nan=True)
    # Rows 0-5 see at most 6 keys, row 2 none: no margin; every row of batch row 1 ties.
    assert margins[:, :6].isnan().all() and margins[:, 2].isnan().all()
    assert (margins[1, 6:] == 0).all() and not margins[0, 6:].isnan().any()
    assert picks[1, 10].tolist() == list(range(6))  # the tie goes to the lower keys


@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["8rows", "one"])
def test_varlen_margins_keep_the_plain_picks_and_are_the_exact_gap(select_backend, chunk_bytes):
    lens_q, lens_k = [5, 0, 17, 9], [5, 2, 17, 12]
    q, k, w, cu_q, cu_k = _packed(lens_q, lens_k)
    q, k = _tricky(q, k)
    k[24:] = k[24]  # sequence 3: every key the same
    kw = dict(
        topk=4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=17,
        q_causal_offsets=torch.tensor([0, 1, 0, 3]), config=BF16, backend=select_backend,
        chunk_bytes=chunk_bytes,
    )  # fmt: skip
    picks, margins = indexer_select_varlen(q, k, w, margins=True, **kw)
    assert torch.equal(picks, indexer_select_varlen(q, k, w, **kw))
    score_kw = {n: kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
    scores = indexer_scores_varlen(
        q, k, w, q_causal_offsets=kw["q_causal_offsets"], config=BF16, backend=select_backend,
        **score_kw,
    )  # fmt: skip
    want = _reference_margins(scores, 4)
    torch.testing.assert_close(margins, want, rtol=0, atol=0, equal_nan=True)
    assert margins[:4].isnan().all() and margins[2].isnan()  # <= 4 keys; NaN query row
    assert (margins[22 + 1 :] == 0).all()  # sequence 3 (offset 3: >= 5 keys a row) ties


def test_margins_of_an_empty_call_are_nan():
    q, k, w = _inputs(b=1, sq=3, sk=0)
    picks, margins = indexer_select(q, k, w, topk=2, config=BF16, backend="torch", margins=True)
    assert picks.tolist() == [[[-1, -1]] * 3] and margins.isnan().all()
    with pytest.raises(
        TypeError, match=r"margins must be a bool, got 1 \(int\); pass True or False"
    ):
        indexer_select(q, k, w, topk=2, config=BF16, backend="torch", margins=1)


def test_deepgemm_margins_read_the_logits_in_place_within_each_row(monkeypatch):
    """DeepGEMM's fake leaves a huge finite value past each row's window: the margins must not
    see it (the reference: the stand-in logits under the causal windows, sorted)."""
    from .support.fake_cudnn import stand_in_scores
    from .support.fake_deepgemm import FakeMqaLogits, install

    fn = FakeMqaLogits(q_pair=True)
    install(monkeypatch, fn, "deep_gemm.fp8_fp4_mqa_logits", clean=True)
    fn.mode = "operands"
    q, k, w = _inputs(b=2, sq=20, sk=20)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    for chunk_bytes in (1, None):
        kw = dict(topk=5, q_causal_offsets=torch.tensor([0, 3]), backend="deepgemm")
        picks, margins = indexer_select(ops, margins=True, chunk_bytes=chunk_bytes, **kw)
        assert torch.equal(picks, indexer_select(ops, chunk_bytes=chunk_bytes, **kw))
        scores = stand_in_scores(ops.q, ops.k.unsqueeze(2))  # (B, S_q, S_k)
        keys = torch.arange(20)
        for i, off in enumerate([0, 3]):
            scores[i].masked_fill_(keys > torch.arange(20).unsqueeze(1) + off, float("-inf"))
        want = _reference_margins(scores.reshape(-1, 20), 5).view(2, 20)
        torch.testing.assert_close(margins, want, rtol=0, atol=0, equal_nan=True)
        assert not margins[:, 5:].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "deepgemm"])
def test_margins_on_the_gpu_keep_the_picks_without_a_sync(backend, record):
    """On the H200: the picks with margins are the plain picks bit for bit (cuDNN's radix top-k,
    k = 2048, or DeepGEMM's logits read in place), the margins are the sorted scores' gap
    exactly, and the call never waits for the host; the cost of the margins is recorded."""
    from dsa_precision.backends.deepgemm import _mqa_logits_unsupported_reason

    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, topk = 1, 4096, 64, 2048
    q = torch.randn(b, s, h, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, s, 128, device="cuda", generator=g).bfloat16()
    k[:, 100:110] = k[:, 99:100]  # ties
    w = (torch.randn(b, s, h, device="cuda", generator=g) * 0.02).bfloat16()
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    if backend == "deepgemm":
        reason = _mqa_logits_unsupported_reason(
            device=ops.device, precision=FP8.scoring_precision, n_heads=h, head_dim=128
        )
        if reason is not None:
            pytest.skip(reason)
    plain = indexer_select(ops, topk=topk, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picks, margins = indexer_select(ops, topk=topk, backend=backend, margins=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(picks, plain)
    scores = indexer_scores(ops, backend="torch" if backend == "deepgemm" else backend)[0]
    want = _reference_margins(scores, topk)
    defined = ~want.isnan()
    assert torch.equal(defined, ~margins[0].isnan()) and bool(defined[topk:].all())
    assert bool((margins[0][defined] >= 0).all())
    if backend == "cudnn":  # the same scores: the same gap, bit for bit
        torch.testing.assert_close(margins[0], want, rtol=0, atol=0, equal_nan=True)
    times = {}
    for name, kw in (("plain", {}), ("margins", {"margins": True})):
        for _ in range(3):
            indexer_select(ops, topk=topk, backend=backend, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            indexer_select(ops, topk=topk, backend=backend, **kw)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 20
    record(f"select_margins_{backend}", s=s, topk=topk, ms=times)
