"""cuDNN indexer scoring and top-k on an SM90 GPU against the torch reference backend."""

import pytest
import torch

from dsa_precision import (
    indexer_scores,
    indexer_topk,
    reset_scoring_calls,
    scoring_calls,
    topk_agreement,
)

from ..helpers import CALC_DIFF_MAX, MAX_REL_ERR, calc_diff, rel_err

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _inputs(b, s, h, carrier, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, h, 128, device=DEV, generator=g).to(carrier)
    k = torch.randn(b, s, 128, device=DEV, generator=g).to(carrier)
    w = (torch.randn(b, s, h, device=DEV, generator=g) * h**-0.5 * 128**-0.5).to(torch.bfloat16)
    return q, k, w


def member_agreement(train: torch.Tensor, infer: torch.Tensor) -> float:
    return float(topk_agreement(train, infer).member_agreement)


@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "carrier", [torch.bfloat16, torch.float32], ids=["bf16_carrier", "fp32_carrier"]
)
def test_cudnn_matches_torch_reference(record, h, precision, carrier):
    b, s, topk = 1, 4096, 2048
    q, k, w = _inputs(b, s, h, carrier)
    reset_scoring_calls()
    got = indexer_scores(q, k, w, scoring_precision=precision, backend="cudnn")
    ref = indexer_scores(q, k, w, scoring_precision=precision, backend="torch")
    assert scoring_calls(precision, "cudnn") == 1 and scoring_calls(precision, "torch") == 1
    err, diff = rel_err(got, ref), calc_diff(got, ref)
    agree = member_agreement(indexer_topk(got, topk), indexer_topk(ref, topk))
    record(
        "cudnn_vs_torch",
        precision=precision,
        heads=h,
        carrier=str(carrier).removeprefix("torch."),
        seq=s,
        max_rel_err=err,
        calc_diff=diff,
        topk=topk,
        member_agreement=agree,
    )
    assert err <= MAX_REL_ERR[precision]
    assert diff <= CALC_DIFF_MAX
    assert agree >= 0.9999


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_three_replays_are_bit_identical(record, precision):
    q, k, w = _inputs(2, 2048, 64, torch.float32)
    runs = [indexer_scores(q, k, w, scoring_precision=precision, backend="cudnn") for _ in range(3)]
    picks = [indexer_topk(r, 2048, backend="cudnn") for r in runs]
    same = all(torch.equal(runs[0], r) for r in runs[1:]) and all(
        torch.equal(picks[0], p) for p in picks[1:]
    )
    record("replays", precision=precision, identical=same)
    assert same


def test_cudnn_topk_selects_exactly_the_torch_set(record):
    g = torch.Generator(device=DEV).manual_seed(1)
    # Real-valued scores plus heavy exact ties (quantized values, zeros) and a causal mask.
    scores = torch.randn(2, 1024, 4096, device=DEV, generator=g)
    scores[0] = torch.round(scores[0] * 2) / 2
    scores[1, :, ::3] = 0.0
    scores = scores.masked_fill(
        torch.ones(4096, 4096, dtype=torch.bool, device=DEV).triu(1)[:1024], float("-inf")
    )
    seq_lens = torch.randint(0, 4097, (2, 1024), device=DEV, generator=g)
    for k in (1, 256, 2048):
        a = indexer_topk(scores, k, seq_lens=seq_lens, backend="cudnn")
        b = indexer_topk(scores, k, seq_lens=seq_lens, backend="torch")
        record("topk_exact", k=k, equal=bool(torch.equal(a, b)))
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_cudnn_equals_single_launch(record, precision):
    q, k, w = _inputs(1, 4096, 64, torch.float32)
    one = indexer_scores(q, k, w, scoring_precision=precision, backend="cudnn")
    chunked = indexer_scores(
        q, k, w, scoring_precision=precision, backend="cudnn", chunk_bytes=1000 * 4096 * 4
    )
    ref = indexer_scores(
        q, k, w, scoring_precision=precision, backend="torch", chunk_bytes=1000 * 4096 * 20
    )
    record(
        "chunked",
        precision=precision,
        bit_identical=bool(torch.equal(one, chunked)),
        max_rel_err=rel_err(chunked, ref),
    )
    assert torch.equal(one, chunked)
    assert rel_err(chunked, ref) <= MAX_REL_ERR[precision]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_thd_varlen_on_cudnn(record, precision):
    lens = [1000, 17, 2500, 579]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    t = sum(lens)
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(t, 32, 128, device=DEV, generator=g)
    k = torch.randn(t, 128, device=DEV, generator=g)
    w = (torch.randn(t, 32, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    kw = dict(scoring_precision=precision, cu_seqlens_q=cu, cu_seqlens_k=cu)
    thd = indexer_scores(q, k, w, backend="cudnn", **kw)
    chunked = indexer_scores(q, k, w, backend="cudnn", chunk_bytes=300 * 2500 * 4, **kw)
    ref = indexer_scores(q, k, w, backend="torch", **kw)
    per_seq_equal = True
    for i, n in enumerate(lens):
        a, z = int(cu[i]), int(cu[i + 1])
        one = indexer_scores(
            q[None, a:z], k[None, a:z], w[None, a:z], scoring_precision=precision, backend="cudnn"
        )[0]
        per_seq_equal &= bool(torch.equal(thd[a:z, :n], one))
    bad = torch.isfinite(chunked) != torch.isfinite(ref)
    where = bad.nonzero()[:5].tolist()
    err = rel_err(thd, ref)
    record(
        "thd",
        precision=precision,
        max_rel_err=err,
        per_sequence_bit_identical=per_seq_equal,
        chunked_bit_identical=bool(torch.equal(thd, chunked)),
        chunked_mask_mismatches=int(bad.sum()),
        first=where,
    )
    assert err <= MAX_REL_ERR[precision]
    assert per_seq_equal
    assert rel_err(chunked, ref) <= MAX_REL_ERR[precision]
