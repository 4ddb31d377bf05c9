"""``python -m dsa_precision bench``: the indexer's time on the GPU, the package beside the kernels.

For each sequence length ``S`` and head count ``H`` (``D = 128``, causal, batch ``B``), on the same
operands and in one run (median of CUDA-event timings after warm-up, L2 flushed before every
repetition, random non-zero inputs checked against the torch reference first):

- **kernels vs package**: cuDNN's ``indexer_forward_wrapper`` called directly against
  :func:`~dsa_precision.indexer_scores` on the same operands (BF16 and FP8), DeepGEMM's
  MQA logits when importable, and cuDNN's deterministic ``indexer_top_k_wrapper`` against
  :func:`~dsa_precision.indexer_topk` (causal ``seq_lens``); the overhead is package / raw. The
  raw top-k is timed twice: indices only, and with each pick's score (``return_val=True``, the
  wrapper's default), which the package reads to drop ``-inf`` and NaN picks.
- **end to end from the projections, like for like**: BF16 = Megatron's BF16 preprocessing and
  BF16 scoring, FP8 = the fused preprocess+quantize kernel (``--rope-fp32``, ``--hadamard``) and
  FP8 scoring, each followed by :func:`~dsa_precision.indexer_select`; beside the measured
  BF16 / FP8 ratio, the ratio the raw kernels allow (preparation + raw scoring + raw top-k).
- **from carriers through the public API**: ``indexer_topk(indexer_scores(q, k, w, ...), k)`` on
  FP32 carriers, BF16 against FP8.
- **memory**: the allocator's peak during one end-to-end call beyond what existed before it and
  beyond its output (memory cuDNN takes outside PyTorch's allocator is not seen).

- **packed sequences** (``--thd``): packings of uneven sequences summing to ``T`` tokens, FP8:
  :func:`~dsa_precision.indexer_scores_varlen` on DeepGEMM and cuDNN beside the kernels called
  directly on the same operands (DeepGEMM's MQA logits with per-row ``ks`` / ``ke``, compressed
  and cleaned; cuDNN's THD ``indexer_forward_wrapper``), and
  :func:`~dsa_precision.indexer_select_varlen` beside the raw kernels' chunked score + top-k.

``S >= --chunked-from`` is timed end to end only (the full score matrix would not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

import torch

from . import CliError, print_json, progress, seed
from .bench_config import (
    _FUSED_THRESHOLD,
    _HEAD_DIM,
    _LONG_SEQS,
    _ROPE_DIM,
    _SPLIT_SEQS,
    _THD_SEQS,
    _BenchConfig,
    thd_lengths,
)
from .bench_tables import format_tables

if TYPE_CHECKING:
    from ..operands import ScoringOperands
    from ..preprocess import IndexerPreprocess
    from ..preprocess_kernel import Impl
    from ..scoring import Backend

__all__ = ["Timer", "bench_inputs", "register"]

_FLUSH_BYTES = 256 << 20  # larger than the H200's L2 (60 MB)
_BANDWIDTH_BYTES = 1 << 30
# Device cycles the timer sleeps before each repetition (about 1 ms at the H200's ~1.98 GHz): more
# than the host needs to queue any call measured here.
_LEAD_CYCLES = 2_000_000
_DEVICE = "cuda"  # where the operands live (the CPU tests run the measurement code on fakes)


def register(subparsers: argparse._SubParsersAction) -> None:
    d = _BenchConfig()
    p = subparsers.add_parser(
        "bench",
        help="time the indexer's kernels and the package beside them, BF16 vs FP8 (CUDA GPU)",
        description=__doc__,
    )
    p.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=None,
        help=f"sequence lengths S of the default tables (default {' '.join(map(str, d.seqs))}; "
        "with --long or --split only when given)",
    )
    p.add_argument("--heads", type=int, nargs="+", default=list(d.heads), help="heads H (32, 64)")
    p.add_argument("--batch", type=int, default=d.batch, help=f"batch size B (default {d.batch})")
    p.add_argument("--topk", type=int, default=d.topk, help=f"keys per query (default {d.topk})")
    p.add_argument("--reps", type=int, default=d.reps, help=f"timed repetitions (default {d.reps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed warm-up calls")
    p.add_argument(
        "--chunked-from",
        type=int,
        default=d.chunked_from,
        help=f"time S >= this end to end only (default {d.chunked_from})",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=d.chunk_bytes,
        help="indexer_select's working-set budget per chunk (default: its own, 4 GiB: one "
        "chunk when the call fits)",
    )
    p.add_argument(
        "--rope-fp32",
        action=argparse.BooleanOptionalAction,
        default=d.rope_fp32,
        help="FP8 side preprocesses with rope_fp32 (default on)",
    )
    p.add_argument(
        "--hadamard",
        action=argparse.BooleanOptionalAction,
        default=d.hadamard,
        help="apply the Hadamard rotation on both sides (default off; the BF16 side is only "
        "like for like with fast_hadamard_transform installed)",
    )
    p.add_argument(
        "--torch-reference",
        action=argparse.BooleanOptionalAction,
        default=d.torch_reference,
        help="also time the torch reference of the fused preprocessing (default off)",
    )
    p.add_argument("--seed", type=seed, default=d.seed, help="random seed (default 0)")
    p.add_argument(
        "--long",
        action="store_true",
        help=f"only the long-context profile: chunked select at S {' '.join(map(str, _LONG_SEQS))} "
        "(or --long-seq), FP8 / BF16, both backends, beside the raw chunked kernels, peak memory",
    )
    p.add_argument("--long-seq", type=int, nargs="+", default=None, help="S of --long")
    p.add_argument(
        "--long-reps", type=int, default=d.long_reps, help=f"reps of --long (default {d.long_reps})"
    )
    p.add_argument(
        "--split",
        action="store_true",
        help=f"only the time split of FP8 selection at S {' '.join(map(str, _SPLIT_SEQS))} (or "
        "--split-seq): scoring, top-k, scores written and read back; what a fused kernel saves",
    )
    p.add_argument("--split-seq", type=int, nargs="+", default=None, help="S of --split")
    p.add_argument(
        "--thd",
        action="store_true",
        help=f"only the packed-sequence (THD) profile: T {' '.join(map(str, _THD_SEQS))} tokens "
        "(or --thd-seq; with --long also its S, selection only), FP8 indexer_scores_varlen and "
        "indexer_select_varlen on both backends beside the raw kernels",
    )
    p.add_argument("--thd-seq", type=int, nargs="+", default=None, help="packed tokens T of --thd")
    p.add_argument(
        "--thd-weights",
        type=int,
        nargs="+",
        default=list(d.thd_weights),
        help="relative sequence lengths of each packing (default "
        f"{' '.join(map(str, d.thd_weights))}: four uneven sequences)",
    )
    p.add_argument(
        "--megatron",
        action="store_true",
        help="only Megatron Core's own indexer top-k on each dsa_kernel_backend (none, cudnn, "
        "tilelang; a missing one is skipped with its reason) beside the package's FP8 top-k, at "
        f"S {' '.join(map(str, d.seqs))} (or --megatron-seq); needs megatron-core",
    )
    p.add_argument("--megatron-seq", type=int, nargs="+", default=None, help="S of --megatron")
    p.add_argument("--json", action="store_true", help="print one JSON document, no tables")
    p.set_defaults(func=_main)


# --------------------------------------------------------------------------------------------
# measurement


class _Call(Protocol):
    """A call measured with no arguments (a Protocol rather than ``Callable[[], Any]``: mypy
    matches a lambda whose defaults bind loop variables only against the former)."""

    def __call__(self) -> Any: ...


class _SelectArgs(TypedDict):
    topk: int
    chunk_bytes: int | None


class _BackendSelectArgs(_SelectArgs):
    backend: Backend


class Timer:
    """Median of CUDA-event timings after warm-up, the L2 flushed before each repetition.

    The device time of a call: behind the flush the device sleeps ``_LEAD_CYCLES`` (about 1 ms)
    before the start event, so every launch of the call is queued before its first kernel runs
    and the host's time before a launch (Python, checks, the launches themselves; measured
    apart, :meth:`host_us`) is not counted for the package or for the raw kernels."""

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps, self.warmup = reps, warmup
        self._flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: _Call) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            self._flush.zero_()
            torch.cuda._sleep(_LEAD_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def host_us(self, fn: _Call) -> float:
        """Median host microseconds of ``fn()`` (until it returns), the device idle before
        each of ``reps`` calls."""
        fn()
        times = []
        for _ in range(self.reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


def _peak_extra_mib(fn: _Call) -> float:
    """Allocator peak of one call beyond what existed before it and beyond its outputs."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - _nbytes(out)
    del out
    return max(extra, 0) / 2**20


def bench_inputs(
    seq: int, batch: int, heads: int, gen: torch.Generator, lens: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron-layout BF16 projections (q, k, raw head weights) and RoPE angles: of positions
    ``0 .. seq - 1``, or with ``lens`` (packed sequences summing to ``seq``) each sequence's own
    positions from 0."""

    def nonzero(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=_DEVICE, generator=gen)
        return torch.where(x == 0, torch.full_like(x, 1e-3), x).to(torch.bfloat16)

    inv = 10000.0 ** (
        -torch.arange(0, _ROPE_DIM, 2, dtype=torch.float32, device=_DEVICE) / _ROPE_DIM
    )
    pos = [torch.arange(n, dtype=torch.float32) for n in lens or [seq]]
    angles = torch.outer(torch.cat(pos).to(_DEVICE), inv)
    freqs = torch.cat([angles] * 2, -1).view(seq, 1, 1, _ROPE_DIM)
    return (
        nonzero(seq, batch, heads, _HEAD_DIM),
        nonzero(seq, batch, _HEAD_DIM),
        nonzero(seq, batch, heads),
        freqs,
    )


def _preprocess(rope_fp32: bool, hadamard: bool) -> IndexerPreprocess:
    from ..preprocess import IndexerPreprocess

    pre = IndexerPreprocess(_HEAD_DIM, _ROPE_DIM, rope_fp32=rope_fp32, rotate_activation=hadamard)
    k_norm = cast(torch.nn.LayerNorm, pre.k_norm)  # its own, fresh nn.LayerNorm
    with torch.no_grad():
        k_norm.weight.normal_(1.0, 0.1)
        k_norm.bias.normal_(0.0, 0.1)
    return pre.to(device=_DEVICE, dtype=torch.bfloat16)


def _check_environment(cfg: _BenchConfig) -> None:
    if not torch.cuda.is_available():
        raise CliError("bench needs a CUDA GPU; none is visible to this process.")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise CliError(
            f"bench needs an SM90 GPU (the FP8 indexer kernels); this is SM{major}{minor}."
        )
    bad = [h for h in cfg.heads if h not in (32, 64)]
    if bad:
        raise CliError(f"--heads {bad}: FP8 scoring packs 32 or 64 heads.")
    for name in ("batch", "topk", "reps", "chunk_bytes", "long_reps"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1.")
    for flag, seqs in (
        ("seq", cfg.seqs),
        ("long-seq", cfg.long_seqs),
        ("split-seq", cfg.split_seqs),
        ("thd-seq", cfg.thd_seqs),
        ("megatron-seq", cfg.megatron_seqs),
    ):
        if any(s < 1 for s in seqs):
            raise CliError(f"--{flag} values must be >= 1.")
    _check_thd(cfg)
    from ..backends import cudnn
    from ..config import ScoringPrecision
    from ..kernels import triton_unavailable_reason

    reason = (
        cudnn._scoring_unsupported_reason(
            device=torch.device("cuda"),
            precision=ScoringPrecision.FP8,
            n_heads=cfg.heads[0],
            head_dim=_HEAD_DIM,
            n_kv_heads=1,
        )
        or triton_unavailable_reason()
    )
    if reason:
        raise CliError(reason)
    if cfg.megatron_seqs:
        from importlib.util import find_spec

        if find_spec("megatron") is None or find_spec("megatron.core") is None:
            raise CliError(
                "--megatron times megatron-core's own indexer, which is not installed; "
                "pip install -e '.[megatron]'."
            )


def _check_thd(cfg: _BenchConfig) -> None:
    """Every packing of ``--thd-seq`` splits into non-empty sequences (``CliError`` otherwise)."""
    for total in cfg.thd_seqs:
        try:
            thd_lengths(total, cfg.thd_weights)
        except ValueError as exc:
            raise CliError(str(exc)) from None


class _Workload:
    """One (S, H) case: projections, preprocessing modules, configs and prepared operands."""

    def __init__(
        self,
        cfg: _BenchConfig,
        seq: int,
        heads: int,
        gen: torch.Generator,
        lens: list[int] | None = None,
    ) -> None:
        from ..config import IndexerPrecisionConfig
        from ..prepare import prepare_indexer_operands
        from ..preprocess import _indexer_head_weights

        self.seq, self.heads = seq, heads
        batch = 1 if lens else cfg.batch  # a packing is one row of tokens
        self.q, self.k, w_raw, self.freqs = bench_inputs(seq, batch, heads, gen, lens)
        self.pre16 = _preprocess(False, cfg.hadamard)
        self.pre8 = _preprocess(cfg.rope_fp32, cfg.hadamard)
        self.cfg16 = IndexerPrecisionConfig()
        self.cfg8 = IndexerPrecisionConfig(rope_fp32=cfg.rope_fp32, scoring_precision="fp8")
        hw = dict(n_heads=heads, head_dim=_HEAD_DIM)
        self.w16 = _indexer_head_weights(w_raw, fp32=False, **hw)
        self.w8 = _indexer_head_weights(w_raw, fp32=True, **hw)
        self._prepare = prepare_indexer_operands

    def prep(self, fp8: bool, impl: Impl = "auto") -> ScoringOperands:
        if fp8:
            return self._prepare(
                self.pre8, self.q, self.k, self.w8, self.freqs, config=self.cfg8, impl=impl
            )
        return self._prepare(self.pre16, self.q, self.k, self.w16, self.freqs, config=self.cfg16)


def _verify(work: _Workload) -> dict[str, Any]:
    """Before trusting a timing: the fused operands are the reference's bytes, and cuDNN's FP8
    scores of them match the torch backend (first 512 rows)."""
    from ..scoring import indexer_scores

    fused, ref = work.prep(True, "triton"), work.prep(True, "torch")
    for name in ("q", "k", "weights", "q_descale", "k_descale"):
        a, b = getattr(fused, name), getattr(ref, name)
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise CliError(f"fused operand {name} differs from the torch reference; not timing.")
    part = fused.rows(0, min(512, work.seq))
    assert part.k_descale is not None  # FP8 operands
    part = type(part)(
        part.q, part.k[:, :512], part.weights, part.q_descale, part.k_descale[:, :512]
    )
    got, want = indexer_scores(part, backend="cudnn"), indexer_scores(part, backend="torch")
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        raise CliError("cuDNN FP8 scores have another -inf pattern than the torch reference.")
    rel = float((got[fin].double() - want[fin].double()).abs().max() / want[fin].abs().max())
    if rel > 1e-3:
        raise CliError(f"cuDNN FP8 scores are off by {rel:.2e} (relative) from the reference.")
    return {"operands_bit_identical": True, "fp8_score_rel_err": rel}


class _Raw:
    """The kernels called directly, as a user of cuDNN and DeepGEMM would (no package code on the
    path but the operands it prepared): the columns the package is measured against."""

    def __init__(self, topk: int) -> None:
        from ..backends import cudnn, deepgemm

        self.k = topk
        self.dsa = cudnn.dsa()
        self.dg = deepgemm._kernel_entry()  # None without DeepGEMM

    def cudnn_scores(self, ops, offsets: torch.Tensor, out: torch.Tensor | None = None):
        ks = None if ops.k_descale is None else ops.k_descale.unsqueeze(-1)
        return self.dsa.indexer_forward_wrapper(
            ops.q, ops.k.unsqueeze(2), ops.weights, ratio=1, sm_scale=ops.sm_scale,
            q_causal_offsets=offsets, precision=ops.precision.value,
            q_scale=ops.q_descale, k_scale=ks, out=out,
        )["scores"]  # fmt: skip

    def deepgemm_logits(self, ops, counts: torch.Tensor, clean: bool = False):
        """Batch row 0 of ``ops`` against keys ``[0, counts)``: compressed and uncleaned (what
        the engines' prefill top-k reads), or with ``clean`` the full cleaned ``(S_q, S_k)``
        scores (``None`` where the entry point takes no ``clean_logits``)."""
        columns = 0 if clean else ops.k.shape[1]
        return self.deepgemm_windows(ops, torch.zeros_like(counts), counts, columns)

    def deepgemm_windows(self, ops, ks: torch.Tensor, ke: torch.Tensor, columns: int):
        """Rows of batch 0 of ``ops`` against their key windows ``[ks, ke)`` (int32, one per
        row): ``columns > 0``: compressed and uncleaned, ``(rows, columns)``, column ``j`` key
        ``ks + j``; ``columns == 0``: DeepGEMM's cleaned ``(rows, S_k)`` logits, ``-inf`` outside
        the windows (``None`` where the entry point takes no ``clean_logits``)."""
        e = self.dg
        assert e is not None  # called only where DeepGEMM imports (_backends)
        q, kv, w = ops.q[0], (ops.k[0], ops.k_descale[0]), ops.weights[0]
        args = ((q, None) if e.q_pair else q, kv, w, ks, ke)
        if columns == 0:
            if not e.clean_logits_arg:
                return None
            return e.fn(*args, clean_logits=True, max_seqlen_k=0)
        extra = {"clean_logits": False} if e.clean_logits_arg else {}
        return e.fn(*args, max_seqlen_k=columns, **extra)

    def cudnn_thd(self, ops, pack: _Packing, chunk: int | None = None, out=None):
        """cuDNN's THD scores ``(rows, max_len)`` of the packing (or of its chunk ``chunk``)."""
        cu_q, offsets, max_q, (r0, r1) = pack.cudnn_args(chunk)
        q, w, qs = ops.q[0, r0:r1], ops.weights[0, r0:r1], ops.q_descale[0, r0:r1]
        return self.dsa.indexer_forward_wrapper(
            q, ops.k[0].unsqueeze(1), w, ratio=1, sm_scale=ops.sm_scale,
            q_causal_offsets=offsets, precision=ops.precision.value, q_scale=qs,
            k_scale=ops.k_descale[0].unsqueeze(-1), out=out, cu_seqlens_q=cu_q,
            cu_seqlens_k=pack.cu, max_seqlen_q=max_q, max_seqlen_k=pack.max_len,
        )["scores"]  # fmt: skip

    def topk(self, scores: torch.Tensor, lens: torch.Tensor, val: bool = True):
        return self.dsa.indexer_top_k_wrapper(
            scores, lens, top_k=self.k, next_n=1, return_val=val, deterministic=True
        )

    def select(self, ops, step: int, backend: str, buf: torch.Tensor | None, score_only=False):
        """Chunked scoring + top-k over rows ``[0, S)`` of batch 1 in chunks of ``step`` rows,
        nothing kept: the raw-kernel bound of ``indexer_select``."""
        from ..rows import WindowScores, causal_key_counts

        b, sq = ops.q.shape[:2]
        sk = ops.k.shape[1]
        zero = torch.zeros(b, dtype=torch.int32, device=_DEVICE)
        for r0 in range(0, sq, step):
            r1 = min(r0 + step, sq)
            part, lens = ops.rows(r0, r1), causal_key_counts(zero, r0, r1 - r0, 1, sk).view(-1)
            if backend == "deepgemm":
                scores = WindowScores(self.deepgemm_logits(part, lens), lens).rows_in_place()
            else:
                assert buf is not None  # given for cuDNN
                out = buf[: b * (r1 - r0) * sk].view(b, r1 - r0, sk)
                scores = self.cudnn_scores(part, zero + r0, out).view(-1, sk)
            if not score_only:
                self.topk(scores, lens)

    def select_thd(self, ops, pack: _Packing, backend: str, buf: torch.Tensor | None):
        """Chunked scoring + top-k (with values) of a packing, its chunks' rows and windows
        built on the host beforehand (as an engine's metadata): the raw-kernel bound of
        ``indexer_select_varlen``. Returns each chunk's indices."""
        from ..rows import WindowScores

        picks = []
        for c, (r0, r1) in enumerate(pack.chunks):
            lens = pack.counts[r0:r1]
            if backend == "deepgemm":
                part = ops.rows(r0, r1)
                logits = self.deepgemm_windows(part, pack.ks[r0:r1], pack.ke[r0:r1], pack.max_len)
                scores = WindowScores(logits, lens).rows_in_place()
            else:
                assert buf is not None  # given for cuDNN
                out = buf[: (r1 - r0) * pack.max_len].view(r1 - r0, pack.max_len)
                scores = self.cudnn_thd(ops, pack, c, out)
            picks.append(self.topk(scores, lens)["indices"])
            del scores
        return picks


@dataclasses.dataclass
class _Packing:
    """A packing of sequences of ``lens`` tokens (queries and keys alike, causal from 0) and
    what a caller of the raw kernels builds once for it, on the host: the packed ``cu``, each
    row's key window ``[ks, ke)`` (DeepGEMM) and its length ``counts`` (the top-k), and per
    chunk of ``step`` rows cuDNN's ``cu_seqlens_q`` and causal offsets."""

    lens: list[int]
    step: int

    def __post_init__(self) -> None:
        starts = [0]
        for n in self.lens:
            starts.append(starts[-1] + n)
        self.total, self.max_len, self.starts = starts[-1], max(self.lens), starts
        ks = torch.cat(
            [
                torch.full((n,), c, dtype=torch.int32)
                for n, c in zip(self.lens, starts[:-1], strict=True)
            ]
        )
        local = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) for n in self.lens])
        self.cu = torch.tensor(starts, dtype=torch.int32).to(_DEVICE)
        self.ks, self.ke, self.counts = ks.to(_DEVICE), (ks + local).to(_DEVICE), local.to(_DEVICE)
        self.chunks = [
            (r0, min(r0 + self.step, self.total)) for r0 in range(0, self.total, self.step)
        ]
        self._cudnn = [self._chunk_args(r0, r1) for r0, r1 in self.chunks]
        self._whole = (self.cu, torch.zeros(len(self.lens), dtype=torch.int32, device=_DEVICE))

    def _chunk_args(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        cu = [min(max(c - r0, 0), r1 - r0) for c in self.starts]
        off = [max(r0 - c, 0) for c in self.starts[:-1]]
        # Two tensors, not two views of one: cuDNN binds each at a 16-byte aligned base.
        cu_t, off_t = (torch.tensor(v, dtype=torch.int32).to(_DEVICE) for v in (cu, off))
        return cu_t, off_t, min(self.max_len, r1 - r0)

    def cudnn_args(self, chunk: int | None):
        """``(cu_seqlens_q, q_causal_offsets, max_seqlen_q, (r0, r1))`` of the whole packing
        (``None``) or of chunk ``chunk``."""
        if chunk is None:
            return (*self._whole, self.max_len, (0, self.total))
        return (*self._cudnn[chunk], self.chunks[chunk])

    def varlen_kwargs(self) -> dict[str, Any]:
        """The packing as the package's varlen entry points take it."""
        return dict(
            cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=self.max_len,
            max_seqlen_k=self.max_len,
        )  # fmt: skip


def _backends(raw: _Raw, batch: int) -> tuple[str, ...]:
    """The FP8 backends timed: cuDNN, and DeepGEMM where it imports (batch 1: raw calls)."""
    return ("cudnn", "deepgemm") if raw.dg is not None and batch == 1 else ("cudnn",)


def _measure(cfg: _BenchConfig, timer: Timer, work: _Workload) -> dict[str, Any]:
    from ..prepare import prepare_scoring_operands
    from ..rows import causal_key_counts
    from ..scoring import _resolve_scoring_backend, indexer_scores, indexer_window_scores
    from ..select import indexer_select
    from ..topk import indexer_topk

    seq, b = work.seq, cfg.batch
    raw = _Raw(cfg.topk)
    backends = _backends(raw, b)
    t: dict[str, Any] = {}  # ms (prep_fp8_torch: None when not timed)
    mem: dict[str, float] = {}
    check = _verify(work) if seq <= 16384 else None
    t["prep_bf16"] = timer(lambda: work.prep(False))
    t["prep_fp8"] = timer(lambda: work.prep(True, "triton"))
    t["prep_fp8_torch"] = timer(lambda: work.prep(True, "torch")) if cfg.torch_reference else None
    ops16, ops8 = work.prep(False), work.prep(True, "triton")
    offsets = torch.zeros(b, dtype=torch.int32, device=_DEVICE)
    lens = causal_key_counts(offsets, 0, seq, 1, seq).view(-1)
    chunked = seq >= cfg.chunked_from
    if not chunked:
        t["raw_score_bf16"] = timer(lambda: raw.cudnn_scores(ops16, offsets))
        t["score_bf16"] = timer(lambda: indexer_scores(ops16))
        t["raw_score_fp8"] = timer(lambda: raw.cudnn_scores(ops8, offsets))
        t["score_fp8"] = timer(lambda: indexer_scores(ops8, backend="cudnn"))
        if "deepgemm" in backends:
            _verify_deepgemm_window(raw, ops8, lens)
            t["raw_score_dg"] = timer(lambda: raw.deepgemm_logits(ops8, lens))
            if raw.deepgemm_logits(ops8, lens, clean=True) is not None:
                t["raw_score_dg_clean"] = timer(lambda: raw.deepgemm_logits(ops8, lens, True))
            t["score_fp8_deepgemm"] = timer(lambda: indexer_scores(ops8, backend="deepgemm"))
            t["score_fp8_deepgemm_window"] = timer(
                lambda: indexer_window_scores(ops8, backend="deepgemm")
            )
        scores = raw.cudnn_scores(ops8, offsets).view(b * seq, seq)
        for key, val in (("raw_topk", False), ("raw_topk_val", True)):
            t[key] = timer(lambda val=val: raw.topk(scores, lens, val))
        t["topk"] = timer(lambda: indexer_topk(scores, cfg.topk, seq_lens=lens))
        host = {
            "raw_score_fp8": lambda: raw.cudnn_scores(ops8, offsets),
            "score_fp8": lambda: indexer_scores(ops8, backend="cudnn"),
            "raw_topk_val": lambda: raw.topk(scores, lens, True),
            "topk": lambda: indexer_topk(scores, cfg.topk, seq_lens=lens),
            "select_fp8": lambda: indexer_select(ops8, topk=cfg.topk, backend="cudnn"),
        }
        if "deepgemm" in backends:
            host["raw_score_dg"] = lambda: raw.deepgemm_logits(ops8, lens)
            host["select_fp8_dg"] = lambda: indexer_select(ops8, topk=cfg.topk, backend="deepgemm")
        h = {name: timer.host_us(fn) for name, fn in host.items()}
        del scores, host
        q32, k32 = work.pre8(work.q, work.k, work.freqs)
        car = (q32.transpose(0, 1), k32.transpose(0, 1), work.w8.transpose(0, 1))
        for p, config in (("bf16", work.cfg16), ("fp8", work.cfg8)):
            t[f"api_{p}"] = timer(
                lambda config=config: indexer_topk(
                    indexer_scores(prepare_scoring_operands(*car, config=config)), cfg.topk
                )
            )
        del q32, k32, car
    sel: _SelectArgs = dict(topk=cfg.topk, chunk_bytes=cfg.chunk_bytes)
    t["e2e_bf16"] = timer(lambda: indexer_select(work.prep(False), **sel))
    cu: _BackendSelectArgs = {**sel, "backend": "cudnn"}
    t["e2e_fp8"] = timer(lambda: indexer_select(work.prep(True), **cu))
    mem["e2e_bf16"] = _peak_extra_mib(lambda: indexer_select(work.prep(False), **sel))
    mem["e2e_fp8"] = _peak_extra_mib(lambda: indexer_select(work.prep(True), **cu))
    if "deepgemm" in backends:
        dg: _BackendSelectArgs = {**sel, "backend": "deepgemm"}
        t["e2e_fp8_dg"] = timer(lambda: indexer_select(work.prep(True), **dg))
        mem["e2e_fp8_dg"] = _peak_extra_mib(lambda: indexer_select(work.prep(True), **dg))
    out: dict[str, Any] = {
        "seq": seq,
        "heads": work.heads,
        "batch": b,
        "default_backend": _resolve_scoring_backend("auto", ops8),
        "chunked": chunked,
        "check": check,
        "times_ms": t,
        "peak_extra_mib": mem,
        "e2e_ratio": t["e2e_bf16"] / t["e2e_fp8"],
    }
    if not chunked:
        out["host_us"] = h
    if "e2e_fp8_dg" in t:
        out["e2e_ratio_dg"] = t["e2e_bf16"] / t["e2e_fp8_dg"]
    if not chunked:
        raw16 = t["prep_bf16"] + t["raw_score_bf16"] + t["raw_topk"]
        raw8 = t["prep_fp8"] + t["raw_score_fp8"] + t["raw_topk"]
        out["overhead"] = {
            "score_bf16": t["score_bf16"] / t["raw_score_bf16"],
            "score_fp8": t["score_fp8"] / t["raw_score_fp8"],
            "topk": t["topk"] / t["raw_topk"],
            "topk_vs_val": t["topk"] / t["raw_topk_val"],
            # e2e over prep + raw scoring + raw top-k as the package calls it (with values)
            "e2e_fp8": t["e2e_fp8"] / (t["prep_fp8"] + t["raw_score_fp8"] + t["raw_topk_val"]),
        }
        out["raw_e2e_ms"] = {"bf16": raw16, "fp8": raw8}
        out["e2e_bound"] = raw16 / raw8
        out["e2e_share_of_bound"] = out["e2e_ratio"] / out["e2e_bound"]
        out["api_ratio"] = t["api_bf16"] / t["api_fp8"]
        out["flops_score"] = 2.0 * b * work.heads * _HEAD_DIM * seq * (seq + 1) / 2
        if "raw_score_dg" in t:
            clean = t.get("raw_score_dg_clean")
            out["overhead"] |= {
                "score_dg": None if clean is None else t["score_fp8_deepgemm"] / clean,
                "score_dg_window": t["score_fp8_deepgemm_window"] / t["raw_score_dg"],
                "dg_vs_cudnn": t["raw_score_dg"] / t["raw_score_fp8"],
                "e2e_fp8_dg": t["e2e_fp8_dg"]
                / (t["prep_fp8"] + t["raw_score_dg"] + t["raw_topk_val"]),
                "e2e_dg_vs_cudnn": t["e2e_fp8_dg"] / t["e2e_fp8"],
            }
            raw_dg = t["prep_fp8"] + t["raw_score_dg"] + t["raw_topk"]
            out["raw_e2e_ms"]["fp8_dg"] = raw_dg
            out["e2e_bound_dg"] = raw16 / raw_dg
            out["e2e_share_of_bound_dg"] = out["e2e_ratio_dg"] / out["e2e_bound_dg"]
            out["tflops_dg"] = out["flops_score"] / t["raw_score_dg"] / 1e9
    return out


def _select_step(cfg: _BenchConfig, seq: int) -> int:
    from ..select import _SELECT_BYTES_PER_SCORE, _chunk_rows

    return _chunk_rows(cfg.chunk_bytes, seq, cfg.batch * seq * _SELECT_BYTES_PER_SCORE)


def _measure_long(cfg: _BenchConfig, timer: Timer, work: _Workload) -> dict[str, Any]:
    """Chunked select at long S: the package end to end and from prepared operands, the raw
    chunked kernels (the bound), and the peak memory each adds."""
    from ..select import indexer_select

    seq, b = work.seq, cfg.batch
    raw = _Raw(cfg.topk)
    step = _select_step(cfg, seq)
    sel: _SelectArgs = dict(topk=cfg.topk, chunk_bytes=cfg.chunk_bytes)
    t: dict[str, float] = {}
    mem: dict[str, float] = {}
    t["prep_bf16"] = timer(lambda: work.prep(False))
    t["prep_fp8"] = timer(lambda: work.prep(True, "triton"))
    ops = {"bf16": work.prep(False), "fp8": work.prep(True)}
    buf = torch.empty(b * step * seq, dtype=torch.float32, device=_DEVICE)
    cases: list[tuple[str, Backend]] = [("bf16", "cudnn"), ("fp8", "cudnn")]
    if "deepgemm" in _backends(raw, b):
        cases.append(("fp8", "deepgemm"))
    for p, backend in cases:
        key = p if backend == "cudnn" else "fp8_dg"
        fp8 = p == "fp8"
        t[f"raw_{key}"] = timer(lambda p=p, be=backend: raw.select(ops[p], step, be, buf))
        t[f"select_{key}"] = timer(
            lambda p=p, be=backend: indexer_select(ops[p], backend=be, **sel)
        )
        t[f"e2e_{key}"] = timer(
            lambda fp8=fp8, be=backend: indexer_select(work.prep(fp8), backend=be, **sel)
        )
        mem[f"select_{key}"] = _peak_extra_mib(
            lambda p=p, be=backend: indexer_select(ops[p], backend=be, **sel)
        )
        mem[f"e2e_{key}"] = _peak_extra_mib(
            lambda fp8=fp8, be=backend: indexer_select(work.prep(fp8), backend=be, **sel)
        )
    out: dict[str, Any] = {
        "seq": seq,
        "heads": work.heads,
        "batch": b,
        "chunk_rows": step,
        "chunks": -(-seq // step),
        "chunk_budget_mib": step * b * seq * 12 / 2**20,
        "times_ms": t,
        "peak_extra_mib": mem,
    }
    for key in ("fp8", "fp8_dg"):
        if f"e2e_{key}" in t:
            out[f"ratio_{key}"] = t["e2e_bf16"] / t[f"e2e_{key}"]
            bound = (t["prep_bf16"] + t["raw_bf16"]) / (t["prep_fp8"] + t[f"raw_{key}"])
            out[f"bound_{key}"] = bound
            out[f"of_bound_{key}"] = out[f"ratio_{key}"] / bound
            out[f"select_vs_raw_{key}"] = t[f"select_{key}"] / t[f"raw_{key}"]
    out["select_vs_raw_bf16"] = t["select_bf16"] / t["raw_bf16"]
    return out


def _bandwidth(timer: Timer) -> tuple[float, float]:
    """The card's achieved write and read bandwidth, bytes per ms (a 1 GiB fill and sum)."""
    x = torch.empty(_BANDWIDTH_BYTES // 4, dtype=torch.float32, device=_DEVICE)
    write = timer(lambda: x.fill_(0.5))
    read = timer(lambda: x.sum())
    return x.numel() * 4 / write, x.numel() * 4 / read


def _measure_split(
    cfg: _BenchConfig, timer: Timer, work: _Workload, bandwidth: tuple[float, float]
) -> dict[str, Any]:
    """Where FP8 selection's time goes, per backend: scoring alone (writing the scores), the
    top-k (raw select minus scoring), and the scores' memory traffic at the measured bandwidth
    (written once by the scoring kernel, read once by the top-k), against the package's FP8 end
    to end; and what a fused score-and-select kernel that never writes the scores could save."""
    from ..select import indexer_select

    seq, b = work.seq, cfg.batch
    raw = _Raw(cfg.topk)
    step = _select_step(cfg, seq)
    ops = work.prep(True)
    buf = torch.empty(b * step * seq, dtype=torch.float32, device=_DEVICE)
    prep = timer(lambda: work.prep(True, "triton"))
    causal = b * seq * (seq + 1) // 2 * 4  # bytes of the scores inside the causal windows
    out: dict[str, Any] = {"seq": seq, "heads": work.heads, "batch": b, "chunks": -(-seq // step)}
    out["bandwidth_gbs"] = {"write": bandwidth[0] / 1e6, "read": bandwidth[1] / 1e6}
    out["prep_fp8_ms"] = prep
    for backend in _backends(raw, b):
        score = timer(lambda be=backend: raw.select(ops, step, be, buf, score_only=True))
        both = timer(lambda be=backend: raw.select(ops, step, be, buf))
        e2e = timer(lambda be=backend: indexer_select(
            work.prep(True), topk=cfg.topk, chunk_bytes=cfg.chunk_bytes, backend=be
        ))  # fmt: skip
        # cuDNN writes every score of its (rows, S_k) output, -inf included; DeepGEMM's
        # compressed logits only the windows. The top-k reads each row's window.
        written = b * seq * seq * 4 if backend == "cudnn" else causal
        write_ms, read_ms = written / bandwidth[0], causal / bandwidth[1]
        topk = both - score
        traffic = write_ms + read_ms
        out[backend] = {
            "score_ms": score,
            "topk_ms": topk,
            "raw_select_ms": both,
            "e2e_ms": e2e,
            "package_ms": e2e - prep - both,  # what the package adds over the raw kernels
            "written_gib": written / 2**30,
            "read_gib": causal / 2**30,
            "write_ms": write_ms,
            "read_ms": read_ms,
            "traffic_ms": traffic,
            "traffic_share": traffic / e2e,
            "topk_reads": topk / read_ms,  # the top-k's time in single reads of the scores
            # A fused kernel that never writes the scores: at least their traffic saved; at most
            # the whole top-k too, with scoring as fast as without its stores.
            "fused_speedup_traffic": e2e / (e2e - traffic),
            "fused_speedup_max": e2e / max(prep + score - write_ms, 1e-9),
            "build_fused": traffic / e2e > _FUSED_THRESHOLD,
        }
    return out


def _verify_deepgemm_window(raw: _Raw, ops: ScoringOperands, lens: torch.Tensor) -> None:
    """Before timing ``indexer_scores(clean=False)`` on DeepGEMM (batch 1): its scores inside each
    row's window are DeepGEMM's compressed logits bit for bit, its lengths the causal counts."""
    from ..scoring import indexer_window_scores

    window = indexer_window_scores(ops, backend="deepgemm")
    logits = raw.deepgemm_logits(ops, lens)
    inside = torch.arange(logits.shape[1], device=_DEVICE) < lens.unsqueeze(1)
    if not torch.equal(window.lengths[0], lens) or not torch.equal(
        window.scores[0][inside], logits[inside]
    ):
        raise CliError("DeepGEMM scores (clean=False) differ from its raw logits; not timing.")


def _verify_thd(raw: _Raw, ops: ScoringOperands, pack: _Packing, backends: tuple[str, ...]):
    """Before timing a packing: ``indexer_scores_varlen`` is the raw kernels' output, bit for
    bit: on DeepGEMM its compressed logits inside each row's window and ``-inf`` past it (and
    the same values in DeepGEMM's cleaned logits, the windows read at their packed keys), on
    cuDNN the THD kernel's scores (``-inf`` included). ``CliError`` otherwise."""
    from ..scoring import indexer_scores_varlen, indexer_window_scores_varlen

    kw = pack.varlen_kwargs()
    cols = torch.arange(pack.max_len, device=_DEVICE)
    inside = cols < pack.counts.unsqueeze(1)  # (T, max_len): each row's window
    checked = []
    if "deepgemm" in backends:
        got = indexer_scores_varlen(ops, backend="deepgemm", **kw)
        logits = raw.deepgemm_windows(ops, pack.ks, pack.ke, pack.max_len)
        if not torch.equal(got[inside], logits[inside]) or not bool(
            (got[~inside] == float("-inf")).all()
        ):
            raise CliError("DeepGEMM THD scores differ from its raw logits; not timing.")
        window = indexer_window_scores_varlen(ops, backend="deepgemm", **kw)
        if not torch.equal(window.lengths, pack.counts) or not torch.equal(
            window.scores[inside], logits[inside]
        ):
            raise CliError("DeepGEMM THD scores (clean=False) differ from its raw logits.")
        clean = raw.deepgemm_windows(ops, pack.ks, pack.ke, 0)
        if clean is not None:
            keys = (pack.ks.long().unsqueeze(1) + cols).clamp_(max=clean.shape[1] - 1)
            if not torch.equal(clean.gather(1, keys)[inside], got[inside]):
                raise CliError("DeepGEMM THD scores differ from its cleaned logits; not timing.")
            checked.append("deepgemm clean")
        checked += ["deepgemm", "deepgemm clean=False"]
        del got, logits, clean, window
    got = indexer_scores_varlen(ops, backend="cudnn", **kw)
    if not torch.equal(got, raw.cudnn_thd(ops, pack)):
        raise CliError("cuDNN THD scores differ from its raw kernel's; not timing.")
    return {"scores_bit_identical": [*checked, "cudnn"]}


def _measure_thd(cfg: _BenchConfig, timer: Timer, work: _Workload, lens: list[int]):
    """One packing of ``lens`` (summing to ``work.seq``) at ``work.heads``, FP8 operands:
    ``indexer_scores_varlen`` beside the raw kernels (below ``--chunked-from``), and
    ``indexer_select_varlen`` beside the raw chunked score + top-k, each backend."""
    from ..scoring import (
        _resolve_scoring_backend,
        indexer_scores_varlen,
        indexer_window_scores_varlen,
    )
    from ..select import _SELECT_BYTES_PER_SCORE, _chunk_rows, indexer_select_varlen

    raw = _Raw(cfg.topk)
    backends = _backends(raw, 1)
    ops = work.prep(True, "triton")
    step = _chunk_rows(cfg.chunk_bytes, work.seq, max(lens) * _SELECT_BYTES_PER_SCORE)
    pack = _Packing(lens, step)
    kw = pack.varlen_kwargs()
    chunked = work.seq >= cfg.chunked_from
    t: dict[str, float] = {}
    out: dict[str, Any] = {
        "seq": work.seq,
        "heads": work.heads,
        "lens": lens,
        "chunks": len(pack.chunks),
        "chunked": chunked,
        "default_backend": _resolve_scoring_backend("auto", ops),
        "check": None if chunked else _verify_thd(raw, ops, pack, backends),
    }
    if not chunked:
        host: dict[str, _Call] = {
            "raw_score_cudnn": lambda: raw.cudnn_thd(ops, pack),
            "score_cudnn": lambda: indexer_scores_varlen(ops, backend="cudnn", **kw),
        }
        if "deepgemm" in backends:
            dg = (pack.ks, pack.ke)
            host["raw_score_dg"] = lambda: raw.deepgemm_windows(ops, *dg, pack.max_len)
            if raw.deepgemm_windows(ops, *dg, 0) is not None:
                t["raw_score_dg_clean"] = timer(lambda: raw.deepgemm_windows(ops, *dg, 0))
            host["score_dg"] = lambda: indexer_scores_varlen(ops, backend="deepgemm", **kw)
            host["score_dg_window"] = lambda: indexer_window_scores_varlen(
                ops, backend="deepgemm", **kw
            )
        t |= {name: timer(fn) for name, fn in host.items()}
        out["host_us"] = {name: timer.host_us(fn) for name, fn in host.items()}
        del host
    buf = torch.empty(step * pack.max_len, dtype=torch.float32, device=_DEVICE)
    picks_equal = {}
    for name in backends:
        backend = cast("Backend", name)
        key = "dg" if name == "deepgemm" else name
        mine = buf if name == "cudnn" else None

        def select(be: Backend = backend) -> torch.Tensor:
            picks = indexer_select_varlen(
                ops, topk=cfg.topk, backend=be, chunk_bytes=cfg.chunk_bytes, **kw
            )
            return cast(torch.Tensor, picks)  # no margins: the picks alone

        want = torch.cat(raw.select_thd(ops, pack, backend, mine))
        picks_equal[name] = bool(torch.equal(select(), want))
        del want
        t[f"raw_select_{key}"] = timer(lambda be=backend, b=mine: raw.select_thd(ops, pack, be, b))
        t[f"select_{key}"] = timer(select)
    out["picks_equal_raw"] = picks_equal
    out["times_ms"] = t
    ratios = {}
    for ratio, pkg, ref in (
        ("score_dg", "score_dg", "raw_score_dg"),
        ("score_dg_clean", "score_dg", "raw_score_dg_clean"),
        ("score_dg_window", "score_dg_window", "raw_score_dg"),
        ("score_cudnn", "score_cudnn", "raw_score_cudnn"),
        ("select_dg", "select_dg", "raw_select_dg"),
        ("select_cudnn", "select_cudnn", "raw_select_cudnn"),
    ):
        if pkg in t and ref in t:
            ratios[ratio] = t[pkg] / t[ref]
    out["overhead"] = ratios
    return out


def _measure_megatron(cfg: _BenchConfig, timer: Timer, work: _Workload) -> dict[str, Any]:
    from .bench_megatron import _measure_megatron

    return _measure_megatron(timer, work, cfg.topk, cfg.batch, _DEVICE)


def _run_bench(
    cfg: _BenchConfig, on_profile: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Measure every ``(S, H)`` of ``cfg``; the report :func:`format_tables` prints.
    ``on_profile`` gets the report so far after each profile (default, long, split, thd)."""
    _check_environment(cfg)
    from importlib import metadata

    from ..backends import deepgemm

    gen = torch.Generator(device=_DEVICE).manual_seed(cfg.seed)
    timer = Timer(cfg.reps, cfg.warmup)
    versions = {"torch": torch.__version__, "deepgemm": deepgemm._entry_point()}
    for dist in ("triton", "nvidia-cudnn-frontend"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "versions": versions,
        "config": dataclasses.asdict(cfg),
    }
    long_timer = Timer(cfg.long_reps, 1)  # --long and --split: seconds per call at S >= 65536
    bw = _bandwidth(long_timer) if cfg.split_seqs else (0.0, 0.0)

    def thd(s: int, h: int) -> dict[str, Any]:
        lens = thd_lengths(s, cfg.thd_weights)
        packed = _Workload(cfg, s, h, gen, lens)
        return _measure_thd(cfg, timer if s < cfg.chunked_from else long_timer, packed, lens)

    def work(s: int, h: int) -> _Workload:
        return _Workload(cfg, s, h, gen)

    plans: list[tuple[str, tuple[int, ...], Callable[[int, int], dict[str, Any]]]] = [
        ("results", cfg.seqs, lambda s, h: _measure(cfg, timer, work(s, h))),
        ("long", cfg.long_seqs, lambda s, h: _measure_long(cfg, long_timer, work(s, h))),
        ("split", cfg.split_seqs, lambda s, h: _measure_split(cfg, long_timer, work(s, h), bw)),
        ("thd", cfg.thd_seqs, thd),
        ("megatron", cfg.megatron_seqs, lambda s, h: _measure_megatron(cfg, timer, work(s, h))),
    ]
    for key, seqs, measure in plans:
        cases = [(s, h) for s in seqs for h in cfg.heads]
        report[key] = []
        for s, h in progress(cases, total=len(cases), desc=f"bench {key}"):
            report[key].append(measure(s, h))
            torch.cuda.empty_cache()
        if cases and on_profile is not None:
            on_profile(report)
    return report


def _main(args: argparse.Namespace) -> int:
    long = args.long or args.long_seq is not None
    split = args.split or args.split_seq is not None
    thd = args.thd or args.thd_seq is not None
    megatron = args.megatron or args.megatron_seq is not None
    long_seqs = tuple(args.long_seq or _LONG_SEQS) if long else ()
    only = (
        long or split or thd or megatron
    )  # profiles of their own: the default tables only with --seq
    cfg = _BenchConfig(
        seqs=tuple(args.seq) if args.seq else () if only else _BenchConfig.seqs,
        heads=tuple(args.heads),
        batch=args.batch,
        topk=args.topk,
        reps=args.reps,
        warmup=args.warmup,
        chunked_from=args.chunked_from,
        chunk_bytes=args.chunk_bytes,
        rope_fp32=args.rope_fp32,
        hadamard=args.hadamard,
        torch_reference=args.torch_reference,
        seed=args.seed,
        long_seqs=long_seqs,
        long_reps=args.long_reps,
        split_seqs=tuple(args.split_seq or _SPLIT_SEQS) if split else (),
        thd_seqs=tuple(args.thd_seq or (*_THD_SEQS, *long_seqs)) if thd else (),
        thd_weights=tuple(args.thd_weights),
        megatron_seqs=tuple(args.megatron_seq or _BenchConfig.seqs) if megatron else (),
    )
    # With --json the tables of each finished profile go to stderr as it ends, so a run cut
    # short by a time limit still leaves its first profiles in the log.
    partial = (
        (lambda r: print(format_tables(r), file=sys.stderr, flush=True)) if args.json else None
    )
    report = _run_bench(cfg, partial)
    if args.json:
        print_json(report)
    else:
        print(format_tables(report))
    return 0
