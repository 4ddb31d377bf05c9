"""indexer_scores on the torch backend (CPU) against float64 evaluations of the contract."""

import pytest
import torch

from dsa_precision import indexer_scores, quantize_e4m3_ue8m0, reset_scoring_calls, scoring_calls

from .helpers import contract_scores_f64, rel_err


def _inputs(b=2, sq=33, sk=33, h=32, d=128, dtype=torch.float32):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, d, dtype=dtype)
    w = (torch.randn(b, sq, h) * h**-0.5 * d**-0.5).to(torch.bfloat16)
    return q, k, w


def bf16_contract(q, k, w, *, sm_scale=1.0, **mask):
    return contract_scores_f64(
        q.to(torch.bfloat16).double(),
        k.reshape(k.shape[0], k.shape[1], -1).to(torch.bfloat16).double(),
        w.double(),
        post_scale=sm_scale,
        **mask,
    )


def fp8_contract(q, k, w, *, sm_scale=1.0, **mask):
    q8, qs = quantize_e4m3_ue8m0(q)
    k8, ks = quantize_e4m3_ue8m0(k.reshape(k.shape[0], k.shape[1], -1))
    w_fold = w.double() * qs.double() * sm_scale
    return contract_scores_f64(
        q8.double(), k8.double(), w_fold, post_scale=1.0, key_scale=ks, **mask
    )


@pytest.mark.parametrize("carrier", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision, contract", [("bf16", bf16_contract), ("fp8", fp8_contract)])
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("sm_scale", [1.0, 0.375])
def test_torch_backend_matches_float64_contract(carrier, precision, contract, ratio, sm_scale):
    q, k, w = _inputs(dtype=carrier, sk=40 if ratio == 1 else 10)
    got = indexer_scores(
        q, k, w, scoring_precision=precision, ratio=ratio, sm_scale=sm_scale, backend="torch"
    )
    want = contract(q, k, w, sm_scale=sm_scale, ratio=ratio)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-5


def test_precisions_really_differ():
    q, k, w = _inputs()
    bf16 = indexer_scores(q, k, w, scoring_precision="bf16", backend="torch")
    fp8 = indexer_scores(q, k, w, scoring_precision="fp8", backend="torch")
    assert rel_err(fp8, bf16) > 1e-3


def test_bf16_rounds_fp32_carriers():
    q, k, w = _inputs()
    a = indexer_scores(q, k, w, scoring_precision="bf16", backend="torch")
    b = indexer_scores(
        q.to(torch.bfloat16), k.to(torch.bfloat16), w, scoring_precision="bf16", backend="torch"
    )
    assert torch.equal(a, b)


def test_fp32_weights_and_4d_keys_accepted():
    q, k, w = _inputs()
    a = indexer_scores(q, k, w, scoring_precision="fp8", backend="torch")
    b = indexer_scores(q, k.unsqueeze(2), w.float(), scoring_precision="fp8", backend="torch")
    assert torch.equal(a, b)


def test_causal_offsets_per_batch():
    q, k, w = _inputs(sq=16, sk=48)
    got = indexer_scores(
        q, k, w, scoring_precision="bf16", backend="torch", q_causal_offsets=torch.tensor([32, 5])
    )
    want = bf16_contract(q, k, w, offsets=[32, 5])
    assert rel_err(got, want) <= 1e-5
    assert torch.isinf(got[0, 0, 33:]).all() and torch.isfinite(got[0, 0, :33]).all()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 32])
def test_chunked_equals_unchunked_bit_for_bit(precision, chunk_rows):
    q, k, w = _inputs(sq=37, sk=37)
    full = indexer_scores(q, k, w, scoring_precision=precision, backend="torch")
    budget = chunk_rows * 2 * 37 * 20  # the torch reference's bytes per row
    chunked = indexer_scores(
        q, k, w, scoring_precision=precision, backend="torch", chunk_bytes=budget
    )
    assert torch.equal(full, chunked)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_thd_equals_per_sequence_bshd(precision):
    lens_q, lens_k = [5, 0, 17, 9], [5, 0, 17, 12]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 32, 128)
    k = torch.randn(sum(lens_k), 128)
    w = torch.randn(sum(lens_q), 32).to(torch.bfloat16)
    offsets = torch.tensor([0, 0, 0, 3])  # the last sequence's queries are its keys' tail
    got = indexer_scores(
        q,
        k,
        w,
        scoring_precision=precision,
        backend="torch",
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        q_causal_offsets=offsets,
    )
    assert got.shape == (sum(lens_q), max(lens_k))
    for i in range(4):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        one = indexer_scores(
            q[None, q0:q1],
            k[None, k0:k1],
            w[None, q0:q1],
            scoring_precision=precision,
            backend="torch",
            q_causal_offsets=offsets[i : i + 1],
        )[0]
        assert torch.equal(got[q0:q1, : k1 - k0], one)
        assert torch.isinf(got[q0:q1, k1 - k0 :]).all()
    chunked = indexer_scores(
        q,
        k,
        w,
        scoring_precision=precision,
        backend="torch",
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        q_causal_offsets=offsets,
        chunk_bytes=3 * 12 * 20,
    )
    assert torch.equal(got, chunked)


def _one_lane(value, h=32):
    q = torch.zeros(1, 1, h, 128)
    q[0, 0, 0, 0] = value
    k = torch.zeros(1, 1, 128)
    k[0, 0, 0] = value
    w = torch.zeros(1, 1, h)
    w[0, 0, 0] = 1.0
    return q, k, w


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_bf16_regression_fp32_1_001_scores_exactly_one(chunk_bytes):
    """q = k = 1.001 (FP32), weight 1, one valid key: BF16 scoring rounds both to 1.0 -> exactly 1.0."""
    q, k, w = _one_lane(1.001)
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    got = indexer_scores(q, k, w.float(), scoring_precision="bf16", backend="torch", **kw)
    assert got.item() == 1.0
    # With a key cached across several chunks (two query rows, one row per chunk).
    q2 = torch.cat([q, q], 1)
    k2 = torch.cat([k, k], 1)
    w2 = torch.cat([w, w], 1).float()
    got2 = indexer_scores(q2, k2, w2, scoring_precision="bf16", backend="torch", chunk_bytes=1)
    assert got2[0, 0, 0].item() == 1.0 and got2[0, 1].tolist() == [1.0, 1.0]


def test_scoring_calls_are_counted():
    q, k, w = _inputs(sq=4, sk=4)
    reset_scoring_calls()
    indexer_scores(q, k, w, scoring_precision="fp8", backend="torch", chunk_bytes=1)
    indexer_scores(q, k, w, scoring_precision="bf16", backend="torch")
    assert (
        scoring_calls("fp8") == 1 and scoring_calls("bf16", "torch") == 1 and scoring_calls() == 2
    )


def _bad(**kw):
    q, k, w = _inputs(sq=4, sk=4)
    args = dict(q=q, k=k, weights=w, scoring_precision="bf16", backend="torch")
    args.update(kw)
    return args


@pytest.mark.parametrize(
    "args, err, match",
    [
        (
            _bad(scoring_precision="fp8", q=torch.randn(2, 4, 32, 64), k=torch.randn(2, 4, 64)),
            ValueError,
            "head dim 64",
        ),
        (
            _bad(
                scoring_precision="fp8", q=torch.randn(2, 4, 16, 128), weights=torch.randn(2, 4, 16)
            ),
            ValueError,
            "q has 16",
        ),
        (_bad(q=torch.randn(2, 4, 32 * 128)), ValueError, "expected q"),
        (_bad(k=torch.randn(3, 4, 128)), ValueError, "batch mismatch"),
        (_bad(k=torch.randn(2, 4, 2, 128)), ValueError, "k has 2 heads"),
        (_bad(weights=torch.randn(2, 4, 16)), ValueError, "weights has shape"),
        (_bad(k=torch.randn(2, 4, 64)), ValueError, "head dim mismatch"),
        (
            _bad(q=torch.ones(2, 4, 32, 128, dtype=torch.int32)),
            TypeError,
            "q has dtype torch.int32",
        ),
        (_bad(weights=torch.ones(2, 4, 32, dtype=torch.int64)), TypeError, "weights has dtype"),
        (_bad(scoring_precision="int8"), ValueError, "'bf16', 'fp8'"),
        (_bad(backend="triton"), ValueError, "backend='triton'"),
        (_bad(ratio=0), ValueError, "ratio=0"),
        (_bad(q_causal_offsets=torch.tensor([1])), ValueError, "q_causal_offsets has 1"),
        (_bad(q_causal_offsets=torch.tensor([-1, 0])), ValueError, "non-negative"),
        (_bad(cu_seqlens_q=torch.tensor([0, 4])), ValueError, "needs both"),
        (_bad(k=[[0.0]]), TypeError, "k must be a torch.Tensor"),
    ],
)
def test_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        indexer_scores(**args)


def test_explicit_cudnn_without_gpu_raises():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    q, k, w = _inputs(sq=4, sk=4)
    with pytest.raises(RuntimeError, match="backend='cudnn' cannot score this call"):
        indexer_scores(q, k, w, scoring_precision="fp8", backend="cudnn")
    # auto serves it with the reference, same precision.
    reset_scoring_calls()
    indexer_scores(q, k, w, scoring_precision="fp8", backend="auto")
    assert scoring_calls("fp8", "torch") == 1


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_prepared_operands_score_like_carriers(precision):
    from dsa_precision.scoring import prepare_scoring_operands

    q, k, w = _inputs(sq=9, sk=9)
    ops = prepare_scoring_operands(q, k, w, scoring_precision=precision, sm_scale=0.5)
    from dsa_precision.scoring import _indexer_forward

    a = _indexer_forward(
        None, None, None, scoring_precision=precision, operands=ops, backend="torch"
    )
    b = indexer_scores(q, k, w, scoring_precision=precision, sm_scale=0.5, backend="torch")
    assert torch.equal(a, b)
    other = "bf16" if precision == "fp8" else "fp8"
    with pytest.raises(ValueError, match="operands were prepared for"):
        _indexer_forward(None, None, None, scoring_precision=other, operands=ops, backend="torch")
    with pytest.raises(ValueError, match="either q, k, weights or operands"):
        _indexer_forward(q, None, None, scoring_precision=precision, operands=ops, backend="torch")
