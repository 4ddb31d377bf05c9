"""indexer_select / indexer_select_varlen on the torch backend (CPU) against scoring everything and
selecting (indexer_topk(indexer_scores(...))), bit for bit, for chunk budgets that split the query
rows (and cut packed sequences), and against the per-row Python top-k reference."""

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_select_varlen,
    indexer_topk,
    prepare_scoring_operands,
    reset_scoring_calls,
    scoring_calls,
)
from dsa_precision.scoring import causal_key_counts

from .helpers import causal_counts, cu_seqlens, reference_topk_rows

BF16, FP8 = IndexerPrecisionConfig(), IndexerPrecisionConfig(scoring_precision="fp8")
CONFIGS = {"bf16": BF16, "fp8": FP8}

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


def test_default_chunking_is_one_launch_up_to_4_gib_then_1_gib_chunks():
    from dsa_precision.select import DEFAULT_CHUNK_BYTES, UNCHUNKED_MAX_BYTES, _chunk_rows

    per_row = 16384 * 12  # S_k = 16384, 12 bytes per score
    assert 16384 * per_row <= UNCHUNKED_MAX_BYTES
    assert _chunk_rows(None, 16384, per_row) == 16384  # S = 16384: one launch
    assert _chunk_rows(None, 0, per_row) == 1
    big = 65536 * 12
    rows = _chunk_rows(None, 65536, big)  # S = 65536: 1 GiB chunks of whole 512-row tiles
    assert rows * big <= DEFAULT_CHUNK_BYTES < (rows + 512) * big and rows % 512 == 0
    assert _chunk_rows(DEFAULT_CHUNK_BYTES, 16384, per_row) == 5120  # an explicit budget binds
