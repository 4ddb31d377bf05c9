"""Replays that run on the CPU: each kernel-dispatching module of the package (registered in
tests/determinism/manifest.py) runs twice or more on the same inputs and gives the same bits.

On the CPU the torch paths run for real; cuDNN and DeepGEMM are recording fakes standing in for
the hardware (tests/support/fake_cudnn.py, tests/backends/test_deepgemm.py), so their replays cover the
package's code around the launch (operand layout, post-processing of the kernel's answer), not
the kernel. The Triton kernels replay in Triton's interpreter (tests/interpreter/test_replays.py)
and every kernel on the H200 (tests/gpu/test_determinism.py)."""

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
    prepare_indexer_operands,
    prepare_scoring_operands,
)
from dsa_precision.testing import assert_replays_bit_exact

from ..support import fake_cudnn
from ..support.fused_attention import fused_indexer_sparse_attention
from ..support.helpers import cu_seqlens
from ..support.sparse_attention import sparse_mla_attention


def _qkw(b=2, s=40, h=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, s, h, 128, generator=g),
        torch.randn(b, s, 128, generator=g),
        (torch.randn(b, s, h, generator=g) * 0.02).to(torch.bfloat16),
    )


# ---------------------------------------------------------- scoring.py, topk.py, select.py


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_torch_scoring_replays_bit_exact(precision):
    """BSHD with per-batch offsets and a ratio, and THD: prepared from FP32 carriers each time."""
    q, k, w = _qkw()
    cu = cu_seqlens([13, 0, 27])

    def score(q, k, w):
        bshd = indexer_scores(
            q, k, w, config=IndexerPrecisionConfig(scoring_precision=precision), ratio=2, q_causal_offsets=torch.tensor([0, 5]),
            backend="torch",
        )  # fmt: skip
        thd = indexer_scores_varlen(
            q[0], k[0], w[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=27,
            max_seqlen_k=27, config=IndexerPrecisionConfig(scoring_precision=precision), backend="torch",
        )  # fmt: skip
        return bshd, thd

    assert_replays_bit_exact(score, (q, k, w), what=f"torch {precision} scoring")


def test_torch_topk_replays_bit_exact():
    g = torch.Generator().manual_seed(3)
    scores = torch.round(torch.randn(3, 50, 300, generator=g) * 4) / 4  # many exact ties
    holes = torch.rand(scores.shape, generator=g)
    scores = scores.masked_fill(holes < 0.2, float("-inf")).masked_fill(holes > 0.99, float("nan"))
    seq_lens = torch.randint(0, 301, (3, 50), generator=g)

    def pick(s, n):
        return indexer_topk(s, 64, seq_lens=n, backend="torch")

    assert_replays_bit_exact(pick, (scores, seq_lens), what="torch top-k")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_select_replays_bit_exact(precision):
    """8-row chunks (``chunk_bytes=1``): BSHD, and THD with chunks cutting the sequences."""
    q, k, w = _qkw(s=37)
    cu = cu_seqlens([5, 0, 20, 12])

    def select(q, k, w):
        bshd = indexer_select(
            q,
            k,
            w,
            topk=6,
            config=IndexerPrecisionConfig(scoring_precision=precision),
            chunk_bytes=1,
            backend="torch",
        )
        thd = indexer_select_varlen(
            q[0], k[0], w[0], topk=6, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20,
            max_seqlen_k=20, config=IndexerPrecisionConfig(scoring_precision=precision), chunk_bytes=1, backend="torch",
        )  # fmt: skip
        return bshd, thd

    assert_replays_bit_exact(select, (q, k, w), what=f"chunked {precision} select")


# ------------------------------------------ operands.py, preprocess.py, hadamard.py, quantize.py


@pytest.mark.parametrize(
    "rope_fp32, precision", [(True, "fp8"), (False, "fp8"), (False, "bf16")]
)  # fmt: skip
def test_indexer_operands_replay_bit_exact(rope_fp32, precision):
    """LayerNorm -> RoPE -> Hadamard -> E4M3/UE8M0 (or BF16 rounding) from the projections."""
    g = torch.Generator().manual_seed(5)
    pre = IndexerPreprocess(128, 64, rotate_activation=True, rope_fp32=rope_fp32)
    with torch.no_grad():
        pre.k_norm.weight.normal_(1.0, 0.2, generator=g)
    config = IndexerPrecisionConfig(rope_fp32=rope_fp32, scoring_precision=precision)
    q = torch.randn(24, 2, 32, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(24, 2, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(24, 2, 32, generator=g).to(torch.bfloat16)
    freqs = torch.rand(24, 1, 1, 64, generator=g) * 20

    def prepare(q, k, w, freqs):
        return prepare_indexer_operands(
            pre, q, k, w, freqs, config=config, sm_scale=0.3, impl="torch"
        )

    ops = assert_replays_bit_exact(prepare, (q, k, w, freqs), what=f"{config.short_str()} operands")
    assert ops.q.dtype == (torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16)


# ------------------------- tests/support: sparse_attention.py, fused_attention.py (test-only)


def test_sparse_attention_replays_bit_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 4, 72, generator=g).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(80, 72, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.randint(-1, 80, (64, 16), generator=g, dtype=torch.int32)
    assert_replays_bit_exact(
        lambda q, kv: sparse_mla_attention(q, kv, idx, 0.1, 64), (q, kv), backward=True
    )


def test_fused_attention_replays_bit_exact():
    """Indexer selection + sparse attention, forward and backward (index-accumulated dKV)."""
    g = torch.Generator().manual_seed(2)
    inputs = (
        torch.randn(24, 2, 4, 72, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(24, 2, 72, generator=g).to(torch.bfloat16).requires_grad_(),
        torch.randn(24, 2, 32, 128, generator=g),
        torch.randn(24, 2, 128, generator=g),
        (torch.randn(24, 2, 32, generator=g) * 0.02).to(torch.bfloat16),
    )

    def run(*x):
        out, _, picks = fused_indexer_sparse_attention(
            *x,
            topk=6,
            softmax_scale=0.1,
            d_v=64,
            config=IndexerPrecisionConfig(scoring_precision="fp8"),
        )
        return out, picks

    assert_replays_bit_exact(run, inputs, backward=True, what="fused indexer + attention")


# -------------------------------------------------- cudnn_backend.py, deepgemm_backend.py (fake hardware)


def test_cudnn_launches_replay_through_the_recording_fake(monkeypatch):
    """Scoring, top-k and chunked selection with backend="cudnn" (the fake stands in for the
    SM90 GPU and its kernels): what the package builds for the launches and makes of their
    answers replays bit for bit."""
    fake = fake_cudnn.install(monkeypatch)
    q, k, w = _qkw(s=20)

    def launch(q, k, w):
        scores = indexer_scores(
            q,
            k,
            w,
            config=IndexerPrecisionConfig(scoring_precision="fp8"),
            ratio=2,
            backend="cudnn",
        )
        picks = indexer_topk(scores, 4, backend="cudnn")
        chunked = indexer_select(
            q,
            k,
            w,
            topk=4,
            config=IndexerPrecisionConfig(scoring_precision="bf16"),
            chunk_bytes=1,
            backend="cudnn",
        )
        return scores.clone(), picks, chunked

    assert_replays_bit_exact(launch, (q, k, w), what="cuDNN launches")
    assert len(fake.forward_calls) == 3 * 4 and len(fake.topk_calls) == 3 * 4  # 1 + 3 chunks


def test_deepgemm_launches_replay_through_a_recording_fake(monkeypatch):
    """BSHD causal logits and THD windows through DeepGEMM's compressed entry point (a recording
    fake of ``fp8_fp4_mqa_logits``): the package's placement of the logits replays."""
    from ..support import fake_deepgemm

    fn = fake_deepgemm.FakeMqaLogits(mode="operands")
    fake_deepgemm.install(monkeypatch, fn)
    q, k, w = _qkw(b=1, s=17)
    cu = cu_seqlens([4, 0, 13])

    def launch(q, k, w):
        ops = prepare_scoring_operands(
            q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8")
        )
        bshd = indexer_scores(ops, q_causal_offsets=3, backend="deepgemm")
        thd = indexer_scores_varlen(
            ops.rows(0, 17), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13,
            max_seqlen_k=13, backend="deepgemm",
        )  # fmt: skip
        return bshd, thd

    assert_replays_bit_exact(launch, (q, k, w), what="DeepGEMM launches")
    assert len(fn.calls) == 3 * 2


# ----------------------------------------------------- megatron/indexer, attention, layout


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_megatron_attention_replays_bit_exact(request, packed):
    """The FP8 drop-in layer (fused operands, owned top-k, Megatron's sparse attention): output
    and gradients replay."""
    pytest.importorskip("megatron.core")
    request.getfixturevalue("megatron_parallel")
    request.getfixturevalue("cpu_rotary")
    from ..support.megatron import (
        attention_inputs,
        make_attention,
        make_config,
        packed_params,
        run_attention,
    )

    attn = make_attention(
        make_config(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
    )
    inputs = attention_inputs(b=1 if packed else 2, packed=packed)
    kw = dict(packed_seq_params=packed_params([0, 5, 16])) if packed else {}
    names = ("query", "key", "x", "qr", "up_v_weight")

    def forward(*tensors):
        return run_attention(attn, dict(zip(names, tensors, strict=True)), **kw)

    out = assert_replays_bit_exact(
        forward, [inputs[n] for n in names], backward=True, what="FP8 DSAttention"
    )
    assert torch.isfinite(out.float()).all()


# ------------------------------------------------------------------------------ the helper


def test_assert_replays_reports_output_and_index():
    calls = []

    def flaky(x):
        calls.append(1)
        y = x.clone()
        if len(calls) == 2:
            y[1, 2] += 1
        return {"scores": y, "n": 3}

    try:
        assert_replays_bit_exact(flaky, (torch.zeros(3, 4),), what="flaky")
    except AssertionError as exc:
        assert (
            "flaky: replay 1" in str(exc) and "out['scores']" in str(exc) and "(1, 2)" in str(exc)
        )
    else:
        raise AssertionError("a differing replay was not reported")
    nan = torch.full((2,), float("nan"))
    assert_replays_bit_exact(lambda x: x * 1, (nan,))  # NaN-aware: same payload is equal


def test_tie_rows_and_digests_replay_bit_exact():
    """The engine side of the tie replay (its torch path) and the row digests."""
    from dsa_precision.capture import digest_rows, engine_tie_rows

    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 3, (40, 64), generator=g).float()
    lengths = torch.randint(1, 65, (40,), generator=g)
    picks = indexer_topk(logits, 8, seq_lens=lengths, backend="torch")

    def frame(logits, picks, lengths):
        tied = engine_tie_rows(logits, picks, lengths)
        return tied.digests, tied.rows, tied.picks

    digests, rows, _ = assert_replays_bit_exact(frame, (logits, picks, lengths), what="tie rows")
    assert rows.numel() > 0
    assert torch.equal(assert_replays_bit_exact(digest_rows, (picks,), what="digests"), digests)
