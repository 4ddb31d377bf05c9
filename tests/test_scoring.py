"""indexer_scores / indexer_scores_varlen on the torch backend (CPU) against independent float64
evaluations of the contract (tests/support/helpers.py), and the rules the kernels share with it: causal
limits, per-batch offsets, packed sequences, ``out=``, non-finite operands, empty inputs."""

import pytest
import torch

from dsa_precision import (
    ScoringOperands,
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_topk,
    prepare_scoring_operands,
    reset_scoring_calls,
    scoring_calls,
)

from .support.configs import BF16, CONFIGS, FP8
from .support.helpers import (
    CONTRACTS,
    assert_bitwise_equal,
    causal_counts,
    cu_seqlens,
    reference_topk_rows,
    rel_err,
)

# The torch backend rounds one exact float64 sum per score to float32; the contract is float64.
TORCH_REL_ERR = 1e-6


def _inputs(b=2, sq=33, sk=33, h=32, d=128, dtype=torch.float32, w_dtype=torch.bfloat16):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, d, dtype=dtype)
    w = (torch.randn(b, sq, h) * h**-0.5 * d**-0.5).to(w_dtype)
    return q, k, w


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("carrier", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("ratio, sk", [(1, 41), (4, 11)])
@pytest.mark.parametrize("sm_scale", [1.0, 0.375])
def test_torch_backend_matches_float64_contract(carrier, precision, ratio, sk, sm_scale):
    q, k, w = _inputs(sq=33, sk=sk, dtype=carrier)
    got = indexer_scores(
        q, k, w, config=CONFIGS[precision], ratio=ratio, sm_scale=sm_scale, backend="torch"
    )
    want = CONTRACTS[precision](q, k, w, sm_scale=sm_scale, ratio=ratio)
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 33, sk)
    err = rel_err(got, want)  # also checks that the -inf (causal) patterns are identical
    assert err <= TORCH_REL_ERR, f"{precision} carrier={carrier} ratio={ratio}: {err}"


@pytest.mark.parametrize("h, d", [(3, 64), (16, 128)])
def test_bf16_scoring_takes_any_head_count_and_width(h, d):
    q, k, w = _inputs(b=1, sq=9, sk=9, h=h, d=d)
    got = indexer_scores(q, k, w.float(), config=BF16, backend="torch")
    assert rel_err(got, CONTRACTS["bf16"](q, k, w.float())) <= TORCH_REL_ERR


def test_precisions_really_differ():
    q, k, w = _inputs()
    bf16 = indexer_scores(q, k, w, config=BF16, backend="torch")
    fp8 = indexer_scores(q, k, w, config=FP8, backend="torch")
    assert rel_err(fp8, bf16) > 1e-3  # E4M3 keeps 3 mantissa bits, BF16 8
    assert rel_err(fp8, CONTRACTS["fp8"](q, k, w)) <= TORCH_REL_ERR
    assert rel_err(bf16, CONTRACTS["bf16"](q, k, w)) <= TORCH_REL_ERR


def test_bf16_scoring_rounds_fp32_carriers_first():
    """q = k = 1.001 (FP32), weight 1: BF16 scoring rounds both to 1.0, so the score is 1.0."""
    q = torch.zeros(1, 1, 4, 128)
    k = torch.zeros(1, 1, 128)
    w = torch.zeros(1, 1, 4)
    q[0, 0, 0, 0], k[0, 0, 0], w[0, 0, 0] = 1.001, 1.001, 1.0
    got = indexer_scores(q, k, w, config=BF16, backend="torch")
    assert got.item() == 1.0


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_4d_keys_and_float32_weights_are_accepted(precision):
    q, k, w = _inputs(sq=9, sk=9)
    a = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    b = indexer_scores(q, k.unsqueeze(2), w, config=CONFIGS[precision], backend="torch")
    assert_bitwise_equal(a, b, "4-D keys")
    # FP8 folds the weights in float32 either way; BF16 weights promote exactly to float32.
    c = indexer_scores(q, k, w.float(), config=CONFIGS[precision], backend="torch")
    assert_bitwise_equal(a, c, "float32 weights")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_prepared_operands_score_exactly_like_carriers(precision):
    q, k, w = _inputs(sq=17, sk=23)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision], sm_scale=0.5)
    assert isinstance(ops, ScoringOperands) and ops.precision.value == precision
    a = indexer_scores(ops, ratio=2, q_causal_offsets=5, backend="torch")
    b = indexer_scores(
        q,
        k,
        w,
        config=CONFIGS[precision],
        sm_scale=0.5,
        ratio=2,
        q_causal_offsets=5,
        backend="torch",
    )
    assert_bitwise_equal(a, b, f"{precision} operands vs carriers")


# ------------------------------------------------------------------------- causal offsets


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("ratio", [1, 4])
def test_per_batch_causal_offsets(precision, ratio):
    q, k, w = _inputs(sq=16, sk=48 // ratio + 3)
    sk = k.shape[1]
    offsets = [32, 5]
    for form in (torch.tensor(offsets), torch.tensor(offsets, dtype=torch.int32)):
        got = indexer_scores(
            q,
            k,
            w,
            config=CONFIGS[precision],
            ratio=ratio,
            q_causal_offsets=form,
            backend="torch",
        )
        want = CONTRACTS[precision](q, k, w, offsets=offsets, ratio=ratio)
        assert rel_err(got, want) <= TORCH_REL_ERR
        for b, off in enumerate(offsets):
            limits = causal_counts(off, range(16), ratio, sk)
            for s, n in enumerate(limits):
                assert (
                    torch.isfinite(got[b, s, :n]).all() and (got[b, s, n:] == -float("inf")).all()
                )


def test_int_offset_is_the_same_offset_for_every_batch_row():
    q, k, w = _inputs(sq=7, sk=20)
    a = indexer_scores(q, k, w, config=BF16, q_causal_offsets=9, backend="torch")
    b = indexer_scores(q, k, w, config=BF16, q_causal_offsets=torch.tensor([9, 9]), backend="torch")
    assert_bitwise_equal(a, b, "int vs tensor offsets")
    zero = indexer_scores(q, k, w, config=BF16, backend="torch")
    assert not torch.equal(a, zero)  # the offset shows: more keys are visible


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("r0, r1", [(0, 1), (5, 12), (29, 33)])
def test_row_slice_with_shifted_offsets_equals_the_rows_of_the_full_call(precision, r0, r1):
    """What chunked selection relies on: rows [r0, r1) scored with offset + r0 are those rows."""
    q, k, w = _inputs(sq=33, sk=33)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
    offsets = torch.tensor([0, 3])
    full = indexer_scores(ops, ratio=2, q_causal_offsets=offsets, backend="torch")
    part = indexer_scores(ops.rows(r0, r1), ratio=2, q_causal_offsets=offsets + r0, backend="torch")
    assert_bitwise_equal(part, full[:, r0:r1], f"rows {r0}:{r1}")


# -------------------------------------------------------------------------------- out=


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_out_is_written_and_returned(precision):
    q, k, w = _inputs(sq=9, sk=13)
    want = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    out = torch.full((2, 9, 13), 7.0)
    got = indexer_scores(q, k, w, config=CONFIGS[precision], out=out, backend="torch")
    assert got is out
    assert_bitwise_equal(out, want, "out=")


# ------------------------------------------------------------------------------ varlen


def _packed(lens_q, lens_k, h=32, dtype=torch.float32):
    q = torch.randn(sum(lens_q), h, 128, dtype=dtype)
    k = torch.randn(sum(lens_k), 128, dtype=dtype)
    w = (torch.randn(sum(lens_q), h) * 0.02).to(torch.bfloat16)
    return q, k, w, cu_seqlens(lens_q), cu_seqlens(lens_k)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("offsets", [None, 2, "tensor"], ids=["no_offsets", "int", "tensor"])
def test_varlen_equals_per_sequence_bshd_bit_for_bit(precision, ratio, offsets):
    lens_q, lens_k = [5, 0, 17, 9, 3], [5, 4, 17, 12, 0]
    q, k, w, cu_q, cu_k = _packed(lens_q, lens_k)
    if offsets == "tensor":
        offsets = torch.tensor([0, 0, 0, 3, 1])  # the last sequence's queries are its keys' tail
    max_k = 19  # above the longest key sequence: padding columns
    got = indexer_scores_varlen(
        q,
        k,
        w,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k.long(),
        max_seqlen_q=17,
        max_seqlen_k=max_k,
        config=CONFIGS[precision],
        ratio=ratio,
        q_causal_offsets=offsets,
        backend="torch",
    )
    assert got.shape == (sum(lens_q), max_k) and got.dtype == torch.float32
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        off = offsets[i : i + 1] if isinstance(offsets, torch.Tensor) else offsets
        one = indexer_scores(
            q[None, q0:q1],
            k[None, k0:k1],
            w[None, q0:q1],
            config=CONFIGS[precision],
            ratio=ratio,
            q_causal_offsets=off,
            backend="torch",
        )[0]
        assert_bitwise_equal(got[q0:q1, : k1 - k0], one, f"sequence {i}")
        assert (got[q0:q1, k1 - k0 :] == -float("inf")).all(), f"sequence {i} padding"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_varlen_operands_and_out(precision):
    lens = [6, 11]
    q, k, w, cu, _ = _packed(lens, lens)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11, max_seqlen_k=11, backend="torch")
    carriers = indexer_scores_varlen(q, k, w, config=CONFIGS[precision], **kw)
    ops = prepare_scoring_operands(q[None], k[None], w[None], config=CONFIGS[precision])
    out = torch.empty(17, 11)
    got = indexer_scores_varlen(ops, out=out, **kw)
    assert got is out
    assert_bitwise_equal(got, carriers, "varlen operands vs carriers")


def test_varlen_without_sequences_or_keys():
    q, k, w, cu, _ = _packed([4], [4])
    kw = dict(config=BF16, backend="torch")
    got = indexer_scores_varlen(
        q, k[:0], w, cu_seqlens_q=cu, cu_seqlens_k=cu_seqlens([0]), max_seqlen_q=4,
        max_seqlen_k=0, **kw,
    )  # fmt: skip
    assert got.shape == (4, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_k has a sequence of 4 tokens, above max_seq"):
        indexer_scores_varlen(
            q, k, w, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=0, **kw
        )  # an understated bound is named where the lengths are host data
    empty = cu_seqlens([0, 0])
    got = indexer_scores_varlen(
        q[:0], k[:0], w[:0], cu_seqlens_q=empty, cu_seqlens_k=empty, max_seqlen_q=0,
        max_seqlen_k=3, **kw,
    )  # fmt: skip
    assert got.shape == (0, 3)


# ------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("sq, sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_bshd(precision, sq, sk):
    q, k, w = _inputs(b=2, sq=sq, sk=sk)
    got = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    assert got.shape == (2, sq, sk) and got.dtype == torch.float32
    out = torch.empty(2, sq, sk)
    assert indexer_scores(q, k, w, config=CONFIGS[precision], out=out, backend="torch") is out


# -------------------------------------------------------------------- non-finite operands


def _adversarial():
    """Operands on which a non-finite entry would give +inf (or a ReLU-clipped 0) under the
    literal formula: lane 0 of every query positive, every head weight positive."""
    q, k, w = _inputs(b=1, sq=12, sk=12)
    q[..., 0] = q[..., 0].abs() + 0.1
    w = w.float().abs() + 1e-3
    return q, k, w


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k", "weights"])
def test_non_finite_operands_score_nan_and_are_never_selected(precision, bad, where):
    q, k, w = _adversarial()
    clean = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    row, key = 5, 3
    if where == "q":
        q[0, row, 7, 0] = bad
    elif where == "k":
        k[0, key, 0] = bad
    else:
        w[0, row, 2] = bad
    got = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    touched = torch.zeros_like(got, dtype=torch.bool)
    if where == "k":
        touched[0, key:, key] = True  # the rows that see the key
    else:
        touched[0, row, : row + 1] = True  # the row's visible keys
    assert torch.isnan(got[touched]).all(), f"{where}={bad}: {got[touched]}"
    assert_bitwise_equal(got[~touched], clean[~touched], "the rest is unchanged")
    for picks in (
        indexer_topk(got, 4, backend="torch"),
        indexer_topk(got, 4, deterministic=False, backend="torch"),
    ):
        for r in range(12):
            sel = set(picks[0, r].tolist()) - {-1}
            assert not (sel & set(touched[0, r].nonzero().flatten().tolist())), (r, sel)
    # The other rows select exactly what they select without the bad entry.
    masked = clean.masked_fill(touched, float("-inf"))
    assert indexer_topk(got, 4, backend="torch").tolist() == [reference_topk_rows(masked[0], 4)]


# ------------------------------------------------------------------------------ audit


def test_every_call_is_counted_with_its_precision_and_backend():
    q, k, w = _inputs(sq=4, sk=4)
    reset_scoring_calls()
    indexer_scores(q, k, w, config=FP8, backend="torch")
    indexer_scores(q, k, w, config=BF16, backend="auto")  # CPU: the reference
    cu = cu_seqlens([4])
    indexer_scores_varlen(
        q[0], k[0], w[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
        config=FP8, backend="torch",
    )  # fmt: skip
    assert scoring_calls("fp8", "torch") == 2
    assert scoring_calls("bf16", "torch") == 1
    assert scoring_calls() == 3


# ---------------------------------------------------------------------------- clean=False


@pytest.mark.parametrize("ratio", [1, 3])
def test_uncleaned_scores_carry_the_causal_limits(ratio):
    """``clean=False`` on the torch backend: the same scores (it writes ``-inf`` anyway) and
    each row's causal limit, which is where the cleaned scores' ``-inf`` begins."""
    q, k, w = _inputs(b=2, sq=17, sk=15)
    kw = dict(config=FP8, ratio=ratio, q_causal_offsets=torch.tensor([0, 4]), backend="torch")
    clean = indexer_scores(q, k, w, **kw)
    window = indexer_scores(q, k, w, clean=False, **kw)
    assert_bitwise_equal(window.scores, clean, "uncleaned scores")
    for b, off in enumerate((0, 4)):
        assert window.lengths[b].tolist() == causal_counts(off, range(17), ratio, 15)
    finite = torch.isfinite(clean).sum(-1)
    assert torch.equal(finite, window.lengths.long())  # the limits are where -inf begins
    assert torch.equal(indexer_topk(window, 5), indexer_topk(clean, 5))


def test_uncleaned_varlen_scores_carry_each_rows_limit():
    lens_q, lens_k, offsets = [5, 0, 7], [6, 3, 9], [1, 0, 2]
    total_q, total_k = sum(lens_q), sum(lens_k)
    q, k, w = _inputs(b=1, sq=total_q, sk=total_k)
    kw = dict(
        cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=7,
        max_seqlen_k=9, q_causal_offsets=torch.tensor(offsets), config=FP8, backend="torch",
    )  # fmt: skip
    clean = indexer_scores_varlen(q[0], k[0], w[0], **kw)
    window = indexer_scores_varlen(q[0], k[0], w[0], clean=False, **kw)
    assert_bitwise_equal(window.scores, clean, "uncleaned packed scores")
    want = [
        min(c, n_k)
        for n_q, n_k, off in zip(lens_q, lens_k, offsets, strict=True)
        for c in causal_counts(off, range(n_q), 1, 10**9)
    ]
    assert window.lengths.tolist() == want
    assert torch.equal(indexer_topk(window, 4), indexer_topk(clean, 4))


def test_window_scores_of_prepared_operands_are_the_deprecated_clean_false():
    """``indexer_window_scores`` (operands only) returns what ``clean=False`` returned, bit for
    bit; the old forms still run for one release, each with a ``DeprecationWarning`` naming its
    replacement; the new function refuses carriers, naming the preparing step."""
    import warnings

    from dsa_precision import indexer_window_scores, indexer_window_scores_varlen

    q, k, w = _inputs(b=2, sq=9, sk=9)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    kw = dict(q_causal_offsets=torch.tensor([0, 3]), backend="torch")
    new = indexer_window_scores(ops, **kw)
    with pytest.warns(DeprecationWarning, match=r"clean=False\) is deprecated: call "
                      r"dsa_precision\.indexer_window_scores\(operands"):  # fmt: skip
        old = indexer_scores(ops, clean=False, **kw)
    assert_bitwise_equal(new.scores, old.scores, "window scores")
    assert torch.equal(new.lengths, old.lengths)
    with pytest.warns(DeprecationWarning, match=r"indexer_scores\(q, k, weights, config=\.\.\.\) "
                      r"is deprecated: prepare the operands once"):  # fmt: skip
        carried = indexer_scores(q, k, w, config=FP8, **kw)
    assert_bitwise_equal(carried, indexer_scores(ops, **kw), "carriers vs operands")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the operand forms warn about nothing
        indexer_scores(ops, **kw)
        indexer_window_scores(ops, **kw)
    with pytest.raises(TypeError, match=r"indexer_window_scores\(\) takes prepared "
                       r"ScoringOperands, got Tensor; build them with dsa_precision\."
                       r"prepare_scoring_operands"):  # fmt: skip
        indexer_window_scores(q, **kw)  # type: ignore[arg-type]
    lens = [4, 5]
    vq, vk, vw = _inputs(b=1, sq=9, sk=9)
    vops = prepare_scoring_operands(vq, vk, vw, config=FP8)
    vkw = dict(cu_seqlens_q=cu_seqlens(lens), cu_seqlens_k=cu_seqlens(lens), max_seqlen_q=5,
               max_seqlen_k=5, backend="torch")  # fmt: skip
    with pytest.warns(DeprecationWarning, match=r"indexer_window_scores_varlen"):
        old_v = indexer_scores_varlen(vops, clean=False, **vkw)
    new_v = indexer_window_scores_varlen(vops, **vkw)
    assert_bitwise_equal(new_v.scores, old_v.scores, "packed window scores")
    assert torch.equal(new_v.lengths, old_v.lengths)
    with pytest.warns(DeprecationWarning, match=r"indexer_select\(q, k, weights"):
        indexer_select(q, k, w, config=FP8, topk=2, backend="torch")


def test_uncleaned_empty_calls_have_empty_lengths():
    q, k, w = _inputs(b=2, sq=0, sk=5)
    window = indexer_scores(q, k, w, config=FP8, backend="torch", clean=False)
    assert window.scores.shape == (2, 0, 5) and window.lengths.shape == (2, 0)
