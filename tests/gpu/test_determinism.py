"""Bit-exact replays of the kernel paths on an SM90 GPU (dsa_precision.testing.
assert_replays_bit_exact; registered per source file in tests/determinism/manifest.py): cuDNN
scoring (BSHD, THD), the radix top-k, chunked selection, DeepGEMM, the fused preprocess+quantize
kernel behind prepare_scoring_operands, the fused indexer + sparse attention."""

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    IndexerPreprocess,
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_select_varlen,
    indexer_topk,
    prepare_scoring_operands,
)
from dsa_precision.backends import deepgemm as deepgemm_backend
from dsa_precision.preprocess import _indexer_head_weights
from dsa_precision.testing import assert_replays_bit_exact

from ..support.configs import CONFIGS, FP8
from ..support.fused_attention import fused_indexer_sparse_attention
from ..support.helpers import needs_deepgemm

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _qkw(b, s, h, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (
        torch.randn(b, s, h, 128, device=DEV, generator=g).to(dtype),
        torch.randn(b, s, 1, 128, device=DEV, generator=g).to(dtype),
        (torch.randn(b, s, h, device=DEV, generator=g) * 0.02).to(torch.bfloat16),
    )


def _packed(lens, h=64, seed=6):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(DEV)
    return (
        torch.randn(t, h, 128, device=DEV, generator=g),
        torch.randn(t, 128, device=DEV, generator=g),
        (torch.randn(t, h, device=DEV, generator=g) * 0.02).to(torch.bfloat16),
        cu,
    )


# ---------------------------------------------------------------------- scoring.py


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("contention", [False, True])
def test_scoring_replays_bit_exact(precision, contention):
    q, k, w = _qkw(2, 1024, 64)

    def score(q, k, w):
        return indexer_scores(
            q, k, w, config=CONFIGS[precision], ratio=2, q_causal_offsets=7, backend="cudnn"
        )

    assert_replays_bit_exact(score, (q, k, w), contention=contention, what=f"{precision} scoring")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_varlen_scoring_replays_bit_exact(precision):
    q, k, w, cu = _packed([1000, 17, 2500, 579])

    def score(q, k, w):
        return indexer_scores_varlen(
            q, k, w, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2500, max_seqlen_k=2500,
            config=CONFIGS[precision], backend="cudnn",
        )  # fmt: skip

    assert_replays_bit_exact(score, (q, k, w), contention=True, what=f"THD {precision}")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_non_finite_inputs_replay_and_stay_non_finite(precision):
    q, k, w = _qkw(1, 512, 64)
    q[0, 100, 3, 7] = float("nan")
    k[0, 200, 0, 5] = float("inf")

    def score_and_pick(q, k, w):
        s = indexer_scores(q, k, w, config=CONFIGS[precision], backend="cudnn")
        return s, indexer_topk(s, 64, backend="cudnn")

    scores, picks = assert_replays_bit_exact(
        score_and_pick, (q, k, w), what=f"non-finite {precision}"
    )
    assert torch.isnan(scores[0, 100, :101]).all()  # the bad query row (NaN head weight)
    assert torch.isfinite(scores[0, 300, :200]).all()
    assert (picks[0, 100] == -1).all()
    if precision == "fp8":  # a non-finite key has a NaN descale: NaN wherever it is visible
        assert torch.isnan(scores[0, 200:, 200]).all() and not (picks == 200).any()


# ------------------------------------------------------------------------- topk.py


def test_topk_replays_bit_exact():
    g = torch.Generator(device=DEV).manual_seed(3)
    scores = torch.round(torch.randn(4, 512, 8192, device=DEV, generator=g) * 4) / 4  # many ties
    seq_lens = torch.randint(0, 8193, (4, 512), device=DEV, generator=g, dtype=torch.int32)
    # -inf and NaN inside the rows' lengths: the one-pass fix-up (kernels/topk_picks.py) drops them.
    holes = torch.rand(scores.shape, device=DEV, generator=g)
    scores = scores.masked_fill(holes < 0.3, float("-inf")).masked_fill(holes > 0.999, float("nan"))

    def pick(s, n):
        return indexer_topk(s, 2048, seq_lens=n, backend="cudnn")

    picks = assert_replays_bit_exact(pick, (scores, seq_lens), contention=True, what="top-k")
    picked = scores.gather(-1, picks.clamp(min=0).long())
    assert bool(((picks < 0) | (picked > float("-inf"))).all()), "a -inf or NaN score was picked"
    # The rows as one 2-D tensor with 1-D int32 lengths (indexer_select's form, which skips the
    # reshapes and the cast) and with int64 lengths: the same picks.
    flat = assert_replays_bit_exact(
        pick, (scores.view(-1, 8192), seq_lens.view(-1)), what="top-k, 2-D scores"
    )
    assert torch.equal(flat.view(4, 512, 2048), picks)
    assert torch.equal(pick(scores, seq_lens.long()), picks)


# ------------------------------------------------------------------------ select.py


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_select_replays_bit_exact(precision):
    q, k, w = _qkw(1, 4096, 64)

    def select(q, k, w):  # 512-row chunks (float32 scores + top-k scratch, 12 bytes a score)
        return indexer_select(
            q, k, w, topk=2048, config=CONFIGS[precision], backend="cudnn",
            chunk_bytes=512 * 4096 * 12,
        )  # fmt: skip

    assert_replays_bit_exact(select, (q, k, w), contention=True, what=f"chunked select {precision}")


def test_chunked_select_varlen_replays_bit_exact():
    q, k, w, cu = _packed([700, 33, 1500, 301])

    def select(q, k, w):  # 256-row chunks cut three of the four sequences
        return indexer_select_varlen(
            q, k, w, topk=512, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500,
            max_seqlen_k=1500, config=FP8, backend="cudnn",
            chunk_bytes=256 * 1500 * 12,
        )  # fmt: skip

    assert_replays_bit_exact(select, (q, k, w), contention=True, what="chunked THD select")


# ---------------------------------------------------------------------- deepgemm_backend.py


@needs_deepgemm
def test_deepgemm_replays_bit_exact():
    """Scores of two batch rows: one launch (rows flattened into key windows), tails masked."""
    q, k, w = _qkw(2, 2048, 64)

    def score(q, k, w):
        ops = prepare_scoring_operands(q, k, w, config=FP8)
        return indexer_scores(ops, q_causal_offsets=5, backend="deepgemm")

    assert_replays_bit_exact(score, (q, k, w), contention=True, what="DeepGEMM")


def _legacy_entry_point(monkeypatch) -> None:
    """Make the package call the legacy name ``fp8_mqa_logits(q, ..., max_seqlen_k)`` (a wrapper
    of ``fp8_fp4_mqa_logits`` in 54e2261) through the host build."""
    name = deepgemm_backend._entry_point().rsplit(".", 1)[0]
    module = __import__(name, fromlist=["fp8_mqa_logits"])
    if not hasattr(module, "fp8_mqa_logits"):
        pytest.skip(f"{name} has no fp8_mqa_logits")
    legacy = type("Legacy", (), {"fp8_mqa_logits": staticmethod(module.fp8_mqa_logits)})
    entry, reason = deepgemm_backend._resolve(legacy, name)
    assert entry is not None and not entry.q_pair, reason
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (entry, None))


@needs_deepgemm
@pytest.mark.parametrize("entry_point", ["detected", "legacy"])
def test_deepgemm_varlen_replays_bit_exact(monkeypatch, entry_point):
    """Packed sequences: each row's key window found by its packed sequence, one launch; through
    the entry point the package detects, and through the legacy name."""
    if entry_point == "legacy":
        _legacy_entry_point(monkeypatch)
    q, k, w, cu = _packed([700, 33, 1500, 301])

    def score(q, k, w):
        return indexer_scores_varlen(
            q, k, w, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500,
            config=FP8, backend="deepgemm",
        )  # fmt: skip

    assert_replays_bit_exact(
        score, (q, k, w), contention=True, what=f"DeepGEMM varlen, {entry_point}"
    )


@needs_deepgemm
@pytest.mark.parametrize("entry_point", ["detected", "legacy"])
@pytest.mark.parametrize("chunk_bytes", [None, 64 << 20])
def test_deepgemm_select_replays_bit_exact(monkeypatch, chunk_bytes, entry_point):
    """The new path: one DeepGEMM launch per chunk, its uncleaned logits read in place by the
    radix top-k (bounded by each row's length, each chunk's logits freed before the next launch);
    BSHD with two batch rows and packed sequences; through the detected entry point and the
    legacy name."""
    if entry_point == "legacy":
        _legacy_entry_point(monkeypatch)
    q, k, w = _qkw(2, 4096, 64, seed=3)
    pq, pk, pw, cu = _packed([1700, 33, 2900, 301], seed=8)

    def select(q, k, w, pq, pk, pw):
        ops = prepare_scoring_operands(
            q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8")
        )
        bshd = indexer_select(
            ops, topk=2048, q_causal_offsets=torch.tensor([0, 96], device=DEV),
            backend="deepgemm", chunk_bytes=chunk_bytes,
        )  # fmt: skip
        thd = indexer_select_varlen(
            pq, pk, pw, topk=2048, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2900,
            max_seqlen_k=2900, config=IndexerPrecisionConfig(scoring_precision="fp8"), backend="deepgemm",
            chunk_bytes=chunk_bytes,
        )  # fmt: skip
        return bshd, thd

    assert_replays_bit_exact(
        select, (q, k, w, pq, pk, pw), contention=True,
        what=f"DeepGEMM select, {chunk_bytes}, {entry_point}",
    )  # fmt: skip


# ------------------------------------------------------- operands (fused Triton kernel)


def test_prepare_scoring_operands_replays_bit_exact():
    q, k, w = _qkw(2, 2048, 64)

    def prepare(q, k, w):
        return prepare_scoring_operands(q, k, w, config=FP8, impl="triton")

    ops = assert_replays_bit_exact(prepare, (q, k, w), contention=True, what="fused prepare")
    ref = prepare_scoring_operands(q, k, w, config=FP8, impl="torch")
    for name in ("q", "k", "weights", "q_descale", "k_descale"):
        a, b = getattr(ops, name), getattr(ref, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("hadamard", [False, True])
def test_fp32_preprocessing_route_replays_and_keeps_dtypes(hadamard):
    g = torch.Generator(device=DEV).manual_seed(4)
    pre = IndexerPreprocess(128, 64, rotate_activation=hadamard, rope_fp32=True).to(DEV)
    q = torch.randn(2048, 1, 32, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(2048, 1, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, 1, 32, device=DEV, generator=g).to(torch.bfloat16)
    freqs = torch.rand(2048, 1, 1, 64, device=DEV, generator=g) * 100

    def route(q, k, w):
        qq, kk = pre(q, k, freqs)
        ww = _indexer_head_weights(w, n_heads=32, head_dim=128, fp32=False)
        return qq, kk, ww

    qq, kk, ww = assert_replays_bit_exact(route, (q, k, w), what="rope_fp32 preprocessing")
    assert qq.dtype == kk.dtype == torch.float32 and ww.dtype == torch.bfloat16


# ---------------------------------------------- fused indexer + sparse attention


def _fused_inputs(seed=5, s=2048):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (
        torch.randn(s, 1, 16, 576, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(s, 1, 576, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(s, 1, 32, 128, device=DEV, generator=g),
        torch.randn(s, 1, 128, device=DEV, generator=g),
        (torch.randn(s, 1, 32, device=DEV, generator=g) * 0.02).float(),
    )


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_forward_replays_bit_exact(precision):
    def run(*x):
        return fused_indexer_sparse_attention(
            *x, topk=256, softmax_scale=576**-0.5, d_v=512, config=CONFIGS[precision]
        )

    assert_replays_bit_exact(run, _fused_inputs(), contention=True, what=f"fused {precision}")


def test_fused_backward_replays_bit_exact_when_deterministic():
    """cuDNN's SM90 sparse backward accumulates dKV with atomics; under
    torch.use_deterministic_algorithms(True) the built-in deterministic backward runs."""

    def run(*x):
        out, _, _ = fused_indexer_sparse_attention(
            *x, topk=256, softmax_scale=576**-0.5, d_v=512, config=FP8
        )
        return out

    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        assert_replays_bit_exact(run, _fused_inputs(s=1024), backward=True, what="fused backward")
    finally:
        torch.use_deterministic_algorithms(False)


def test_tie_rows_and_digests_replay_bit_exact():
    """engine_tie_rows and digest_rows on CUDA: the Triton count and digest kernels."""
    from dsa_precision.capture import digest_rows, engine_tie_rows

    g = torch.Generator(device=DEV).manual_seed(8)
    logits = torch.randint(0, 3, (512, 4096), device=DEV, generator=g).float()
    lengths = torch.randint(1, 4097, (512,), device=DEV, generator=g)
    picks = indexer_topk(logits, 256, seq_lens=lengths)

    def frame(logits, picks, lengths):
        tied = engine_tie_rows(logits, picks, lengths)
        return tied.digests, tied.rows, tied.picks

    digests, rows, _ = assert_replays_bit_exact(frame, (logits, picks, lengths), what="tie rows")
    assert rows.numel() > 0
    assert torch.equal(assert_replays_bit_exact(digest_rows, (picks,), what="digests"), digests)
