"""The real kernels on an SM90 GPU: cuDNN's indexer scoring and radix top-k against the exact torch
reference on the same operands (BF16 and FP8, BSHD and packed THD, chunked selection), DeepGEMM's
MQA logits against a direct call, through both entry points and against cuDNN, and the two
promises of the device path: no host synchronisation, and capture in a CUDA graph."""

import importlib
import types

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
    topk_agreement,
)
from dsa_precision import rows as rows_module
from dsa_precision.backends import deepgemm as deepgemm_backend
from dsa_precision.rows import (
    _varlen_key_counts,
    _varlen_row_slice,
    _varlen_windows,
    causal_key_counts,
)

from ..support.configs import CONFIGS, FP8
from ..support.helpers import (
    CALC_DIFF_MAX,
    MAX_REL_ERR,
    assert_bitwise_equal,
    calc_diff,
    needs_deepgemm,
    no_host_sync,
    rel_err,
    ulp_distance,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _inputs(b, s, h, carrier=torch.float32, seed=0, sk=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, h, 128, device=DEV, generator=g).to(carrier)
    k = torch.randn(b, sk or s, 128, device=DEV, generator=g).to(carrier)
    w = (torch.randn(b, s, h, device=DEV, generator=g) * h**-0.5 * 128**-0.5).to(torch.bfloat16)
    return q, k, w


def _packed(lens_q, lens_k, h=32, seed=2):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(sum(lens_q), h, 128, device=DEV, generator=g)
    k = torch.randn(sum(lens_k), 128, device=DEV, generator=g)
    w = (torch.randn(sum(lens_q), h, device=DEV, generator=g) * 0.02).to(torch.bfloat16)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(DEV)

    return q, k, w, cu(lens_q), cu(lens_k)


def member_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(topk_agreement(a, b).member_agreement)


# ------------------------------------------------------------------ cuDNN vs the reference


@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("carrier", [torch.bfloat16, torch.float32], ids=["bf16_in", "fp32_in"])
def test_cudnn_matches_torch_reference(record, h, precision, carrier):
    b, s, topk = 1, 4096, 2048
    q, k, w = _inputs(b, s, h, carrier)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
    reset_scoring_calls()
    got = indexer_scores(ops, backend="cudnn")
    ref = indexer_scores(ops, backend="torch")
    assert scoring_calls(precision, "cudnn") == 1 and scoring_calls(precision, "torch") == 1
    err, diff = rel_err(got, ref), calc_diff(got, ref)  # rel_err: identical -inf patterns too
    agree = member_agreement(
        indexer_topk(got, topk, backend="cudnn"), indexer_topk(ref, topk, backend="torch")
    )
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
def test_cudnn_offsets_ratio_and_sm_scale_match_the_reference(record, precision):
    q, k, w = _inputs(2, 1024, 64, sk=1300)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision], sm_scale=0.37)
    kw = dict(ratio=4, q_causal_offsets=torch.tensor([0, 4000], device=DEV))
    got = indexer_scores(ops, backend="cudnn", **kw)
    ref = indexer_scores(ops, backend="torch", **kw)
    err = rel_err(got, ref)
    record("cudnn_offsets_ratio", precision=precision, max_rel_err=err)
    assert err <= MAX_REL_ERR[precision] and calc_diff(got, ref) <= CALC_DIFF_MAX


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_thd_varlen_on_cudnn(record, precision):
    lens = [1000, 17, 2500, 579]
    q, k, w, cu, _ = _packed(lens, lens)
    offsets = torch.tensor([0, 5, 0, 300], device=DEV)
    kw = dict(
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=2500,
        max_seqlen_k=2600,  # padding columns past the longest sequence
        config=CONFIGS[precision],
        q_causal_offsets=offsets,
    )
    thd = indexer_scores_varlen(q, k, w, backend="cudnn", **kw)
    ref = indexer_scores_varlen(q, k, w, backend="torch", **kw)
    per_seq_equal = True
    for i, n in enumerate(lens):
        a, z = int(cu[i]), int(cu[i + 1])
        one = indexer_scores(
            q[None, a:z], k[None, a:z], w[None, a:z], config=CONFIGS[precision],
            q_causal_offsets=offsets[i : i + 1], backend="cudnn",
        )[0]  # fmt: skip
        per_seq_equal &= bool(torch.equal(thd[a:z, :n], one))
        assert (thd[a:z, n:] == -float("inf")).all()
    err = rel_err(thd, ref)
    record("thd", precision=precision, max_rel_err=err, per_sequence_bit_identical=per_seq_equal)
    assert err <= MAX_REL_ERR[precision]
    assert per_seq_equal


# ----------------------------------------------------------- chunks and select on cuDNN


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_row_chunks_are_the_rows_of_one_launch(precision):
    q, k, w = _inputs(2, 2048, 64)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
    offsets = torch.tensor([0, 77], device=DEV)
    full = indexer_scores(ops, q_causal_offsets=offsets, backend="cudnn")
    for r0, r1 in ((0, 512), (512, 1037), (1037, 2048)):
        part = indexer_scores(ops.rows(r0, r1), q_causal_offsets=offsets + r0, backend="cudnn")
        assert_bitwise_equal(part, full[:, r0:r1], f"{precision} rows {r0}:{r1}")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_select_equals_scores_then_topk_on_cudnn(record, precision):
    q, k, w = _inputs(1, 4096, 64)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
    scores = indexer_scores(ops, backend="cudnn")
    lens = causal_key_counts(torch.zeros(1, dtype=torch.int32, device=DEV), 0, 4096, 1, 4096)
    want = indexer_topk(scores, 2048, seq_lens=lens, backend="cudnn")
    got = indexer_select(ops, topk=2048, backend="cudnn", chunk_bytes=600 * 4096 * 12)
    record("select_chunked", precision=precision, bit_identical=bool(torch.equal(got, want)))
    assert torch.equal(got, want)
    # And the torch backend selects the same keys from the exact scores (up to FP8 rounding).
    ref = indexer_select(ops, topk=2048, backend="torch")
    assert member_agreement(got, ref) >= 0.9999


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunked_select_varlen_equals_scores_then_topk_on_cudnn(precision):
    lens = [700, 33, 1500, 301]
    q, k, w, cu, _ = _packed(lens, lens)
    kw = dict(
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500,
        config=CONFIGS[precision], backend="cudnn",
    )  # fmt: skip
    scores = indexer_scores_varlen(q, k, w, **kw)
    offsets = torch.zeros(4, dtype=torch.int32, device=DEV)
    lens_t = _varlen_key_counts(cu, cu, offsets, 1, sum(lens))
    want = indexer_topk(scores, 512, seq_lens=lens_t, backend="cudnn")
    got = indexer_select_varlen(q, k, w, topk=512, chunk_bytes=256 * 1500 * 12, **kw)
    assert torch.equal(got, want)  # 256-row chunks cut three of the four sequences


@pytest.mark.parametrize("ratio", [1, 4])
def test_varlen_windows_are_one_launch_with_the_cpu_expressions_values(ratio):
    """On CUDA the THD windows come from one Triton launch (kernels/varlen_windows.py); they are
    the integers of the torch expression (the CPU path), for a whole packing and for chunks."""
    lens_q, lens_k = [3000, 1, 0, 4907, 283], [3000, 7, 4, 4000, 283]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    offsets = torch.tensor([0, 5, 0, 17, 2], dtype=torch.int32)
    cases = [(cu_q, offsets, sum(lens_q))]
    for r0, r1 in ((0, 2048), (2048, 5120), (5120, 8191)):
        cu_chunk, off_chunk = _varlen_row_slice(cu_q, offsets, r0, r1)
        cases.append((cu_chunk, off_chunk.to(torch.int32), r1 - r0))
    for cu, off, rows in cases:
        want = _varlen_windows(cu, cu_k, off, ratio, rows)
        args = (cu.to(DEV), cu_k.to(DEV), off.to(DEV))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = _varlen_windows(*args, ratio, rows)
            torch.cuda.synchronize()
        names = [e.key for e in prof.key_averages()]
        assert any("_varlen_windows_kernel" in n for n in names), names
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), b), (name, rows)


def _clear_shared_constants():
    rows_module._constant_offsets.cache_clear()
    rows_module._constant_key_counts.cache_clear()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("chunk_rows", [None, 512, 200], ids=["one_launch", "512", "200"])
def test_select_is_the_public_scores_then_topk_on_cudnn(record, precision, chunk_rows):
    """indexer_select checks its arguments and decides both backends once, then calls the
    kernels' internal entry points (with shared offset and key-count tensors for an int offset,
    Megatron's case): the picks are those of the public indexer_scores + indexer_topk, bit for
    bit, for int and tensor offsets, chunked or not, and on the second call (cached constants)
    as on the first."""
    _clear_shared_constants()
    b, s, topk = 2, 2048, 256
    q, k, w = _inputs(b, s, 64, seed=11)
    ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
    chunk = None if chunk_rows is None else chunk_rows * b * s * 12
    for offset in (0, 300, 0):
        offsets = torch.full((b,), offset, dtype=torch.int32, device=DEV)
        scores = indexer_scores(ops, q_causal_offsets=offsets, backend="cudnn")
        lens = causal_key_counts(offsets, 0, s, 1, s)
        want = indexer_topk(scores, topk, seq_lens=lens, backend="cudnn")
        # "auto": the fastest exact kernel present (DeepGEMM for FP8 when installed), decided
        # as the public indexer_scores decides it
        auto = indexer_scores(ops, q_causal_offsets=offsets, backend="auto")
        want_auto = indexer_topk(auto, topk, seq_lens=lens, backend="cudnn")
        for given in (offset, offsets, offset):
            got = indexer_select(
                ops, topk=topk, q_causal_offsets=given, backend="cudnn", chunk_bytes=chunk
            )
            assert torch.equal(got, want), (offset, type(given).__name__)
            got2, margins = indexer_select(
                ops, topk=topk, q_causal_offsets=given, backend="auto", chunk_bytes=chunk,
                margins=True,
            )  # fmt: skip
            assert torch.equal(got2, want_auto) and margins.shape == (b, s)
    record("select_internal_path", precision=precision, chunk_rows=chunk_rows, bit_identical=True)


def _int_offset_select_warmed(offset: int, seed: int):
    """FP8 operands, chunked-select arguments and the picks with the offset as a tensor; the
    int-offset select run twice on a side stream (every kernel compiled, every cache filled)."""
    q, k, w = _inputs(1, 2048, 64, seed=seed)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    kw = dict(topk=512, backend="cudnn", chunk_bytes=512 * 2048 * 12)
    want = indexer_select(ops, q_causal_offsets=torch.tensor([offset], device=DEV), **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            indexer_select(ops, q_causal_offsets=offset, **kw)
    torch.cuda.current_stream().wait_stream(side)
    return ops, kw, want


def test_select_with_int_offsets_builds_its_constants_outside_a_graph_capture():
    """The shared int-offset tensors are built outside inference mode, and a CUDA graph capture
    bypasses their cache (it would record their build instead of running it, and a replay must
    not read an entry evicted since): the capture builds its own, eager calls after it build
    and cache correct ones, and the replay is unaffected when the cache is cleared."""
    ops, kw, want = _int_offset_select_warmed(offset=64, seed=12)
    _clear_shared_constants()  # the capture is the first to need them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = indexer_select(ops, q_causal_offsets=64, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)
    with torch.inference_mode():
        eager = indexer_select(ops, q_causal_offsets=64, **kw)  # built now, eagerly
    assert torch.equal(eager, want)

    assert not rows_module._constant_offsets(64, 1, torch.device(DEV)).is_inference()
    _clear_shared_constants()  # frees the eager entries: the graph never read them
    indexer_select(ops, q_causal_offsets=96, **kw)  # other allocations may take their memory
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


# ---------------------------------------------------------------------- top-k on cuDNN


def test_cudnn_topk_selects_exactly_the_torch_set_on_tie_free_scores(record):
    g = torch.Generator(device=DEV).manual_seed(1)
    # Each row a permutation of 0 .. S_k - 1: no ties; a causal mask and random seq_lens.
    scores = torch.rand(2, 1024, 4096, device=DEV, generator=g).argsort(-1).float()
    causal = torch.ones(1024, 4096, dtype=torch.bool, device=DEV).triu(1 + 3072)
    scores = scores.masked_fill(causal, float("-inf"))
    seq_lens = torch.randint(0, 4097, (2, 1024), device=DEV, generator=g, dtype=torch.int32)
    for k in (1, 256, 2048):
        a = indexer_topk(scores, k, seq_lens=seq_lens, backend="cudnn")
        b = indexer_topk(scores, k, seq_lens=seq_lens, backend="torch")
        record("topk_exact", k=k, equal=bool(torch.equal(a, b)))
        assert torch.equal(a, b), k


@pytest.mark.parametrize(
    "dtype, deterministic",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
    ids=["fp32", "bf16", "fp32_fast"],
)
def test_topk_plan_is_the_wrapper_bit_for_bit(dtype, deterministic):
    """indexer_topk runs cuDNN's IndexerTopK plan into its own buffers (no wrapper): the same
    picks as indexer_top_k_wrapper on the same scores, -inf / NaN picks dropped as before, for
    aligned, misaligned (a copy) and strided (a copy) scores, several k, repeated calls.
    Deterministic mode: scores with ties and -inf, equal index for index; the fast mode (ties
    resolved arbitrarily): distinct finite scores, equal as sets."""
    from dsa_precision.backends import cudnn as cudnn_backend

    dsa = cudnn_backend.dsa()
    g = torch.Generator(device=DEV).manual_seed(8)
    n = 2048 * 3000 + 8
    if deterministic:
        raw = torch.round(torch.randn(n, device=DEV, generator=g) * 4) / 4  # many ties
        raw[5::89] = float("-inf")  # (NaN: test_cudnn_topk_deterministic_ties_signed_zeros_...)
    else:
        raw = torch.randperm(n, device=DEV, generator=g).float()  # distinct, exact in fp32
    raw = raw.to(dtype)
    views = {
        "aligned": raw[: 2048 * 3000].view(2048, 3000),
        "misaligned": raw[3 : 3 + 2048 * 3000].view(2048, 3000),
        "strided": raw[: 2048 * 3000].view(2048, 3000)[:, ::2],
    }
    for name, scores in views.items():
        sk = scores.shape[1]
        lens = torch.randint(0, sk + 1, (2048,), device=DEV, generator=g, dtype=torch.int32)
        for k in (1, 256, 2048):
            for _ in range(2):
                got = indexer_topk(
                    scores, k, seq_lens=lens, deterministic=deterministic, backend="cudnn"
                )
                res = dsa.indexer_top_k_wrapper(
                    scores.contiguous(), lens, top_k=min(k, sk), return_val=True,
                    deterministic=deterministic,
                )  # fmt: skip
                want = res["indices"].masked_fill(~(res["values"] > float("-inf")), -1)
                want = torch.nn.functional.pad(want, (0, k - want.shape[1]), value=-1)
                if deterministic:
                    assert torch.equal(got, want), (name, k)
                else:  # the fast mode's order within a row is unspecified
                    assert torch.equal(got.sort(-1).values, want.sort(-1).values), (name, k)


def test_cudnn_topk_deterministic_ties_signed_zeros_and_nan():
    g = torch.Generator(device=DEV).manual_seed(5)
    scores = torch.round(torch.randn(3, 256, 2048, device=DEV, generator=g) * 2) / 2  # ties
    scores[1, :, ::3] = 0.0
    scores[1, :, 1::3] = -0.0
    nan = torch.zeros_like(scores, dtype=torch.bool)
    nan[2, :64] = torch.rand(64, 2048, device=DEV, generator=g) < 0.01  # 64 rows with NaN
    scores = scores.masked_fill(nan, float("nan"))
    a = indexer_topk(scores, 300, backend="cudnn")
    b = indexer_topk(scores, 300, backend="torch")
    picked_nan = nan.gather(-1, a.clamp(min=0).long()) & (a >= 0)
    assert not picked_nan.any(), "cuDNN's top-k returned a NaN key"
    # Rows without NaN: the same set in deterministic mode (ties toward lower indices, +0
    # above -0). Rows with NaN: cuDNN may pick a NaN (then -1) where torch skips it, so its
    # valid picks are a subset of torch's.
    clean = ~nan.any(-1)
    assert torch.equal(a[clean], b[clean])
    for row in (~clean).nonzero().tolist():
        ra, rb = set(a[tuple(row)].tolist()) - {-1}, set(b[tuple(row)].tolist()) - {-1}
        assert ra <= rb, row


# --------------------------------------------------------------------------------- DeepGEMM


def _deepgemm_module():
    return importlib.import_module(deepgemm_backend._entry_point().rsplit(".", 1)[0])


def _direct_logits(ops, b, ks, ke, max_seqlen_k, clean):
    """DeepGEMM called by hand on batch row ``b`` of ``ops`` (its current name, else 2.8's)."""
    module = _deepgemm_module()
    kv = (ops.k[b].contiguous(), ops.k_descale[b].contiguous())
    args = ((ops.q[b].contiguous(), None), kv, ops.weights[b].contiguous(), ks, ke)
    if deepgemm_backend._kernel_entry().clean_logits_arg:
        return module.fp8_fp4_mqa_logits(*args, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    return module.fp8_fp4_mqa_logits(*args, max_seqlen_k=max_seqlen_k or kv[0].shape[0])


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_deepgemm_backend_is_the_direct_kernel_call(h):
    q, k, w = _inputs(1, 2048, h)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    got = indexer_scores(ops, backend="deepgemm")
    rows = torch.arange(2048, device=DEV, dtype=torch.int32)
    direct = _direct_logits(ops, 0, torch.zeros_like(rows), rows + 1, 0, True)
    direct = direct.masked_fill(rows[None, :] > rows[:, None], float("-inf"))  # 2.8: unwritten
    assert_bitwise_equal(got[0].contiguous(), direct.contiguous(), "deepgemm backend vs direct")


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_deepgemm_packed_launch_gives_each_batch_rows_own_logits(h):
    """Batch rows flattened into one launch (row b's keys at b * S_k) give the logits of each row
    launched alone, bit for bit, inside every causal window."""
    q, k, w = _inputs(3, 2048, h, seed=11)
    ops = prepare_scoring_operands(q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8"))
    offsets = torch.tensor([0, 64, 1000], device=DEV)
    got = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
    counts = causal_key_counts(offsets, 0, 2048, 1, 2048)
    cols = torch.arange(2048, device=DEV)
    for b in range(3):
        alone = _direct_logits(ops, b, torch.zeros_like(counts[b]), counts[b], 2048, False)
        alone = alone.masked_fill(cols >= counts[b].unsqueeze(1), float("-inf"))
        assert_bitwise_equal(got[b].contiguous(), alone.contiguous(), f"batch row {b}")


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_deepgemm_select_is_the_top_k_of_its_scores(h):
    """indexer_select(backend="deepgemm") reads DeepGEMM's uncleaned logits in place: its picks
    are the deterministic top-k of the masked scores, bit for bit (cuDNN's radix top-k and the
    torch reference), chunked or not, BSHD and packed."""
    q, k, w = _inputs(2, 4096, h, seed=12)
    ops = prepare_scoring_operands(q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8"))
    offsets = torch.tensor([0, 96], device=DEV)
    scores = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
    lens = causal_key_counts(offsets, 0, 4096, 1, 4096)
    want = indexer_topk(scores, 2048, seq_lens=lens, backend="cudnn")
    assert torch.equal(want, indexer_topk(scores, 2048, seq_lens=lens, backend="torch"))
    for chunk_bytes in (None, 64 << 20):
        got = indexer_select(ops, topk=2048, q_causal_offsets=offsets, backend="deepgemm",
                             chunk_bytes=chunk_bytes)  # fmt: skip
        assert torch.equal(got, want), chunk_bytes
    lens_q = [1700, 33, 2900, 301]
    pq, pk, pw, cu, _ = _packed(lens_q, lens_q, h=h)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2900, max_seqlen_k=2900)
    packed = indexer_scores_varlen(pq, pk, pw, config=IndexerPrecisionConfig(scoring_precision="fp8"), backend="deepgemm",
                                   **varlen)  # fmt: skip
    counts = _varlen_key_counts(cu, cu, torch.zeros(4, dtype=torch.int32, device=DEV), 1, 4934)
    want = indexer_topk(packed, 2048, seq_lens=counts, backend="cudnn")
    for chunk_bytes in (None, 32 << 20):
        got = indexer_select_varlen(
            pq, pk, pw, topk=2048, config=IndexerPrecisionConfig(scoring_precision="fp8"), backend="deepgemm",
            chunk_bytes=chunk_bytes, **varlen,
        )  # fmt: skip
        assert torch.equal(got, want), chunk_bytes


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_deepgemm_uncleaned_scores_are_its_compressed_call(h):
    """``clean=False`` is DeepGEMM's compressed uncleaned call and nothing else: inside every
    window its logits bit for bit (each batch row launched alone; the packing called by hand with
    its windows), the causal limits beside them; masked, the default scores; its top-k, theirs."""
    q, k, w = _inputs(2, 2048, h, seed=13)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    offsets = torch.tensor([0, 300], device=DEV)
    window = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm", clean=False)
    counts = causal_key_counts(offsets, 0, 2048, 1, 2048)
    assert torch.equal(window.lengths, counts)
    cols = torch.arange(2048, device=DEV)
    for b in range(2):
        inside = cols < counts[b].unsqueeze(1)
        alone = _direct_logits(ops, b, torch.zeros_like(counts[b]), counts[b], 2048, False)
        assert_bitwise_equal(window.scores[b][inside], alone[inside], f"batch row {b}")
    clean = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
    picks = indexer_topk(window, 2048, backend="cudnn")
    assert torch.equal(picks, indexer_topk(clean, 2048, seq_lens=counts, backend="cudnn"))
    assert_bitwise_equal(window.masked().contiguous(), clean.contiguous(), "masked vs clean")
    lens = [700, 33, 1500, 301]
    pq, pk, pw, cu, _ = _packed(lens, lens, h=h)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
    pops = prepare_scoring_operands(pq.unsqueeze(0), pk.unsqueeze(0), pw.unsqueeze(0), config=FP8)
    window = indexer_scores_varlen(pops, backend="deepgemm", clean=False, **varlen)
    counts = _varlen_key_counts(cu, cu, torch.zeros(4, dtype=torch.int32, device=DEV), 1, 2534)
    starts = torch.repeat_interleave(cu[:-1], torch.tensor(lens, device=DEV)).to(torch.int32)
    direct = _direct_logits(pops, 0, starts, starts + counts, 1500, False)
    inside = torch.arange(1500, device=DEV) < counts.unsqueeze(1)
    assert torch.equal(window.lengths, counts)
    assert_bitwise_equal(window.scores[inside], direct[inside], "packed, inside the windows")
    clean = indexer_scores_varlen(pops, backend="deepgemm", **varlen)
    assert torch.equal(indexer_topk(window, 512), indexer_topk(clean, 512, seq_lens=counts))
    assert_bitwise_equal(window.masked().contiguous(), clean.contiguous(), "packed: masked")


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_both_entry_points_give_the_same_scores(monkeypatch, h):
    """The host's build (54e2261) has both names: the legacy ``fp8_mqa_logits(q, ...)`` is a
    wrapper of ``fp8_fp4_mqa_logits((q, None), ...)``; through either the package gives the same
    bits, BSHD (one launch of two batch rows), packed (windows in the middle) and selected."""
    module = _deepgemm_module()
    if not (hasattr(module, "fp8_mqa_logits") and hasattr(module, "fp8_fp4_mqa_logits")):
        pytest.skip(f"{module.__name__} does not have both entry points")
    q, k, w = _inputs(2, 2048, h, seed=5)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    lens = [700, 33, 1500, 301]
    pq, pk, pw, cu, _ = _packed(lens, lens, h=h)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
    offsets = torch.tensor([0, 64], device=DEV)

    def run():
        bshd = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
        packed = indexer_scores_varlen(pq, pk, pw, config=FP8,
                                       backend="deepgemm", **varlen)  # fmt: skip
        picks = indexer_select(ops, topk=512, q_causal_offsets=offsets, backend="deepgemm")
        return bshd, packed, picks

    detected = deepgemm_backend._kernel_entry()
    assert detected.q_pair  # fp8_fp4_mqa_logits is preferred
    current = run()
    legacy = types.SimpleNamespace(fp8_mqa_logits=module.fp8_mqa_logits)
    entry, reason = deepgemm_backend._resolve(legacy, module.__name__)
    assert entry is not None and not entry.q_pair, reason
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (entry, None))
    old = run()
    for name, a, b in zip(("BSHD", "packed", "picks"), current, old, strict=True):
        assert_bitwise_equal(a, b, f"{name}: fp8_fp4_mqa_logits vs fp8_mqa_logits")
    assert torch.isfinite(current[1]).sum() == sum(n * (n + 1) // 2 for n in lens)


@needs_deepgemm
@pytest.mark.parametrize("h", [32, 64])
def test_cudnn_fp8_vs_deepgemm_on_identical_operands(record, h):
    q, k, w = _inputs(1, 4096, h, seed=7)
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    a = indexer_scores(ops, backend="cudnn")
    b = indexer_scores(ops, backend="deepgemm")
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    equal_share = float((a[fin] == b[fin]).double().mean())
    ulps = ulp_distance(a[fin], b[fin])
    max_ulp = int(ulps.max())  # near zero this counts the many tiny floats between them
    large = b[fin].abs() >= 1e-3 * b[fin].abs().max()
    max_ulp_large = int(ulps[large].max())  # scores above 1e-3 of the largest
    ta, tb = indexer_topk(a, 2048, backend="cudnn"), indexer_topk(b, 2048, backend="cudnn")
    rows_identical = float((ta == tb).all(-1).double().mean())
    print(
        f"\ncuDNN fp8 vs DeepGEMM, {h} heads: bitwise-equal logits {equal_share:.6f}, "
        f"max ULP {max_ulp} ({max_ulp_large} above 1e-3 of the largest score), "
        f"top-2048 rows identical {rows_identical:.6f}, "
        f"rel err {rel_err(a, b):.3e}"
    )
    record(
        "cudnn_vs_deepgemm", heads=h, equal_share=equal_share, max_ulp=max_ulp,
        max_ulp_large=max_ulp_large, rows_identical=rows_identical,
    )  # fmt: skip
    assert rows_identical >= 0.99
    assert rel_err(a, b) <= MAX_REL_ERR["fp8"]


# ------------------------------------------------------------------ no host synchronisation


def _run_twice_without_host_sync(run):
    """``run()`` once (compiling the kernels, which may synchronise), then again with every host
    synchronisation raising; the two results must be equal. Returns the first."""
    warm = run()
    with no_host_sync():
        again = run()
    for a, b in zip(warm, again, strict=True):
        assert torch.equal(a, b)
    return warm


def test_device_path_never_waits_for_the_host():
    q, k, w = _inputs(2, 1024, 64)
    lens = [300, 1, 700, 1047]
    pq, pk, pw, cu, _ = _packed(lens, lens)
    offsets = torch.tensor([0, 128], device=DEV)

    def run():
        ops = prepare_scoring_operands(q, k, w, config=FP8, impl="triton")
        scores = indexer_scores(ops, q_causal_offsets=offsets, backend="cudnn")
        seq_lens = causal_key_counts(offsets, 0, 1024, 1, 1024)
        picks = indexer_topk(scores, 256, seq_lens=seq_lens, backend="cudnn")
        sel = indexer_select(
            ops,
            topk=256,
            q_causal_offsets=offsets,
            backend="cudnn",
            chunk_bytes=256 * 2 * 1024 * 12,
        )
        packed = prepare_scoring_operands(pq[None], pk[None], pw[None], config=FP8, impl="triton")
        sel_v = indexer_select_varlen(
            packed, topk=256, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1047,
            max_seqlen_k=1047, backend="cudnn", chunk_bytes=512 * 1047 * 12,
        )  # fmt: skip
        return picks, sel, sel_v

    warm = _run_twice_without_host_sync(run)
    assert torch.equal(warm[0], warm[1])  # chunked select == scores then top-k


def test_int_offset_select_never_waits_for_the_host_even_building_its_constants():
    """Megatron's path (an int offset): the shared offset and key-count tensors are built on the
    device (no host-to-device copy), so even their first build never synchronises."""
    q, k, w = _inputs(1, 1024, 64, seed=13)
    ops = prepare_scoring_operands(q, k, w, config=FP8, impl="triton")
    kw = dict(topk=256, backend="cudnn")
    indexer_select(ops, q_causal_offsets=40, **kw)  # compile the kernels
    _clear_shared_constants()
    with no_host_sync():
        got = indexer_select(ops, q_causal_offsets=40, **kw)
        again = indexer_select(ops, q_causal_offsets=40, **kw)
    want = indexer_select(ops, q_causal_offsets=torch.tensor([40], device=DEV), **kw)
    assert torch.equal(got, want) and torch.equal(again, want)


@needs_deepgemm
def test_deepgemm_select_never_waits_for_the_host():
    q, k, w = _inputs(2, 1024, 64, seed=4)
    lens = [300, 1, 700, 1047]
    pq, pk, pw, cu, _ = _packed(lens, lens, h=64)
    offsets = torch.tensor([0, 128], device=DEV)
    ops = prepare_scoring_operands(
        q, k, w, config=IndexerPrecisionConfig(scoring_precision="fp8"), impl="triton"
    )
    packed = prepare_scoring_operands(
        pq[None],
        pk[None],
        pw[None],
        config=IndexerPrecisionConfig(scoring_precision="fp8"),
        impl="triton",
    )

    def run():
        sel = indexer_select(ops, topk=256, q_causal_offsets=offsets, backend="deepgemm",
                             chunk_bytes=256 * 2 * 1024 * 12)  # fmt: skip
        sel_v = indexer_select_varlen(
            packed, topk=256, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1047,
            max_seqlen_k=1047, backend="deepgemm", chunk_bytes=512 * 1047 * 12,
        )  # fmt: skip
        return sel, sel_v

    _run_twice_without_host_sync(run)


# -------------------------------------------------------------------------- CUDA graph


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_prepare_and_select_capture_in_a_cuda_graph(precision):
    q, k, w = _inputs(1, 2048, 64, seed=9)
    offsets = torch.tensor([64], device=DEV)

    def step():
        ops = prepare_scoring_operands(q, k, w, config=CONFIGS[precision])
        return indexer_select(
            ops, topk=512, q_causal_offsets=offsets, backend="cudnn", chunk_bytes=512 * 2048 * 12
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile every kernel outside the capture
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(captured.clone())
    for r in replays:
        assert torch.equal(r, eager), precision
