"""dsa_precision.logprobs against hand computations: the log-probs at the next token, the labels
and mask of next-token prediction, |delta| quantiles, the sequence-level KL estimates and the
importance ratios' clip fractions (fixed cases, then Hypothesis against plain Python)."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsa_precision.logprobs import (
    _CLIP_RANGES,
    _LOGPROB_HEADERS,
    _logprob_cells,
    _logprob_headers,
    _logprob_mismatch_stats,
    _shifted_labels,
    _token_logprobs,
)

# ------------------------------------------------------------------------------ token_logprobs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_are_log_softmax_at_the_label(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, 11, generator=g)).to(dtype)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    want = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    got = _token_logprobs(logits, labels)
    assert got.dtype == torch.float32 and got.shape == (2, 7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # by hand, one token: logit of the label minus log sum exp of the row
    row = logits[1, 3].double()
    assert float(got[1, 3]) == pytest.approx(
        float(row[labels[1, 3]]) - math.log(float(row.exp().sum())), abs=1e-5
    )


def test_token_logprobs_in_chunks_equal_one_chunk_and_ignore_bad_labels():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, 13, generator=g)
    labels = torch.randint(0, 13, (5, 9), generator=g)
    labels[0, 0], labels[4, 8] = -100, 13  # ignored positions: 0, to be masked by the caller
    whole = _token_logprobs(logits, labels)
    chunked = _token_logprobs(logits, labels, chunk_bytes=13 * 4 * 3)  # 3 rows a chunk
    assert torch.equal(whole, chunked)
    assert whole[0, 0] == 0 and whole[4, 8] == 0


def test_token_logprobs_refuses_mismatched_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"logits has shape \(2, 3, 5\) and labels \(2, 4\)"):
        _token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"labels has dtype torch\.float32"):
        _token_logprobs(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(TypeError, match=r"logits has dtype torch\.int64"):
        _token_logprobs(torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


# ------------------------------------------------------------------------------ shifted_labels


def test_shifted_labels_bshd_and_packed():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    labels, mask = _shifted_labels(tokens)
    assert labels[:, :-1].tolist() == [[2, 3, 4], [6, 7, 8]]
    assert mask.tolist() == [[True, True, True, False]] * 2
    packed = torch.tensor([1, 2, 3, 4, 5, 6])
    labels, mask = _shifted_labels(packed, cu_seqlens=torch.tensor([0, 2, 2, 6]))
    assert labels[mask].tolist() == [2, 4, 5, 6]  # sequence 0: 1 -> 2; sequence 2: 3 -> 4 ...
    assert mask.tolist() == [True, False, True, True, True, False]
    labels, mask = _shifted_labels(packed[None], cu_seqlens=torch.tensor([0, 6]))
    assert mask.shape == (1, 6) and not mask[0, 5] and mask[0, :5].all()


# ----------------------------------------------------------------------- logprob_mismatch_stats


def test_equal_log_probs_give_exactly_zero_everywhere():
    lp = -torch.rand(3, 10) * 5
    m = _logprob_mismatch_stats(lp, lp.clone())
    assert m.tokens == 30 and m.tokens_differing == 0 and m.sequences == 3
    assert (m.abs_mean, m.abs_p99, m.abs_max, m.delta_mean, m.kl_k3) == (0, 0, 0, 0, 0)
    assert m.kl_k3_max_sequence == 0
    assert set(m.clipped) == set(_CLIP_RANGES) and all(v == 0 for v in m.clipped.values())


def test_hand_computed_case():
    # Two sequences of four tokens; deltas chosen around the clip bounds.
    delta = torch.tensor(
        [[0.0, 0.1, -0.1, 0.2], [math.log(1.25), math.log(0.85), 0.0, 5.0]], dtype=torch.float64
    )
    rollout = torch.full((2, 4), -2.0, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])  # 5.0 left out
    m = _logprob_mismatch_stats(rollout + delta, rollout, mask=mask)
    compared = [0.0, 0.1, -0.1, 0.2, math.log(1.25), math.log(0.85), 0.0]
    assert m.tokens == 7 and m.tokens_differing == 5 and m.sequences == 2
    assert m.abs_max == pytest.approx(math.log(1.25))
    assert m.abs_mean == pytest.approx(sum(abs(d) for d in compared) / 7)
    assert m.abs_p99 == pytest.approx(float(np.quantile(np.abs(compared), 0.99)))
    seq0, seq1 = compared[:4], compared[4:]
    assert m.delta_mean == pytest.approx((sum(seq0) / 4 + sum(seq1) / 3) / 2)

    def k3(ds):
        return sum(math.exp(d) - 1 - d for d in ds) / len(ds)

    assert m.kl_k3 == pytest.approx((k3(seq0) + k3(seq1)) / 2)
    assert m.kl_k3_max_sequence == pytest.approx(max(k3(seq0), k3(seq1)))
    # ratios: 1, 1.105, 0.905, 1.221, 1.25, 0.85, 1 -> outside [0.8, 1.2]: 1.221, 1.25;
    # outside [0.9, 1.1]: 1.105, 1.221, 1.25, 0.85; outside [0.8, 1.28]: none
    assert m.clipped["ppo_0.2"] == pytest.approx(2 / 7)
    assert m.clipped["ppo_0.1"] == pytest.approx(4 / 7)
    assert m.clipped["dapo_0.2_0.28"] == 0


def test_packed_sequences_average_per_sequence():
    delta = torch.tensor([0.3, 0.3, 0.3, -0.1], dtype=torch.float64)  # sequences of 3 and 1
    m = _logprob_mismatch_stats(delta, torch.zeros(4, dtype=torch.float64),
                               cu_seqlens=torch.tensor([0, 3, 4]))  # fmt: skip
    assert m.sequences == 2
    assert m.delta_mean == pytest.approx((0.3 + -0.1) / 2)  # not the token mean, 0.2
    empty = _logprob_mismatch_stats(delta, torch.zeros(4, dtype=torch.float64),
                                   cu_seqlens=torch.tensor([0, 3, 3, 4]))  # fmt: skip
    assert empty.sequences == 2 and empty.delta_mean == pytest.approx(0.1)


def test_k3_is_accurate_for_tiny_deltas():
    """exp(d) - 1 - d ~ d^2 / 2: computed as expm1(d) - d, it keeps its digits at d = 1e-6."""
    d = torch.tensor([[1e-6]], dtype=torch.float64)
    m = _logprob_mismatch_stats(d, torch.zeros_like(d))
    assert m.kl_k3 == pytest.approx(0.5e-12, rel=1e-5)


def test_stats_refuse_bad_arguments():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shape \(2, 3\) but rollout_logprobs \(3, 2\)"):
        _logprob_mismatch_stats(lp, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="pass a bool mask"):
        _logprob_mismatch_stats(lp, lp, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"clip_ranges\['odd'\] = \(1.5, 0.2\)"):
        _logprob_mismatch_stats(lp, lp, clip_ranges={"odd": (1.5, 0.2)})
    with pytest.raises(ValueError, match="end at the 6 tokens"):
        _logprob_mismatch_stats(lp, lp, cu_seqlens=torch.tensor([0, 5]))
    bad = lp.clone()
    bad[1, 2] = float("-inf")
    with pytest.raises(
        ValueError, match=r"1 compared tokens have a non-finite log-prob .*\(1, 2\)"
    ):
        _logprob_mismatch_stats(bad, lp)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False  # masked out: not compared, no error
    assert _logprob_mismatch_stats(bad, lp, mask=mask).tokens == 5


def test_cells_follow_the_headers():
    m = _logprob_mismatch_stats(torch.tensor([[0.0, 0.5]]), torch.zeros(1, 2))
    cells = _logprob_cells(m)
    assert len(cells) == len(_LOGPROB_HEADERS)
    assert cells[-1] == "1/2" and cells[5] == "50.00 %"  # 0.5 -> ratio 1.65, clipped at 0.2


# --------------------------------------------------------------------------------- Hypothesis


@st.composite
def log_prob_pairs(draw):
    batch, seq = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    finite = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)
    rollout = draw(st.lists(st.floats(-20.0, 0.0), min_size=batch * seq, max_size=batch * seq))
    # Mostly zero deltas, some small, some large: the clip bounds are crossed both ways.
    delta = draw(st.lists(st.one_of(st.just(0.0), finite), min_size=batch * seq,
                          max_size=batch * seq))  # fmt: skip
    mask = draw(st.lists(st.booleans(), min_size=batch * seq, max_size=batch * seq))
    shape = (batch, seq)
    r = torch.tensor(rollout, dtype=torch.float64).reshape(shape)
    return (
        r + torch.tensor(delta, dtype=torch.float64).reshape(shape),
        r,
        torch.tensor(mask).reshape(shape),
    )


@given(log_prob_pairs())
def test_stats_match_plain_python(pair):
    train, rollout, mask = pair
    m = _logprob_mismatch_stats(train, rollout, mask=mask)
    deltas = [
        [t - r for t, r, k in zip(trow, rrow, krow, strict=True) if k]
        for trow, rrow, krow in zip(train.tolist(), rollout.tolist(), mask.tolist(), strict=True)
    ]
    flat = [d for row in deltas for d in row]
    assert m.tokens == len(flat)
    assert m.tokens_differing == sum(d != 0 for d in flat)
    if not flat:  # nothing compared: no figure, never a match
        assert m.sequences == 0 and m.tokens_differing == 0
        assert all(math.isnan(getattr(m, f)) for f in ("abs_mean", "abs_max", "kl_k3"))
        assert all(math.isnan(v) for v in m.clipped.values())
        return
    assert m.abs_max == pytest.approx(max(abs(d) for d in flat))
    assert m.abs_mean == pytest.approx(sum(abs(d) for d in flat) / len(flat))
    assert m.abs_p99 == pytest.approx(float(np.quantile(np.abs(flat), 0.99)))
    rows = [row for row in deltas if row]
    assert m.sequences == len(rows)
    assert m.delta_mean == pytest.approx(sum(sum(r) / len(r) for r in rows) / len(rows), abs=1e-12)
    k3 = [sum(math.exp(d) - 1 - d for d in r) / len(r) for r in rows]
    assert m.kl_k3 == pytest.approx(sum(k3) / len(k3), rel=1e-9, abs=1e-15)
    assert m.kl_k3 >= 0 and m.kl_k3_max_sequence == pytest.approx(max(k3), rel=1e-9, abs=1e-15)
    for name, (low, high) in _CLIP_RANGES.items():
        outside = sum(math.exp(d) < 1 - low or math.exp(d) > 1 + high for d in flat)
        assert m.clipped[name] == pytest.approx(outside / len(flat)), name


@given(log_prob_pairs())
def test_packed_layout_of_the_same_rows_gives_the_same_figures(pair):
    """The rows of a BSHD batch, packed end to end with their cu_seqlens: the same statistics."""
    train, rollout, mask = pair
    b, s = train.shape
    bshd = _logprob_mismatch_stats(train, rollout, mask=mask)
    thd = _logprob_mismatch_stats(train.reshape(-1), rollout.reshape(-1), mask=mask.reshape(-1),
                                 cu_seqlens=torch.arange(b + 1) * s)  # fmt: skip
    assert thd.tokens == bshd.tokens and thd.sequences == bshd.sequences
    for field in ("abs_mean", "abs_p99", "abs_max", "delta_mean", "kl_k3", "kl_k3_max_sequence"):
        assert getattr(thd, field) == pytest.approx(
            getattr(bshd, field), rel=1e-9, abs=1e-12, nan_ok=True
        )
    assert thd.clipped == pytest.approx(bshd.clipped, nan_ok=True)


# ----------------------------------------------- inputs: packed boundaries, labels, selectors


@st.composite
def packed_batches(draw):
    """Packed sequences (some empty) of float64 log-prob pairs, a mask and their cu_seqlens."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    total = sum(lengths)
    finite = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False)
    rollout = draw(st.lists(st.floats(-20.0, 0.0), min_size=total, max_size=total))
    delta = draw(st.lists(st.one_of(st.just(0.0), finite), min_size=total, max_size=total))
    mask = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    r = torch.tensor(rollout, dtype=torch.float64)
    return r + torch.tensor(delta, dtype=torch.float64), r, torch.tensor(mask, dtype=torch.bool), cu


@given(packed_batches(), st.sampled_from([torch.int32, torch.int64]))
def test_packed_statistics_are_per_sequence_as_computed_directly(batch, dtype):
    train, rollout, mask, cu = batch
    m = _logprob_mismatch_stats(train, rollout, mask=mask, cu_seqlens=torch.tensor(cu, dtype=dtype))
    deltas = [t - r for t, r in zip(train.tolist(), rollout.tolist(), strict=True)]
    keep = mask.tolist()
    sequences = [[deltas[i] for i in range(a, b) if keep[i]] for a, b in itertools.pairwise(cu)]
    compared = [d for seq in sequences for d in seq]
    assert m.tokens == len(compared) and m.tokens_differing == sum(d != 0 for d in compared)
    rows = [s for s in sequences if s]
    assert m.sequences == len(rows)
    if not compared:  # nothing compared: NaN, never a perfect match
        assert math.isnan(m.abs_max) and math.isnan(m.delta_mean) and math.isnan(m.kl_k3)
        return
    assert m.delta_mean == pytest.approx(sum(sum(s) / len(s) for s in rows) / len(rows), abs=1e-12)
    k3 = [sum(math.exp(d) - 1 - d for d in s) / len(s) for s in rows]
    assert m.kl_k3 == pytest.approx(sum(k3) / len(k3), rel=1e-9, abs=1e-15)
    assert m.abs_max == pytest.approx(max(abs(d) for d in compared))


@given(packed_batches(), st.data())
def test_packed_boundaries_that_do_not_cover_the_tokens_are_refused(batch, data):
    """Boundaries that decrease, start elsewhere than 0 or end before or after the tokens: one
    ValueError naming cu_seqlens and its values, from the statistics and from shifted_labels."""
    train, rollout, _, cu = batch
    total = cu[-1]
    broken = data.draw(
        st.sampled_from(["start", "end_short", "end_long", "decrease", "float", "2-D"])
    )
    bad = list(cu)
    if broken == "start":
        bad[0] = data.draw(st.integers(1, 5))
    elif broken == "end_short" and total > 0:
        bad[-1] = total - data.draw(st.integers(1, total))
        bad = [min(v, bad[-1]) for v in bad]  # still non-decreasing: covers too few tokens
    elif broken == "end_long":
        bad[-1] = total + data.draw(st.integers(1, 5))
    elif broken == "decrease":
        bad.insert(1, total + 1)
    cu_t = torch.tensor(bad)
    if broken == "float":
        cu_t = cu_t.float()
    elif broken == "2-D":
        cu_t = cu_t[None]
    if bad == cu and broken not in ("float", "2-D"):
        return  # end_short of an empty batch: nothing to break
    tokens = torch.arange(total)
    for call in (
        lambda: _logprob_mismatch_stats(train, rollout, cu_seqlens=cu_t),
        lambda: _shifted_labels(tokens, cu_seqlens=cu_t),
    ):
        with pytest.raises(ValueError, match=r"cu_seqlens (=|is a)"):
            call()


@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.data())
def test_shifted_labels_never_cross_a_sequence_boundary(lengths, data):
    """labels[t] = tokens[t + 1] inside each sequence; a sequence's last token is never compared
    (its roll would wrap to the next sequence's or the first token)."""
    total = sum(lengths)
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 999), min_size=total,
                                             max_size=total)), dtype=torch.int64)  # fmt: skip
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    labels, mask = _shifted_labels(tokens, cu_seqlens=torch.tensor(cu))
    want_mask = [t + 1 < b for a, b in itertools.pairwise(cu) for t in range(a, b)]
    assert mask.tolist() == want_mask
    values = tokens.tolist()
    assert [lab for lab, k in zip(labels.tolist(), want_mask, strict=True) if k] == [
        values[t + 1] for t, k in enumerate(want_mask) if k
    ]


def test_a_comparison_of_no_token_is_nan_never_a_match():
    lp = torch.zeros(2, 3)
    other = lp.clone()
    other[0, 1] = 0.5  # the rows differ: a report of 0 would hide it
    for m in (
        _logprob_mismatch_stats(lp, other, mask=torch.zeros(2, 3, dtype=torch.bool)),
        _logprob_mismatch_stats(torch.zeros(0), torch.zeros(0)),
        _logprob_mismatch_stats(torch.zeros(2, 0), torch.zeros(2, 0)),
    ):
        assert m.tokens == 0 and m.sequences == 0
        figures = (m.abs_mean, m.abs_p99, m.abs_max, m.delta_mean, m.kl_k3, *m.clipped.values())
        assert all(math.isnan(v) for v in figures), m
        assert _logprob_cells(m)[0] == "nan" and _logprob_cells(m)[-1] == "0/0"


@pytest.mark.parametrize(
    "clip_ranges, error, match",
    [
        ([(0.2, 0.2)], TypeError, r"clip_ranges is a list; pass a mapping"),
        ({"a": "0.2"}, TypeError, r"clip_ranges\['a'\] = '0.2'; a range is a pair"),
        ({"a": (0.1, 0.2, 0.3)}, TypeError, r"clip_ranges\['a'\] = \(0.1, 0.2, 0.3\)"),
        ({"a": (True, 0.2)}, TypeError, r"clip_ranges\['a'\] low=True \(bool\)"),
        ({"a": (float("nan"), 0.2)}, ValueError, r"clip_ranges\['a'\] low=nan must be finite"),
        ({1: (0.1, 0.1)}, TypeError, r"key 1 \(int\); name each range with a string"),
        ({"ppo_0.2": (0.3, 0.3)}, ValueError, r"'ppo_0.2' is CLIP_RANGES' \(0.2, 0.2\)"),
    ],
)
def test_clip_ranges_of_the_wrong_type_are_named(clip_ranges, error, match):
    lp = torch.zeros(1, 2)
    with pytest.raises(error, match=match):
        _logprob_mismatch_stats(lp, lp, clip_ranges=clip_ranges)


def test_custom_clip_ranges_get_their_own_columns():
    m = _logprob_mismatch_stats(torch.tensor([[0.0, 0.5]]), torch.zeros(1, 2),
                               clip_ranges={"wide": (0.5, 1.0), "ppo_0.1": (0.1, 0.1)})  # fmt: skip
    headers = _logprob_headers(tuple(m.clipped))
    cells = _logprob_cells(m)
    assert headers[5:7] == ("clip wide", "clip 0.1") and len(cells) == len(headers)
    assert cells[5:7] == ["0.00 %", "50.00 %"]  # exp(0.5) = 1.65: inside [0.5, 2], outside 1.1
    with pytest.raises(ValueError, match=r"no clip range 'ppo_0.2' \(they have \['ppo_0.1', "):
        _logprob_cells(m, ("ppo_0.2",))


def test_token_logprobs_refuses_an_empty_vocabulary_and_bad_chunks():
    labels = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"an empty vocabulary \(V = 0\)"):
        _token_logprobs(torch.zeros(2, 3, 0), labels)
    with pytest.raises(ValueError, match="chunk_bytes=0 must be a positive integer"):
        _token_logprobs(torch.zeros(2, 3, 5), labels, chunk_bytes=0)
    assert _token_logprobs(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64)).shape == (0,)
