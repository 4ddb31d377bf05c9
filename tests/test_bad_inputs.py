"""Every public entry point answers bad input with an error naming the argument, the value and the
fix (table-driven: the exception type and a pattern of its message), never with a silent
fallback; data-dependent checks run with ``validate=True`` and name the tensor and the index."""

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    IndexerPreprocess,
    ScoringOperands,
    dequantize_fp8,
    indexer_scores,
    indexer_scores_varlen,
    indexer_select,
    indexer_select_varlen,
    indexer_topk,
    prepare_indexer_operands,
    prepare_scoring_operands,
    quantize_e4m3_ue8m0,
    quantize_fp8,
    ue8m0_descale,
)
from dsa_precision.engines import Fp8Rule
from dsa_precision.prepare import _as_scoring_operands

from .support.configs import CONFIGS
from .support.fused_attention import fused_indexer_sparse_attention
from .support.helpers import cu_seqlens

META = torch.device("meta")
BF16 = IndexerPrecisionConfig()
FP8 = IndexerPrecisionConfig(scoring_precision="fp8")


def qkw(b=1, sq=8, sk=8, h=32, d=128):
    return torch.randn(b, sq, h, d), torch.randn(b, sk, d), torch.randn(b, sq, h).to(torch.bfloat16)


def fp8_tensors(b=1, sq=4, sk=4, h=32):
    """The tensors of valid FP8 operands, as a dict of ScoringOperands fields."""
    return dict(
        q=torch.zeros(b, sq, h, 128, dtype=torch.float8_e4m3fn),
        k=torch.zeros(b, sk, 128, dtype=torch.float8_e4m3fn),
        weights=torch.zeros(b, sq, h),
        q_descale=torch.ones(b, sq, h),
        k_descale=torch.ones(b, sk),
    )


def bf16_tensors(b=1, sq=4, sk=4, h=32):
    return dict(
        q=torch.zeros(b, sq, h, 128, dtype=torch.bfloat16),
        k=torch.zeros(b, sk, 128, dtype=torch.bfloat16),
        weights=torch.zeros(b, sq, h, dtype=torch.bfloat16),
    )


def operands(base, **changes):
    return lambda: ScoringOperands(**{**base(), **changes})


def scores(**kw):
    q, k, w = qkw()
    args = dict(q=q, k=k, weights=w, config=FP8, backend="torch")
    args.update(kw)
    return lambda: indexer_scores(**args)


def varlen(fn=indexer_scores_varlen, **kw):
    """A packed call of 8 tokens in sequences [3, 5]; ``kw`` replaces any argument."""
    args = dict(
        q=torch.randn(8, 32, 128),
        k=torch.randn(8, 128),
        weights=torch.randn(8, 32),
        cu_seqlens_q=cu_seqlens([3, 5]),
        cu_seqlens_k=cu_seqlens([3, 5]),
        max_seqlen_q=5,
        max_seqlen_k=5,
        config=BF16,
        backend="torch",
    )
    if fn is indexer_select_varlen:
        args["topk"] = 2
    args.update(kw)
    return lambda: fn(**args)


def select(**kw):
    q, k, w = qkw()
    args = dict(
        q=q,
        k=k,
        weights=w,
        topk=2,
        config=BF16,
        backend="torch",
    )
    args.update(kw)
    return lambda: indexer_select(**args)


def topk(**kw):
    args = dict(scores=torch.randn(2, 4), k=2, backend="torch")
    args.update(kw)
    return lambda: indexer_topk(**args)


def fused(**kw):
    """A valid fused call (BF16 scoring, 8 tokens); ``kw`` replaces any argument."""
    args = dict(
        query=torch.randn(8, 1, 4, 72), kv=torch.randn(8, 1, 72), q_indexer=torch.randn(8, 1, 32, 128),
        k_indexer=torch.randn(8, 1, 128), weights=torch.randn(8, 1, 32), topk=4, softmax_scale=0.1,
        d_v=64, config=BF16,
    )  # fmt: skip
    args.update(kw)
    return lambda: fused_indexer_sparse_attention(**args)


def preprocess(s=4, freqs_rows=None, **kw):
    """A BSHD IndexerPreprocess call of ``s`` tokens; ``freqs_rows`` rows of angles (default s)."""
    args = dict(
        q=torch.randn(s, 1, 8, 128), k=torch.randn(s, 1, 128),
        freqs=torch.rand(s if freqs_rows is None else freqs_rows, 1, 1, 64),
    )  # fmt: skip
    args.update(kw)
    return lambda: IndexerPreprocess(128, 64)(**args)


FP8_OPS = prepare_scoring_operands(*qkw(), config=FP8)

ERRORS = [
    # (name, call, exception, message pattern)
    # ------------------------------------------------------------- ScoringOperands construction
    ("operands: q not a tensor", operands(bf16_tensors, q=[[0.0]]), TypeError, "q must be a torch.Tensor, got list"),
    ("operands: float32 q", operands(bf16_tensors, q=torch.zeros(1, 4, 32, 128)), TypeError, r"bf16 or float8_e4m3fn q and k.*got q torch.float32.*prepare_scoring_operands"),
    ("operands: mixed q, k", operands(fp8_tensors, k=torch.zeros(1, 4, 128, dtype=torch.bfloat16)), TypeError, "got q torch.float8_e4m3fn, k torch.bfloat16"),
    ("operands: q rank", operands(bf16_tensors, q=torch.zeros(4, 32, 128, dtype=torch.bfloat16)), ValueError, r"q \(B, S_q, H, D\).*got q \(4, 32, 128\)"),
    ("operands: k batch", operands(bf16_tensors, k=torch.zeros(2, 4, 128, dtype=torch.bfloat16)), ValueError, r"shapes disagree.*k \(2, 4, 128\) \(expected \(1, S_k, 128\)\)"),
    ("operands: weights shape", operands(bf16_tensors, weights=torch.zeros(1, 4, 16, dtype=torch.bfloat16)), ValueError, r"weights \(1, 4, 16\) \(expected \(1, 4, 32\)\)"),
    ("operands: bf16 float16 weights", operands(bf16_tensors, weights=torch.zeros(1, 4, 32, dtype=torch.float16)), TypeError, "bf16 or float32 weights, got torch.float16"),
    ("operands: bf16 with descales", operands(bf16_tensors, k_descale=torch.ones(1, 4)), ValueError, "bf16 operands carry no descales"),
    ("operands: fp8 bf16 weights", operands(fp8_tensors, weights=torch.zeros(1, 4, 32, dtype=torch.bfloat16)), TypeError, "fp8 operands need float32 weights"),
    ("operands: fp8 no k descale", operands(fp8_tensors, k_descale=None), TypeError, "q_descale and k_descale"),
    ("operands: fp8 q descale shape", operands(fp8_tensors, q_descale=torch.ones(1, 4)), ValueError, r"q_descale must be float32 \(1, 4, 32\), got torch.float32 \(1, 4\)"),
    ("operands: fp8 k descale dtype", operands(fp8_tensors, k_descale=torch.ones(1, 4, dtype=torch.float64)), ValueError, r"k_descale must be float32 \(1, 4\), got torch.float64"),
    ("operands: fp8 sm_scale", operands(fp8_tensors, sm_scale=0.5), ValueError, "fold sm_scale into the weights; pass sm_scale=1.0"),
    ("operands: nan sm_scale", operands(bf16_tensors, sm_scale=float("nan")), ValueError, "sm_scale=nan must be finite"),
    ("operands: devices", operands(bf16_tensors, k=torch.zeros(1, 4, 128, dtype=torch.bfloat16, device=META)), ValueError, r"different devices \(q on cpu, k on meta"),
    # --------------------------------------------------------------------------- carriers
    ("carriers: q rank", scores(q=torch.randn(8, 32, 128)), ValueError, r"expected q \(B, S_q, H, D\).*got q \(8, 32, 128\)"),
    ("carriers: batch", scores(k=torch.randn(2, 8, 128)), ValueError, "batch mismatch: q has 1, k has 2"),
    ("carriers: head dim", scores(config=BF16, k=torch.randn(1, 8, 64)), ValueError, "head dim mismatch: q has 128, k has 64"),
    ("carriers: key heads", scores(k=torch.randn(1, 8, 2, 128)), ValueError, r"k has 2 heads.*one key"),
    ("carriers: weights shape", scores(weights=torch.randn(1, 7, 32)), ValueError, r"weights has shape \(1, 7, 32\).*\(1, 8, 32\)"),
    ("carriers: integer q", scores(q=torch.ones(1, 8, 32, 128, dtype=torch.int64)), TypeError, "q has dtype torch.int64"),
    ("carriers: float64 k", scores(k=torch.randn(1, 8, 128, dtype=torch.float64)), TypeError, "k has dtype torch.float64"),
    ("carriers: k not a tensor", scores(k=[[0.0]]), TypeError, "k must be a torch.Tensor, got list"),
    ("carriers: devices", scores(k=torch.randn(1, 8, 128, device=META)), ValueError, "different devices"),
    ("carriers: precision string", scores(config="fp8"), TypeError, r"config must be an IndexerPrecisionConfig, got 'fp8' \(str\); pass config=IndexerPrecisionConfig\(scoring_precision='fp8'"),
    ("carriers: no config", scores(config=None), ValueError, r"carriers need q, k, weights and config=IndexerPrecisionConfig"),
    ("carriers: engine profile object", scores(config=FP8.engine), TypeError, r"config must be an IndexerPrecisionConfig, got EngineProfile"),
    ("carriers: fp8 head dim", scores(q=torch.randn(1, 8, 32, 64), k=torch.randn(1, 8, 64)), ValueError, r"head dim 64; FP8 scoring quantizes 128-wide.*'bf16'"),
    ("carriers: fp8 16 heads", scores(q=torch.randn(1, 8, 16, 128), weights=torch.randn(1, 8, 16)), ValueError, r"FP8 operands have 16 heads.*32 or 64.*'bf16'"),
    ("carriers: fp8 nan sm_scale", scores(sm_scale=float("inf")), ValueError, "sm_scale=inf must be finite"),
    ("prepare: impl", lambda: prepare_scoring_operands(*qkw(), config=FP8, impl="cuda"), ValueError, r"impl='cuda' is not an implementation.*'auto', 'triton', 'torch'"),
    # ------------------------------------------------------------- operands vs carriers
    ("operands and carriers", lambda: indexer_scores(FP8_OPS, torch.randn(1, 8, 128)), ValueError, "either ScoringOperands or q, k, weights carriers"),
    ("operands: other precision", lambda: indexer_scores(FP8_OPS, config=BF16), ValueError, r"operands are fp8 but config asks for scoring_precision='bf16'"),
    ("operands: sm_scale", lambda: _as_scoring_operands(FP8_OPS, sm_scale=0.5), ValueError, "sm_scale is part of ScoringOperands"),
    ("varlen: batch 2 operands", varlen(q=prepare_scoring_operands(*qkw(b=2), config=FP8), k=None, weights=None, config=None), ValueError, r"packed operands have batch 1, got q \(2, 8, 32, 128\)"),
    ("varlen: carrier ranks", varlen(q=torch.randn(1, 8, 32, 128)), ValueError, r"packed \(THD\) input expects q \(T_q, H, D\)"),
    # --------------------------------------------------------------------------- backends
    ("scores: backend", scores(backend="tilelang"), ValueError, r"backend='tilelang' is not a scoring backend.*'auto', 'cudnn', 'deepgemm', 'torch'"),
    ("varlen: backend", varlen(backend="flash"), ValueError, "backend='flash' is not a scoring backend"),
    ("topk: backend", topk(backend="radix"), ValueError, r"backend='radix' is not a top-k backend.*'auto', 'cudnn', 'torch'"),
    ("select: backend", select(backend="triton"), ValueError, "backend='triton' is not a scoring backend"),
    # ------------------------------------------------------------------ ratio and offsets
    ("scores: ratio 0", scores(ratio=0), ValueError, "ratio=0 must be a positive integer"),
    ("scores: ratio float", scores(ratio=1.5), ValueError, "ratio=1.5 must be a positive integer"),
    ("varlen: ratio", varlen(ratio=-1), ValueError, "ratio=-1 must be a positive integer"),
    ("offsets: length", scores(q_causal_offsets=torch.tensor([0, 1])), ValueError, r"q_causal_offsets has 2 entries; expected one per batch row \(1\)"),
    ("offsets: negative int", scores(q_causal_offsets=-3), ValueError, r"q_causal_offsets=-3 is outside \[0, 2147483639\]; pass the global index of each batch row's first query row: non-negative"),
    ("offsets: float tensor", scores(q_causal_offsets=torch.tensor([1.0])), TypeError, "q_causal_offsets has dtype torch.float32; expected int32 or int64"),
    ("offsets: bool", scores(q_causal_offsets=True), TypeError, "q_causal_offsets must be a torch.Tensor, got bool"),
    ("offsets: 2-D", scores(q_causal_offsets=torch.zeros(1, 1, dtype=torch.int64)), ValueError, r"q_causal_offsets must be 1-D, got shape \(1, 1\)"),
    ("varlen offsets: length", varlen(q_causal_offsets=torch.tensor([1])), ValueError, r"q_causal_offsets has 1 entries; expected one per packed sequence \(2\)"),
    ("select offsets: negative", select(q_causal_offsets=-1), ValueError, r"q_causal_offsets=-1 is outside \[0, "),
    ("select offsets: float", select(q_causal_offsets=torch.tensor([2.0])), TypeError, "q_causal_offsets has dtype torch.float32"),
    ("select_varlen offsets: length", varlen(indexer_select_varlen, q_causal_offsets=torch.tensor([1])), ValueError, "q_causal_offsets has 1 entries; expected one per packed sequence"),
    ("select_varlen offsets: negative", varlen(indexer_select_varlen, q_causal_offsets=-2), ValueError, r"q_causal_offsets=-2 is outside \[0, .*packed sequence"),
    # --------------------------------------------------------------------------- cu_seqlens
    ("cu_seqlens: float", varlen(cu_seqlens_q=torch.tensor([0.0, 3.0, 8.0])), TypeError, "cu_seqlens_q has dtype torch.float32; expected int32 or int64"),
    ("cu_seqlens: list", varlen(cu_seqlens_k=[0, 3, 8]), TypeError, "cu_seqlens_k must be a torch.Tensor, got list"),
    ("cu_seqlens: 2-D", varlen(cu_seqlens_q=torch.tensor([[0, 3, 8]])), ValueError, r"cu_seqlens_q must be 1-D, got shape \(1, 3\)"),
    ("cu_seqlens: one entry", varlen(cu_seqlens_q=torch.tensor([0]), cu_seqlens_k=torch.tensor([0])), ValueError, r"cu_seqlens_q must hold at least \[0, total\]; got 1 entries"),
    ("cu_seqlens: counts differ", varlen(cu_seqlens_k=cu_seqlens([8])), ValueError, "cu_seqlens_q describes 2 sequences and cu_seqlens_k 1"),
    ("select_varlen cu_seqlens: list", varlen(indexer_select_varlen, cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor, got list"),
    ("select_varlen cu_seqlens: counts", varlen(indexer_select_varlen, cu_seqlens_k=cu_seqlens([8])), ValueError, "describes 2 sequences"),
    # ------------------------------------------------------------------------- max_seqlen
    ("max_seqlen_k: float", varlen(max_seqlen_k=5.0), ValueError, "max_seqlen_k=5.0 must be a non-negative Python int"),
    ("max_seqlen_q: tensor", varlen(max_seqlen_q=torch.tensor(5)), ValueError, r"max_seqlen_q=tensor\(5\) must be a non-negative Python int"),
    ("max_seqlen_k: negative", varlen(max_seqlen_k=-1), ValueError, "max_seqlen_k=-1 must be a non-negative"),
    ("max_seqlen_k: bool", varlen(max_seqlen_k=True), ValueError, "max_seqlen_k=True must be a non-negative Python int"),
    ("select_varlen max_seqlen_k: float", varlen(indexer_select_varlen, max_seqlen_k=5.0), ValueError, "max_seqlen_k=5.0 must be a non-negative Python int"),
    # -------------------------------------------------------------------------------- out=
    ("out: shape", scores(out=torch.empty(1, 8, 7)), ValueError, r"out must be a contiguous float32 tensor of shape \(1, 8, 8\) on cpu, got torch.float32 \(1, 8, 7\)"),
    ("out: dtype", scores(out=torch.empty(1, 8, 8, dtype=torch.float64)), ValueError, r"float32 tensor of shape \(1, 8, 8\).*got torch.float64"),
    ("out: strided", scores(out=torch.empty(1, 8, 8).transpose(1, 2)), ValueError, r"\(not contiguous\)"),
    ("out: device", scores(out=torch.empty(1, 8, 8, device=META)), ValueError, r"on cpu, got torch.float32 \(1, 8, 8\) on meta"),
    ("out: not a tensor", scores(out=[0.0]), TypeError, "out must be a torch.Tensor, got list"),
    ("varlen out: shape", varlen(out=torch.empty(8, 4)), ValueError, r"out must be a contiguous float32 tensor of shape \(8, 5\)"),
    # ------------------------------------------------------------------------------- top-k
    ("topk: k=0", topk(k=0), ValueError, "k=0 must be a positive integer"),
    ("topk: k=-2", topk(k=-2), ValueError, "k=-2 must be a positive integer"),
    ("topk: k=2.5", topk(k=2.5), ValueError, "k=2.5 must be a positive integer"),
    ("topk: k=True", topk(k=True), ValueError, "k=True must be a positive integer"),
    ("topk: integer scores", topk(scores=torch.ones(2, 4, dtype=torch.int32)), TypeError, "scores has dtype torch.int32"),
    ("topk: 0-d scores", topk(scores=torch.tensor(1.0)), ValueError, "scores must have a key dimension"),
    ("topk: scores list", topk(scores=[[1.0]]), TypeError, "scores must be a torch.Tensor, got list"),
    ("topk: seq_lens shape", topk(seq_lens=torch.tensor([1, 2, 3])), ValueError, r"seq_lens has shape \(3,\); expected one length per score row, \(2,\)"),
    ("topk: seq_lens dtype", topk(seq_lens=torch.tensor([1.0, 2.0])), TypeError, "seq_lens has dtype torch.float32; expected int32 or int64"),
    ("topk: seq_lens list", topk(seq_lens=[1, 2]), TypeError, "seq_lens must be a torch.Tensor, got list"),
    ("topk: seq_lens device", topk(seq_lens=torch.ones(2, dtype=torch.int32, device=META)), ValueError, "seq_lens is on meta but scores on cpu; move it"),
    ("topk: validate seq_lens high", topk(seq_lens=torch.tensor([1, 5]), validate=True), ValueError, r"seq_lens\[1\]=5 is outside \[0, 4\]; each row's valid keys lie in \[0, S_k=4\]"),
    ("topk: validate seq_lens low", topk(seq_lens=torch.tensor([-1, 2]), validate=True), ValueError, r"seq_lens\[0\]=-1 is outside \[0, 4\]"),
    # ------------------------------------------------------------------------------ select
    ("select: topk=0", select(topk=0), ValueError, "topk=0 must be a positive integer"),
    ("select: chunk_bytes=0", select(chunk_bytes=0), ValueError, "chunk_bytes=0 must be a positive integer"),
    ("select: chunk_bytes float", select(chunk_bytes=1.5), ValueError, "chunk_bytes=1.5 must be a positive integer"),
    ("select_varlen: topk", varlen(indexer_select_varlen, topk=-1), ValueError, "topk=-1 must be a positive integer"),
    # -------------------------------------------------------------- validate=True (data)
    ("validate: offsets", scores(q_causal_offsets=torch.tensor([-1]), validate=True), ValueError, r"q_causal_offsets\[0\]=-1 is outside \[0, 2147483639\]"),
    ("validate: select offsets", select(q_causal_offsets=torch.tensor([-4]), validate=True), ValueError, r"q_causal_offsets\[0\]=-4 is outside"),
    ("validate: cu_seqlens start", varlen(cu_seqlens_q=torch.tensor([1, 3, 8]), validate=True), ValueError, r"cu_seqlens_q must start at 0, be non-decreasing and end at the packed length 8; got \[1, 3, 8\]"),
    ("validate: cu_seqlens order", varlen(cu_seqlens_k=torch.tensor([0, 9, 8]), validate=True), ValueError, r"cu_seqlens_k must start at 0, be non-decreasing.*got \[0, 9, 8\]"),
    ("validate: cu_seqlens end", varlen(cu_seqlens_q=torch.tensor([0, 3, 9]), max_seqlen_q=6, validate=True), ValueError, r"end at the packed length 8; got \[0, 3, 9\]"),
    ("validate: max_seqlen", varlen(max_seqlen_k=4, validate=True), ValueError, "cu_seqlens_k has a sequence of 5 tokens, above max_seqlen 4"),
    ("validate: select_varlen cu_seqlens end", varlen(indexer_select_varlen, cu_seqlens_q=torch.tensor([0, 3, 9]), max_seqlen_q=6, validate=True), ValueError, r"end at the packed length 8; got \[0, 3, 9\]"),
    ("validate: varlen offsets", varlen(q_causal_offsets=torch.tensor([0, -2]), validate=True), ValueError, r"q_causal_offsets\[1\]=-2 is outside \[0, 2147483642\]"),
    # ---------------------------------------- ints past int32 (issue 17, item 3): never wrapped
    ("offsets: int past int32", scores(q_causal_offsets=2**31), ValueError, r"q_causal_offsets=2147483648 is outside \[0, 2147483639\]; pass the global index of each batch row's first query row"),
    ("offsets: int near int32 plus rows", scores(q_causal_offsets=2**31 - 5), ValueError, r"q_causal_offsets=2147483643 is outside \[0, 2147483639\].*with its 8 rows added"),
    ("offsets: float", scores(q_causal_offsets=3.0), TypeError, "q_causal_offsets must be a torch.Tensor, got float"),
    ("validate: int64 offsets past int32", scores(q_causal_offsets=torch.tensor([2**32 + 3]), validate=True), ValueError, r"q_causal_offsets\[0\]=4294967299 is outside \[0, 2147483639\]"),
    ("validate: select int64 offsets", select(q_causal_offsets=torch.tensor([2**32]), validate=True), ValueError, r"q_causal_offsets\[0\]=4294967296 is outside"),
    ("validate: varlen int64 offsets", varlen(q_causal_offsets=torch.tensor([0, 2**33 + 1]), validate=True), ValueError, r"q_causal_offsets\[1\]=8589934593 is outside \[0, 2147483642\].*packed sequence"),
    ("validate: select_varlen int64 offsets", varlen(indexer_select_varlen, q_causal_offsets=torch.tensor([2**32 + 1, 0]), validate=True), ValueError, r"q_causal_offsets\[0\]=4294967297 is outside"),
    ("select_varlen offsets: int past int32", varlen(indexer_select_varlen, q_causal_offsets=2**40), ValueError, r"q_causal_offsets=1099511627776 is outside"),
    ("validate: int64 seq_lens past int32", topk(seq_lens=torch.tensor([2**32 + 1, 2]), validate=True), ValueError, r"seq_lens\[0\]=4294967297 is outside \[0, 4\]; each row's valid keys lie in \[0, S_k=4\]"),
    ("validate: 2-D seq_lens names the row", topk(scores=torch.randn(2, 3, 4), seq_lens=torch.tensor([[1, 2, 3], [4, 5, 0]]), validate=True), ValueError, r"seq_lens\[\(1, 1\)\]=5 is outside \[0, 4\]"),
    ("scores: ratio past int32", scores(ratio=2**31), ValueError, r"ratio=2147483648 is outside \[1, 2147483647\]"),
    ("topk: k past int32", topk(k=2**31), ValueError, r"k=2147483648 is outside \[1, 2147483647\]"),
    ("select: topk past int32", select(topk=2**32), ValueError, r"topk=4294967296 is outside"),
    ("max_seqlen_k: past int32", varlen(max_seqlen_k=2**31), ValueError, "max_seqlen_k=2147483648 must be a non-negative Python int within int32"),
    # ------------------------------------------------- loose types (issue 17, item 7)
    ("scores: sm_scale string", scores(sm_scale="0.5"), TypeError, r"sm_scale='0.5' \(str\) must be a real number; pass a Python float"),
    ("scores bf16: sm_scale string", scores(config=BF16, sm_scale="0.5"), TypeError, r"sm_scale='0.5' \(str\) must be a real number"),
    ("scores: sm_scale tensor", scores(sm_scale=torch.tensor(0.5)), TypeError, r"sm_scale=tensor\(0.5000\) \(Tensor\) must be a real number"),
    ("scores: sm_scale bool", scores(sm_scale=True), TypeError, r"sm_scale=True \(bool\) must be a real number"),
    ("operands: sm_scale string", operands(bf16_tensors, sm_scale="1.0"), TypeError, r"sm_scale='1.0' \(str\) must be a real number"),
    ("operands with sm_scale string", lambda: indexer_scores(FP8_OPS, sm_scale="1.0"), TypeError, r"sm_scale='1.0' \(str\)"),
    ("carriers: zero heads", scores(config=BF16, q=torch.randn(1, 8, 0, 128), weights=torch.randn(1, 8, 0)), ValueError, r"q has shape \(1, 8, 0, 128\) \(B, S_q, H, D\): H = q.shape\[2\], the head count, is 0"),
    ("carriers: zero head dim", scores(config=BF16, q=torch.randn(1, 8, 32, 0), k=torch.randn(1, 8, 0)), ValueError, r"D = q.shape\[3\], the head dim, is 0, so 32 heads of width 0 score nothing"),
    ("select: zero heads", select(q=torch.randn(1, 8, 0, 128), weights=torch.randn(1, 8, 0)), ValueError, "0 heads of width 128 score nothing"),
    ("operands: zero heads", operands(bf16_tensors, q=torch.zeros(1, 4, 0, 128, dtype=torch.bfloat16), weights=torch.zeros(1, 4, 0, dtype=torch.bfloat16)), ValueError, "0 heads"),
    # ------------------------------------- the precision object (issue 18, item 4)
    ("scores: removed scoring_precision=", scores(scoring_precision="fp8"), TypeError, r"indexer_scores\(\) takes the precision as one object: pass config=IndexerPrecisionConfig\(scoring_precision='fp8'\)"),
    ("scores: removed engine=", scores(engine="vllm"), TypeError, r"pass config=IndexerPrecisionConfig\(engine='vllm'\) instead of engine='vllm'"),
    ("varlen: removed scoring_precision=", varlen(scoring_precision="bf16"), TypeError, r"indexer_scores_varlen\(\) takes the precision as one object"),
    ("select: removed scoring_precision=", select(scoring_precision="bf16", engine="vllm"), TypeError, r"indexer_select\(\) takes the precision.*IndexerPrecisionConfig\(scoring_precision='bf16', engine='vllm'\)"),
    ("select_varlen: removed scoring_precision=", varlen(indexer_select_varlen, scoring_precision="bf16"), TypeError, r"indexer_select_varlen\(\) takes the precision"),
    ("prepare: removed scoring_precision=", lambda: prepare_scoring_operands(*qkw(), scoring_precision="fp8"), TypeError, r"prepare_scoring_operands\(\) takes the precision as one object"),
    ("prepare: config string", lambda: prepare_scoring_operands(*qkw(), config="fp8"), TypeError, "config must be an IndexerPrecisionConfig, got 'fp8'"),
    # -------------------------------- boolean flags are bools (a truthy "no" is not False)
    ("scores: validate string", scores(validate="no"), TypeError, r"validate must be a bool, got 'no' \(str\); pass True or False"),
    ("scores: validate int", scores(validate=1), TypeError, r"validate must be a bool, got 1 \(int\)"),
    ("varlen: validate string", varlen(validate="False"), TypeError, r"validate must be a bool, got 'False' \(str\)"),
    ("select: validate tensor", select(validate=torch.tensor(True)), TypeError, r"validate must be a bool, got tensor\(True\) \(Tensor\)"),
    ("select: deterministic string", select(deterministic="no"), TypeError, r"deterministic must be a bool, got 'no' \(str\)"),
    ("select_varlen: validate int", varlen(indexer_select_varlen, validate=0), TypeError, r"validate must be a bool, got 0 \(int\)"),
    ("select_varlen: deterministic None", varlen(indexer_select_varlen, deterministic=None), TypeError, r"deterministic must be a bool, got None \(NoneType\)"),
    ("topk: validate string", topk(validate="yes"), TypeError, r"validate must be a bool, got 'yes' \(str\)"),
    ("topk: deterministic int", topk(deterministic=0), TypeError, r"deterministic must be a bool, got 0 \(int\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, call, exc, pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_a_clear_error(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


OTHER_MODULES = [
    ("config: precision", lambda: IndexerPrecisionConfig(scoring_precision="e5m2"), ValueError, r"scoring_precision='e5m2'.*'bf16', 'fp8'"),
    ("config: rope_fp32 type", lambda: IndexerPrecisionConfig(rope_fp32=1), TypeError, "rope_fp32 must be a bool"),
    ("config: engine", lambda: IndexerPrecisionConfig(engine="trt"), ValueError, "engine='trt' is not an engine profile"),
    ("quantize: dtype", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 128, dtype=torch.int8)), TypeError, "x has dtype torch.int8"),
    ("quantize: width", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 96)), ValueError, "last dimension must be 128"),
    ("preprocess: rank", lambda: IndexerPreprocess(128, 64)(torch.randn(4, 8, 128), torch.randn(4, 1, 128), torch.rand(4, 1, 1, 64)), ValueError, r"q must be \[s, b, h, d\]"),
    ("preprocess: rope width", lambda: IndexerPreprocess(128, 64)(torch.randn(4, 1, 8, 128), torch.randn(4, 1, 128), torch.rand(4, 1, 1, 32)), ValueError, "rope width 32"),
    ("fused: fp8 with loss", lambda: fused_indexer_sparse_attention(torch.randn(8, 1, 4, 72), torch.randn(8, 1, 72), torch.randn(8, 1, 32, 128), torch.randn(8, 1, 128), torch.randn(8, 1, 32), topk=4, softmax_scale=0.1, d_v=64, config=FP8, loss_coeff=1.0, indexer_loss_fn=lambda *a: a[0].sum()), ValueError, "loss_coeff=1.0"),
    # ------------------------------------------------ fused: types and shapes (issue 17, item 7)
    ("fused: topk float", fused(topk=2.7), ValueError, "topk=2.7 must be a positive integer"),
    ("fused: topk 2.0", fused(topk=2.0), ValueError, "topk=2.0 must be a positive integer"),
    ("fused: d_v float", fused(d_v=64.0), ValueError, "d_v=64.0 must be a positive integer"),
    ("fused: d_v too wide", fused(d_v=80), ValueError, "d_v=80 must not exceed it"),
    ("fused: softmax_scale string", fused(softmax_scale="0.1"), TypeError, r"softmax_scale='0.1' \(str\) must be a real number"),
    ("fused: loss_coeff string", fused(loss_coeff="1"), TypeError, r"loss_coeff='1' \(str\) must be a real number"),
    ("fused: removed scoring_precision=", fused(config=None, scoring_precision="fp8"), TypeError, r"fused_indexer_sparse_attention\(\) takes the precision as one object: pass config=IndexerPrecisionConfig\(scoring_precision='fp8'\)"),
    ("fused: config string", fused(config="bf16"), TypeError, r"config must be an IndexerPrecisionConfig, got 'bf16'"),
    ("fused: kv rows", fused(kv=torch.randn(9, 1, 72)), ValueError, r"kv \(9, 1, 72\) and k_indexer \(8, 1, 128\) the same \(S_k, B\)"),
    ("fused: weights heads", fused(weights=torch.randn(8, 1, 16)), ValueError, r"weights \(8, 1, 16\) must be \(S_q, B, H\)"),
    ("fused: query not a tensor", fused(query=[0.0]), TypeError, "query must be a torch.Tensor, got list"),
    ("fused: zero indexer heads", fused(q_indexer=torch.randn(8, 1, 0, 128), weights=torch.randn(8, 1, 0)), ValueError, "0 heads of width 128 score nothing"),
    # ------------------------------------------- preprocess: freqs must cover the tokens (item 4)
    ("preprocess: one row of freqs", preprocess(s=4, freqs_rows=1), ValueError, r"freqs has 1 rows of angles for 4 tokens"),
    ("prepare_indexer_operands: one row of freqs", lambda: prepare_indexer_operands(IndexerPreprocess(128, 64), torch.randn(4, 1, 32, 128), torch.randn(4, 1, 128), torch.randn(4, 1, 32), torch.rand(1, 1, 1, 64), config=FP8, impl="torch"), ValueError, r"freqs has 1 rows of angles for 4 tokens"),
    ("prepare_indexer_operands: sm_scale string", lambda: prepare_indexer_operands(IndexerPreprocess(128, 64), torch.randn(4, 1, 32, 128), torch.randn(4, 1, 128), torch.randn(4, 1, 32), torch.rand(4, 1, 1, 64), config=FP8, sm_scale="1"), TypeError, r"sm_scale='1' \(str\)"),
    ("prepare_indexer_operands: config string", lambda: prepare_indexer_operands(IndexerPreprocess(128, 64), torch.randn(4, 1, 32, 128), torch.randn(4, 1, 128), torch.randn(4, 1, 32), torch.rand(4, 1, 1, 64), config="fp8"), TypeError, "config must be an IndexerPrecisionConfig, got 'fp8'"),
    ("preprocess: token_freqs short", preprocess(s=4, token_freqs=torch.rand(3, 1, 1, 64)), ValueError, r"token_freqs has 3 rows of angles for 4 tokens"),
    ("preprocess: mscale string", preprocess(mscale="1.0"), TypeError, r"mscale='1.0' \(str\) must be a real number"),
    ("preprocess: freqs list", preprocess(freqs=[0.0]), TypeError, "freqs must be a torch.Tensor, got list"),
    ("preprocess: rope_dim float", lambda: IndexerPreprocess(128, 64.0), ValueError, "rope_dim=64.0 must be a positive integer"),
    ("preprocess: head_dim zero", lambda: IndexerPreprocess(0, 64), ValueError, "head_dim=0 must be a positive integer"),
    # ------------------------------------------------ quantization rules: numbers, not strings
    ("Fp8Rule: amax_floor string", lambda: Fp8Rule(amax_floor="1e-4"), TypeError, r"amax_floor='1e-4' \(str\) must be a real number"),
    ("quantize: amax_floor string", lambda: quantize_e4m3_ue8m0(torch.zeros(2, 128), amax_floor="1e-4"), TypeError, r"amax_floor='1e-4' \(str\)"),
    ("ue8m0_descale: amax_floor string", lambda: ue8m0_descale(torch.ones(2), amax_floor="1e-4"), TypeError, r"amax_floor='1e-4' \(str\)"),
    ("dequantize: descale shape", lambda: dequantize_fp8(torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.ones(3)), ValueError, r"descale has shape \(3,\); expected one descale per vector of x_fp8 \(2, 128\), \(2,\)"),
    ("ue8m0_descale: amax list", lambda: ue8m0_descale([1.0]), TypeError, "amax must be a torch.Tensor, got list"),
    ("quantize_fp8: rule", lambda: quantize_fp8(torch.zeros(2, 128), rule="vllm"), TypeError, r"rule must be an Fp8Rule, got str"),
    ("config: n_heads float", lambda: FP8.validate_for_model(indexer_loss_coeff=0, n_heads=32.0, head_dim=128, device="cpu"), ValueError, "n_heads=32.0 must be a positive integer"),
    ("config: head_dim zero", lambda: BF16.validate_for_model(indexer_loss_coeff=0, n_heads=32, head_dim=0, device="cpu"), ValueError, "head_dim=0 must be a positive integer"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, call, exc, pattern", OTHER_MODULES, ids=[e[0] for e in OTHER_MODULES]
)
def test_other_entry_points_raise_clear_errors(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ------------------------------------------------------ non-finite operands, validate=True


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "tensor, index, where",
    [("q", (0, 5, 3, 7), r"\(0, 5\)"), ("k", (0, 6, 4), r"\(0, 6\)"), ("weights", (0, 2, 1), r"\(0, 2\)")],
)  # fmt: skip
def test_validate_names_the_non_finite_tensor_and_index(precision, tensor, index, where):
    q, k, w = qkw()
    {"q": q, "k": k, "weights": w}[tensor][index] = float("nan")
    pattern = rf"{tensor} has a non-finite vector at \(batch, row\) {where}"
    with pytest.raises(ValueError, match=pattern):
        indexer_scores(
            q,
            k,
            w,
            config=CONFIGS[precision],
            backend="torch",
            validate=True,
        )
    with pytest.raises(ValueError, match=pattern):
        indexer_select(
            q,
            k,
            w,
            topk=2,
            config=CONFIGS[precision],
            validate=True,
        )
    with pytest.raises(ValueError, match=pattern):
        indexer_scores_varlen(
            q[0], k[0], w[0], cu_seqlens_q=cu_seqlens([8]), cu_seqlens_k=cu_seqlens([8]),
            max_seqlen_q=8, max_seqlen_k=8, config=CONFIGS[precision], validate=True,
        )  # fmt: skip
    # Without validate nothing reads the data: the call runs (and the bad entry scores NaN).
    got = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    assert torch.isnan(got).any()


def test_without_validate_negative_offsets_are_not_read():
    """Sync-free by default: a negative offset tensor is not inspected; its rows see no keys."""
    got = indexer_scores(
        *qkw(b=2, sq=3, sk=3),
        config=BF16,
        q_causal_offsets=torch.tensor([-5, 0]),
    )
    assert (got[0] == -float("inf")).all() and torch.isfinite(got[1, 2]).all()


# ------------------------------------------------------ kernels that cannot run: no fallback


NO_KERNEL = [
    # (name, call, message pattern)
        ("scores cudnn", scores(backend="cudnn"), r"backend='cudnn' cannot score this call: the tensors are on cpu.*backend='torch'"),
        ("scores deepgemm fp8", scores(backend="deepgemm"), r"backend='deepgemm' cannot score this call: the tensors are on cpu; DeepGEMM runs on CUDA"),
        ("scores deepgemm bf16", scores(backend="deepgemm", config=BF16), r"backend='deepgemm'.*FP8 operands only; use scoring_precision='fp8'"),
        ("varlen cudnn", varlen(backend="cudnn"), "backend='cudnn' cannot score this call"),
        ("topk cudnn", topk(backend="cudnn"), r"backend='cudnn' cannot run this top-k: the tensors are on cpu.*'torch'"),
        ("select cudnn", select(backend="cudnn"), "backend='cudnn' cannot score this call"),
        ("select_varlen deepgemm", varlen(indexer_select_varlen, backend="deepgemm"), r"backend='deepgemm'.*FP8 operands only"),
        ("prepare triton", lambda: prepare_scoring_operands(*qkw(), config=FP8, impl="triton"), r"impl='triton' cannot build these operands: the tensors are on cpu.*impl='torch'"),
        ("prepare triton bf16", lambda: prepare_scoring_operands(*qkw(), config=BF16, impl="triton"), r"impl='triton' cannot build these operands.*BF16 scoring only rounds"),
]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name, call, pattern", NO_KERNEL, ids=[e[0] for e in NO_KERNEL])
def test_explicit_kernels_that_cannot_run_raise_with_the_reason(monkeypatch, name, call, pattern):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=pattern):
        call()


# ------------------------------------------------------------ documented, tested results


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_non_contiguous_views_are_accepted_and_equal(precision):
    q, k, w = qkw(b=2, sq=12, sk=12)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    k_s = torch.cat([k, k], dim=-1)[..., :128]  # a strided slice
    w_t = w.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_t.is_contiguous() and not k_s.is_contiguous()
    a = indexer_scores(q, k, w, config=CONFIGS[precision], backend="torch")
    b = indexer_scores(q_t, k_s, w_t, config=CONFIGS[precision], backend="torch")
    assert torch.equal(a, b)
