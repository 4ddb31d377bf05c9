"""vLLM's own top-k kernels (its compiled ops library, ``DSA_VLLM_OPS``) on DeepGEMM's logits of
the package's FP8 operands: where they differ from the exact top-k, and the tie replay that
closes the gap. Fails if a kernel starts to differ on a row without a boundary tie, picks a set
that is no top-k, or if the rows the engine sends stop being the rows training finds tied.
Run as docs/gpu-validation.md, "The engines' top-k", says."""

import functools

import pytest
import torch

from conformance import lmdeploy_topk, sglang_topk, vllm_topk
from dsa_precision import IndexerPrecisionConfig, classify_rows, indexer_scores, indexer_topk
from dsa_precision.backends import deepgemm
from dsa_precision.capture import TieRows, engine_tie_rows
from dsa_precision.cli.demo_operands import IndexerFields, training_operands
from dsa_precision.cli.synthetic import synthetic_indexer_inputs
from dsa_precision.ties import INVALID, PRECISION, SAME, TIE, selection_margins

pytestmark = pytest.mark.gpu

SEQ, TOPK, FIRST = 8192, 2048, 4096


def _skip_reason() -> str | None:
    if not deepgemm._deepgemm_available():
        return "DeepGEMM is not importable (deep_gemm or vLLM's vllm.third_party.deep_gemm)"
    return vllm_topk.missing_reason()


@pytest.fixture(scope="module")
def logits():
    """DeepGEMM's logits of rows FIRST..SEQ-1 of the demo's synthetic projections (H 32,
    ``rope_fp32+fp8``, profile vllm), their lengths and the exact top-k."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return _scored()


@pytest.fixture(scope="module")
def engine_logits():
    """The same logits for SGLang's and LMDeploy's kernels (DeepGEMM, no vLLM ops library)."""
    if not deepgemm._deepgemm_available():
        pytest.skip("DeepGEMM is not importable (deep_gemm or vLLM's vllm.third_party.deep_gemm)")
    return _scored()


@functools.cache
def _scored():
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine="vllm")
    inputs = synthetic_indexer_inputs(SEQ, n_heads=32, seed=0).to("cuda")
    ops = training_operands(inputs, config, IndexerFields())
    s = indexer_scores(ops.rows(FIRST, SEQ), q_causal_offsets=FIRST, backend="deepgemm")[0]
    lengths = torch.arange(FIRST + 1, SEQ + 1, device="cuda", dtype=torch.int32)
    exact = indexer_topk(s, TOPK, seq_lens=lengths)
    tied = selection_margins(s, exact, lengths) == 0
    assert int(tied.sum()) > 0  # the input holds boundary ties (else the test proves nothing)
    return s.contiguous(), lengths, exact, tied


@pytest.mark.parametrize("kernel", sorted(vllm_topk.KERNELS))
def test_a_kernel_differs_from_the_exact_topk_only_by_the_choice_among_tied_keys(logits, kernel):
    s, lengths, exact, tied = logits
    step = vllm_topk.COOPERATIVE_MAX_ROWS if kernel == "cooperative" else s.shape[0]
    picks = torch.cat([
        vllm_topk.run(kernel, s[i : i + step], lengths[i : i + step], TOPK)
        for i in range(0, s.shape[0], step)
    ])  # fmt: skip
    cause = classify_rows(exact, picks, s, lengths=lengths).cause
    assert bool(((cause == SAME) | (cause == TIE)).all()), cause.unique().tolist()
    assert not bool((cause[~tied] != SAME).any())  # untied rows: the exact set
    _check_tie_replay(s, lengths, exact, tied, picks)


def test_the_digest_and_count_kernels_give_the_cpu_bits():
    """The Triton paths of ``digest_rows`` and of ``engine_tie_rows`` (on CUDA) against their
    torch paths (on the CPU), on picks and logits with ties, -1 padding and signed zeros."""
    from dsa_precision.capture import digest_rows

    g = torch.Generator().manual_seed(0)
    rows, width, k = 300, 5000, 64
    logits = torch.randint(-3, 4, (rows, width), generator=g).float()
    logits[:, ::7] = -0.0
    lengths = torch.randint(1, width + 1, (rows,), generator=g, dtype=torch.int32)
    picks = indexer_topk(logits, k, seq_lens=lengths)
    picks[::5, -3:] = -1  # fewer picks than k: not a top-k where more keys are visible
    twice = torch.arange(3, rows, 11)
    picks[twice, 1] = picks[twice, 0]  # a key twice (LMDeploy's bitonic top-k)
    for dtype in (torch.int16, torch.int32, torch.int64):
        p = picks.to(dtype)
        assert torch.equal(digest_rows(p.cuda()).cpu(), digest_rows(p))
    on_gpu = engine_tie_rows(logits.cuda(), picks.cuda(), lengths.cuda())
    on_cpu = engine_tie_rows(logits, picks, lengths)
    assert torch.equal(on_gpu.rows.cpu(), on_cpu.rows) and on_cpu.rows.numel() > 0
    assert torch.equal(on_gpu.digests.cpu(), on_cpu.digests)
    held_twice = twice[picks[twice, 0] >= 0]
    assert set(held_twice.tolist()) <= set(on_gpu.rows.tolist()) and held_twice.numel() > 0


def test_a_row_of_2048_picks_holding_a_key_twice_is_sent_on_cuda_as_on_the_cpu():
    """The engines' top-k 2048 on CUDA (the Triton pass and the sort of the picks) as on the
    CPU: a row holding a key twice is sent, an exact top-k is not."""
    g = torch.Generator().manual_seed(1)
    rows, width, k = 64, 8192, 2048
    logits = torch.randn(rows, width, generator=g)
    lengths = torch.full((rows,), width, dtype=torch.int32)
    picks = indexer_topk(logits, k, seq_lens=lengths).to(torch.int32)
    picks[1::4, -5:] = -1  # padding at the end of the row
    picks[2::4, 7] = picks[2::4, 1500]  # a key twice
    picks[3::4, 9] = -1  # padding inside the row, where the key it replaces scores high
    on_gpu = engine_tie_rows(logits.cuda(), picks.cuda(), lengths.cuda())
    on_cpu = engine_tie_rows(logits, picks, lengths)
    assert torch.equal(on_gpu.rows.cpu(), on_cpu.rows)
    sent = set(on_cpu.rows.tolist())
    assert set(range(2, rows, 4)) <= sent and not set(range(0, rows, 4)) & sent


def _check_tie_replay(s, lengths, exact, tied, picks):
    """The engine sends exactly the tied rows; training's picks with them replaced are the
    kernel's, row for row."""
    frame = engine_tie_rows(s, picks, lengths)
    assert torch.equal(frame.rows, tied.nonzero().view(-1))
    back = TieRows.from_bytes(frame.to_bytes()).to("cuda")
    merged = exact.clone()
    merged[back.rows] = back.picks
    assert torch.equal(merged.long().sort(-1).values, picks.long().sort(-1).values)


_ENGINE_KERNELS = [
    *((sglang_topk, name) for name in sorted(sglang_topk.KERNELS)),
    (lmdeploy_topk, "tilelang"),
]


@pytest.mark.parametrize(
    "engine, kernel",
    _ENGINE_KERNELS,
    ids=[f"{e.__name__.split('.')[-1]}-{k}" for e, k in _ENGINE_KERNELS],
)
def test_sglang_and_lmdeploy_differ_from_the_exact_topk_only_by_ties(engine_logits, engine, kernel):
    """SGLang 0.5.23's top-k v2 (decode, ragged prefill), sgl-kernel's paged prefill op and
    LMDeploy 0.18's TileLang kernel: as for vLLM's (not yet run on a GPU)."""
    reason = engine.missing_reason(kernel) or engine.applies(kernel, 1, TOPK)
    if reason is not None:
        pytest.skip(reason)
    s, lengths, exact, tied = engine_logits
    picks = engine.run(kernel, s, lengths, TOPK)
    cause = classify_rows(exact, picks, s, lengths=lengths).cause
    assert bool(((cause == SAME) | (cause == TIE)).all()), cause.unique().tolist()
    assert not bool((cause[~tied] != SAME).any())
    _check_tie_replay(s, lengths, exact, tied, picks)


def test_lmdeploy_bitonic_repeats_keys_it_finds_equal(engine_logits):
    """LMDeploy's Triton fallback (top-k other than 512 / 2048, or no TileLang): its
    compare-and-swap copies one of two equal scores' keys over the other (tests/interpreter shows
    it on the CPU), so a row may repeat a key; it never returns a wrong set of distinct keys."""
    reason = lmdeploy_topk.missing_reason("bitonic")
    if reason is not None:
        pytest.skip(reason)
    s, lengths, exact, _ = engine_logits
    picks = lmdeploy_topk.run("bitonic", s, lengths, TOPK)
    cause = classify_rows(exact, picks, s, lengths=lengths).cause
    assert not bool((cause == PRECISION).any())
    bad = (cause == INVALID).nonzero().view(-1)
    for row in bad.tolist():
        keys = picks[row][picks[row] >= 0]
        assert bool((keys < lengths[row]).all()) and keys.unique().numel() < keys.numel()
    # The engine side sends every such row (no top-k), so it is never taken for training's own.
    sent = set(engine_tie_rows(s, picks, lengths).rows.tolist())
    assert set(bad.tolist()) <= sent
