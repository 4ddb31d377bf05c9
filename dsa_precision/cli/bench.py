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

``S >= --chunked-from`` is timed end to end only (the full score matrix would not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from . import CliError, progress

__all__ = ["BenchConfig", "format_tables", "register", "run_bench"]

HEAD_DIM = 128
ROPE_DIM = 64
_FLUSH_BYTES = 256 << 20  # larger than the H200's L2 (60 MB)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure (the command's flags)."""

    seqs: tuple[int, ...] = (8192, 16384, 65536)
    heads: tuple[int, ...] = (32, 64)
    batch: int = 1
    topk: int = 2048
    reps: int = 20
    warmup: int = 3
    chunked_from: int = 65536
    chunk_bytes: int | None = None  # indexer_select's default
    rope_fp32: bool = True
    # Off by default: Megatron's BF16 Hadamard is fast_hadamard_transform's kernel; where that
    # extension is missing, the BF16 side would time the package's float64 transform instead and
    # the BF16 / FP8 ratio would measure that, not the precision. vLLM's path has no Hadamard.
    hadamard: bool = False
    torch_reference: bool = False
    seed: int = 0


def register(subparsers: argparse._SubParsersAction) -> None:
    d = BenchConfig()
    p = subparsers.add_parser(
        "bench",
        help="time the indexer's kernels and the package beside them, BF16 vs FP8 (CUDA GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seq", type=int, nargs="+", default=list(d.seqs), help="sequence lengths S")
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
        help="indexer_select's working-set budget per chunk (default: its own, one chunk up to "
        "4 GiB, else 1 GiB chunks)",
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
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document, no tables")
    p.set_defaults(func=main)


# --------------------------------------------------------------------------------------------
# measurement


class _Timer:
    """Median of CUDA-event timings after warm-up, the L2 flushed before each repetition."""

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps, self.warmup = reps, warmup
        self._flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            self._flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


def _peak_extra_mib(fn: Callable[[], Any]) -> float:
    """Allocator peak of one call beyond what existed before it and beyond its outputs."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - _nbytes(out)
    del out
    return max(extra, 0) / 2**20


def _inputs(seq: int, batch: int, heads: int, gen: torch.Generator):
    """Megatron-layout BF16 projections (q, k, raw head weights) and RoPE angles."""

    def nonzero(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen)
        return torch.where(x == 0, torch.full_like(x, 1e-3), x).to(torch.bfloat16)

    inv = 10000.0 ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device="cuda") / ROPE_DIM)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device="cuda"), inv)
    freqs = torch.cat([angles] * 2, -1).view(seq, 1, 1, ROPE_DIM)
    return (
        nonzero(seq, batch, heads, HEAD_DIM),
        nonzero(seq, batch, HEAD_DIM),
        nonzero(seq, batch, heads),
        freqs,
    )


def _preprocess(rope_fp32: bool, hadamard: bool):
    from ..preprocess import IndexerPreprocess

    pre = IndexerPreprocess(HEAD_DIM, ROPE_DIM, rope_fp32=rope_fp32, rotate_activation=hadamard)
    with torch.no_grad():
        pre.k_norm.weight.normal_(1.0, 0.1)
        pre.k_norm.bias.normal_(0.0, 0.1)
    return pre.to(device="cuda", dtype=torch.bfloat16)


def _check_environment(cfg: BenchConfig) -> None:
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
    for name in ("batch", "topk", "reps", "chunk_bytes"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1.")
    if any(s < 1 for s in cfg.seqs):
        raise CliError("--seq values must be >= 1.")
    from .. import _cudnn
    from ..config import ScoringPrecision
    from ..operands import triton_unavailable_reason

    reason = (
        _cudnn.scoring_unsupported_reason(
            device=torch.device("cuda"),
            precision=ScoringPrecision.FP8,
            n_heads=cfg.heads[0],
            head_dim=HEAD_DIM,
            n_kv_heads=1,
        )
        or triton_unavailable_reason()
    )
    if reason:
        raise CliError(reason)


class _Workload:
    """One (S, H) case: projections, preprocessing modules, configs and prepared operands."""

    def __init__(self, cfg: BenchConfig, seq: int, heads: int, gen: torch.Generator) -> None:
        from ..config import IndexerPrecisionConfig
        from ..operands import prepare_indexer_operands
        from ..preprocess import indexer_head_weights

        self.seq, self.heads = seq, heads
        self.q, self.k, w_raw, self.freqs = _inputs(seq, cfg.batch, heads, gen)
        self.pre16 = _preprocess(False, cfg.hadamard)
        self.pre8 = _preprocess(cfg.rope_fp32, cfg.hadamard)
        self.cfg16 = IndexerPrecisionConfig()
        self.cfg8 = IndexerPrecisionConfig(rope_fp32=cfg.rope_fp32, scoring_precision="fp8")
        hw = dict(n_heads=heads, head_dim=HEAD_DIM)
        self.w16 = indexer_head_weights(w_raw, fp32=False, **hw)
        self.w8 = indexer_head_weights(w_raw, fp32=True, **hw)
        self._prepare = prepare_indexer_operands

    def prep(self, fp8: bool, impl: str = "auto"):
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


def _measure(cfg: BenchConfig, timer: _Timer, work: _Workload) -> dict[str, Any]:
    from .. import _cudnn, _deepgemm
    from ..scoring import causal_key_counts, indexer_scores
    from ..select import indexer_select
    from ..topk import indexer_topk

    seq, b = work.seq, cfg.batch
    t: dict[str, float | None] = {}
    mem: dict[str, float] = {}
    check = _verify(work) if seq <= 16384 else None
    t["prep_bf16"] = timer(lambda: work.prep(False))
    t["prep_fp8"] = timer(lambda: work.prep(True, "triton"))
    t["prep_fp8_torch"] = timer(lambda: work.prep(True, "torch")) if cfg.torch_reference else None
    ops16, ops8 = work.prep(False), work.prep(True, "triton")
    offsets = torch.zeros(b, dtype=torch.int32, device="cuda")
    lens = causal_key_counts(offsets, 0, seq, 1, seq).view(-1)
    chunked = seq >= cfg.chunked_from
    if not chunked:
        dsa = _cudnn.dsa()

        def raw_score(ops):
            ks = None if ops.k_descale is None else ops.k_descale.unsqueeze(-1)
            return dsa.indexer_forward_wrapper(
                ops.q, ops.k.unsqueeze(2), ops.weights, ratio=1, sm_scale=ops.sm_scale,
                q_causal_offsets=offsets, precision=ops.precision.value,
                q_scale=ops.q_descale, k_scale=ks,
            )["scores"]  # fmt: skip

        t["raw_score_bf16"] = timer(lambda: raw_score(ops16))
        t["score_bf16"] = timer(lambda: indexer_scores(ops16))
        t["raw_score_fp8"] = timer(lambda: raw_score(ops8))
        t["score_fp8"] = timer(lambda: indexer_scores(ops8))
        if _deepgemm.deepgemm_available():
            t["score_fp8_deepgemm"] = timer(lambda: indexer_scores(ops8, backend="deepgemm"))
        scores = raw_score(ops8).view(b * seq, seq)
        for key, val in (("raw_topk", False), ("raw_topk_val", True)):
            t[key] = timer(
                lambda val=val: dsa.indexer_top_k_wrapper(
                    scores, lens, top_k=cfg.topk, next_n=1, return_val=val, deterministic=True
                )
            )
        t["topk"] = timer(lambda: indexer_topk(scores, cfg.topk, seq_lens=lens))
        del scores
        q32, k32 = work.pre8(work.q, work.k, work.freqs)
        car = (q32.transpose(0, 1), k32.transpose(0, 1), work.w8.transpose(0, 1))
        for p, config in (("bf16", work.cfg16), ("fp8", work.cfg8)):
            t[f"api_{p}"] = timer(
                lambda config=config: indexer_topk(indexer_scores(*car, config=config), cfg.topk)
            )
        del q32, k32, car
    sel = dict(topk=cfg.topk, chunk_bytes=cfg.chunk_bytes)
    t["e2e_bf16"] = timer(lambda: indexer_select(work.prep(False), **sel))
    t["e2e_fp8"] = timer(lambda: indexer_select(work.prep(True), **sel))
    mem["e2e_bf16"] = _peak_extra_mib(lambda: indexer_select(work.prep(False), **sel))
    mem["e2e_fp8"] = _peak_extra_mib(lambda: indexer_select(work.prep(True), **sel))
    out: dict[str, Any] = {
        "seq": seq,
        "heads": work.heads,
        "batch": b,
        "chunked": chunked,
        "check": check,
        "times_ms": t,
        "peak_extra_mib": mem,
        "e2e_ratio": t["e2e_bf16"] / t["e2e_fp8"],
    }
    if not chunked:
        raw16 = t["prep_bf16"] + t["raw_score_bf16"] + t["raw_topk"]
        raw8 = t["prep_fp8"] + t["raw_score_fp8"] + t["raw_topk"]
        out["overhead"] = {
            "score_bf16": t["score_bf16"] / t["raw_score_bf16"],
            "score_fp8": t["score_fp8"] / t["raw_score_fp8"],
            "topk": t["topk"] / t["raw_topk"],
            "topk_vs_val": t["topk"] / t["raw_topk_val"],
        }
        out["raw_e2e_ms"] = {"bf16": raw16, "fp8": raw8}
        out["e2e_bound"] = raw16 / raw8
        out["e2e_share_of_bound"] = out["e2e_ratio"] / out["e2e_bound"]
        out["api_ratio"] = t["api_bf16"] / t["api_fp8"]
        out["flops_score"] = 2.0 * b * work.heads * HEAD_DIM * seq * (seq + 1) / 2
    return out


# --------------------------------------------------------------------------------------------
# output


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_tables(report: dict[str, Any]) -> str:
    """The human-readable tables of a :func:`run_bench` report (times in ms)."""
    cfg = report["config"]
    rows = report["results"]
    full = [r for r in rows if not r["chunked"]]
    lines = [
        f"{report['device']}: B={cfg['batch']} D={HEAD_DIM} causal, top-k {cfg['topk']}, "
        f"FP8 side rope_fp32={cfg['rope_fp32']}, hadamard={cfg['hadamard']}; median of "
        f"{cfg['reps']} reps (ms)",
        "",
        "kernels vs package (same operands; x = package / raw)",
        f"{'S':>6} {'H':>3} | {'bf16 raw':>8} {'pkg':>7} {'x':>5} | {'fp8 raw':>8} {'pkg':>7} "
        f"{'x':>5} | {'deepgemm':>8} | {'top-k raw':>9} {'+val':>6} {'pkg':>7} {'x':>5} "
        f"{'x val':>5}",
    ]
    for r in full:
        t, o = r["times_ms"], r["overhead"]
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t['raw_score_bf16']):>8} "
            f"{_fmt(t['score_bf16']):>7} {o['score_bf16']:>5.2f} | {_fmt(t['raw_score_fp8']):>8} "
            f"{_fmt(t['score_fp8']):>7} {o['score_fp8']:>5.2f} | "
            f"{_fmt(t.get('score_fp8_deepgemm')):>8} | {_fmt(t['raw_topk']):>9} "
            f"{_fmt(t.get('raw_topk_val')):>6} {_fmt(t['topk']):>7} {o['topk']:>5.2f} "
            f"{_fmt(o.get('topk_vs_val'), '.2f'):>5}"
        )
    lines += [
        "top-k raw: indices only (return_val=False); +val: with each pick's score, the "
        "wrapper's default and what the package's -inf/NaN guarantee reads; x / x val: package "
        "over each",
        "",
        "end to end from the projections (prep + indexer_select; x = BF16 / FP8)",
        f"{'S':>6} {'H':>3} | {'prep bf16':>9} {'prep fp8':>8} | {'e2e bf16':>8} {'e2e fp8':>8} "
        f"{'x':>5} | {'raw bound x':>11} {'of bound':>8} | {'api x':>5} | {'peak MiB bf16':>13} "
        f"{'fp8':>6}",
    ]
    for r in rows:
        t, m = r["times_ms"], r["peak_extra_mib"]
        bound = _fmt(r.get("e2e_bound"), ".2f")
        share = "-" if "e2e_share_of_bound" not in r else f"{100 * r['e2e_share_of_bound']:.0f} %"
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t['prep_bf16']):>9} {_fmt(t['prep_fp8']):>8} | "
            f"{_fmt(t['e2e_bf16']):>8} {_fmt(t['e2e_fp8']):>8} {r['e2e_ratio']:>5.2f} | "
            f"{bound:>11} {share:>8} | {_fmt(r.get('api_ratio'), '.2f'):>5} | "
            f"{m['e2e_bf16']:>13.0f} {m['e2e_fp8']:>6.0f}"
        )
    lines += [
        "",
        "raw bound = (prep bf16 + raw bf16 scoring + raw top-k) / (prep fp8 + raw fp8 scoring + "
        "raw top-k); api = indexer_topk(indexer_scores(carriers)), BF16 / FP8",
    ]
    return "\n".join(lines)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every ``(S, H)`` of ``cfg``; the report :func:`format_tables` prints."""
    _check_environment(cfg)
    from importlib import metadata

    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    timer = _Timer(cfg.reps, cfg.warmup)
    versions = {"torch": torch.__version__}
    for dist in ("triton", "nvidia-cudnn-frontend"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    cases = [(s, h) for s in cfg.seqs for h in cfg.heads]
    results = []
    for s, h in progress(cases, total=len(cases), desc="bench"):
        results.append(_measure(cfg, timer, _Workload(cfg, s, h, gen)))
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "versions": versions,
        "config": dataclasses.asdict(cfg),
        "results": results,
    }


def main(args: argparse.Namespace) -> int:
    cfg = BenchConfig(
        seqs=tuple(args.seq),
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
    )
    report = run_bench(cfg)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_tables(report))
    return 0
