"""``python -m dsa_precision bench``: where the indexer's time goes on the GPU, BF16 against FP8.

For each sequence length ``S`` and head count ``H`` (``D = 128``, causal, batch ``B``) it times,
as the median of CUDA-event timings after warm-up (L2 flushed before every repetition, random
non-zero inputs):

- ``prep fused``: the fused Triton preprocess+quantize kernel (projections -> FP8 operands);
- ``prep torch``: the torch reference of the same (``IndexerPreprocess`` + quantization);
- ``prep bf16``: the BF16 path's preprocessing (torch, then BF16 operands);
- ``score bf16`` / ``score fp8``: cuDNN scoring of prepared operands (chunked past
  ``--chunked-from``, each chunk dropped as it comes);
- ``top-k``: cuDNN's deterministic top-k of the FP8 scores (``k = --topk``);
- ``e2e bf16`` / ``e2e fp8``: preprocess + score + top-k through ``indexer_select``.

Scoring FLOPs are the causal triangle's multiply-adds, ``2 * B * H * D * S * (S + 1) / 2``.
"Peak extra" memory is the allocator's peak during one call minus what was allocated before it
and minus the call's outputs (memory cuDNN takes outside PyTorch's allocator is not seen), for
the fused preprocessing, for score + top-k of prepared operands (``select``) and end to end
(where the operands are intermediates, so they count). The
ceilings measured in the same run are a large BF16 matmul, an FP8 ``torch._scaled_mm`` and a
device-to-device copy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from .cli import CliError, progress

__all__ = ["register", "run"]

HEAD_DIM = 128
ROPE_DIM = 64
_FLUSH_BYTES = 256 << 20  # larger than the H200's L2 (60 MB)
_CEILING_N = 8192


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time preprocessing, scoring and top-k of the indexer, BF16 vs FP8 (CUDA GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[4096, 16384, 65536],
        help="sequence lengths S (default: 4096 16384 65536)",
    )
    p.add_argument(
        "--heads",
        type=int,
        nargs="+",
        default=[32, 64],
        help="indexer heads H, 32 or 64 (default: 32 64)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size B (default: 1)")
    p.add_argument("--topk", type=int, default=2048, help="keys selected per query (default: 2048)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls (default: 3)")
    p.add_argument(
        "--chunked-from",
        type=int,
        default=65536,
        help="score S >= this in row chunks, never the full S x S matrix (default: 65536)",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 30,
        help="working-set budget of one chunk in bytes: its scores and the top-k scratch "
        "(default: 1 GiB)",
    )
    p.add_argument(
        "--rope-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="preprocess with rope_fp32 (default: on; --no-rope-fp32 for Megatron's BF16 path)",
    )
    p.add_argument(
        "--hadamard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the Hadamard rotation (dsa_indexer_rotate_activation; default: on)",
    )
    p.add_argument(
        "--torch-reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the torch reference preprocessing (default: on)",
    )
    p.add_argument(
        "--ceilings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the BF16 / FP8 matmul and copy-bandwidth ceilings (default: on)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON document instead of the tables"
    )
    p.set_defaults(func=run)


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
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
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


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------
# the workload


def _freqs(seq: int) -> torch.Tensor:
    inv = 10000.0 ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device="cuda") / ROPE_DIM)
    pos = torch.arange(seq, dtype=torch.float32, device="cuda")
    return torch.cat([torch.outer(pos, inv)] * 2, -1).view(seq, 1, 1, ROPE_DIM)


def _inputs(seq: int, batch: int, heads: int, gen: torch.Generator):
    """Megatron-layout BF16 projections and head weights: random, non-zero."""

    def nonzero(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen) * scale
        return torch.where(x == 0, torch.full_like(x, 1e-3), x).to(torch.bfloat16)

    q = nonzero(seq, batch, heads, HEAD_DIM)
    k = nonzero(seq, batch, HEAD_DIM)
    w = nonzero(seq, batch, heads, scale=heads**-0.5 * HEAD_DIM**-0.5)
    return q, k, w, _freqs(seq)


def _preprocess(args: argparse.Namespace):
    from .preprocess import IndexerPreprocess

    pre = IndexerPreprocess(
        HEAD_DIM, ROPE_DIM, rope_fp32=args.rope_fp32, rotate_activation=args.hadamard
    )
    with torch.no_grad():
        pre.k_norm.weight.normal_(1.0, 0.1)
        pre.k_norm.bias.normal_(0.0, 0.1)
    return pre.to(device="cuda", dtype=torch.bfloat16)


def _check_environment(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise CliError("bench needs a CUDA GPU; none is visible to this process.")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise CliError(
            f"bench needs an SM90 GPU (cuDNN's FP8 indexer kernel); this is SM{major}{minor}."
        )
    bad = [h for h in args.heads if h not in (32, 64)]
    if bad:
        raise CliError(f"--heads {bad}: FP8 scoring packs 32 or 64 heads.")
    for name in ("batch", "topk", "reps", "chunk_bytes"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1.")
    if any(s < 1 for s in args.seq):
        raise CliError("--seq values must be >= 1.")
    from . import _cudnn

    _, reason = _cudnn._import_dsa()
    if reason:
        raise CliError(reason)
    from .prepare import _triton_reason

    reason = _triton_reason()
    if reason:
        raise CliError(f"the fused kernel cannot run: {reason}.")


def _verify(args: argparse.Namespace, pre, gen: torch.Generator) -> dict[str, Any]:
    """Before trusting a timing: the fused operands are the reference's bytes, and cuDNN's scores
    of them match the torch backend (small shape, every head count)."""
    from .prepare import prepare_indexer_operands
    from .scoring import _indexer_forward

    report: dict[str, Any] = {"seq": 512, "heads": {}}
    for heads in args.heads:
        q, k, w, freqs = _inputs(512, args.batch, heads, gen)
        kw = dict(scoring_precision="fp8", sm_scale=1.0)
        fused = prepare_indexer_operands(pre, q, k, w, freqs, impl="triton", **kw)
        ref = prepare_indexer_operands(pre, q, k, w, freqs, impl="torch", **kw)
        same = all(
            torch.equal(getattr(fused, n).view(torch.uint8), getattr(ref, n).view(torch.uint8))
            for n in ("q", "k")
        ) and all(
            torch.equal(getattr(fused, n).view(torch.int32), getattr(ref, n).view(torch.int32))
            for n in ("q_scale", "k_scale", "w")
        )
        if not same:
            raise CliError(
                f"fused operands differ from the torch reference (H={heads}); not timing."
            )
        scores = {
            backend: _indexer_forward(
                None, None, None, scoring_precision="fp8", backend=backend, operands=fused
            )
            for backend in ("cudnn", "torch")
        }
        fin = torch.isfinite(scores["torch"])
        if not torch.equal(fin, torch.isfinite(scores["cudnn"])):
            raise CliError(
                f"cuDNN FP8 scores have another -inf pattern than the torch backend (H={heads})."
            )
        a, b = scores["cudnn"][fin].double(), scores["torch"][fin].double()
        rel = float((a - b).abs().max() / b.abs().max())
        if rel > 1e-3:
            raise CliError(f"cuDNN FP8 scores are off by {rel:.2e} (relative) at H={heads}.")
        report["heads"][heads] = {"operands_bit_identical": True, "fp8_score_rel_err": rel}
    return report


def _ceilings(timer: _Timer) -> dict[str, float]:
    n = _CEILING_N
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = timer(lambda: a @ b)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
    one = torch.ones((), device="cuda")
    fp8 = timer(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = timer(lambda: dst.copy_(src))
    flops = 2.0 * n**3
    return {
        "bf16_matmul_tflops": _tflops(flops, bf16),
        "fp8_scaled_mm_tflops": _tflops(flops, fp8),
        "copy_tb_per_s": 2 * src.numel() / (copy * 1e-3) / 1e12,  # read + write
    }


def _prep_bytes(seq: int, batch: int, heads: int) -> int:
    """Bytes the fused path must move at least: BF16 q, k, w read once; E4M3 q, k, their float32
    descales and the float32 folded weights written once."""
    tokens = seq * batch
    read = tokens * (heads * HEAD_DIM * 2 + HEAD_DIM * 2 + heads * 2)
    write = tokens * (heads * HEAD_DIM + HEAD_DIM + heads * 4 + 4 + heads * 4)
    return read + write


def _measure(args, pre, timer: _Timer, seq: int, heads: int, gen) -> dict[str, Any]:
    from .prepare import prepare_indexer_operands
    from .scoring import _indexer_forward
    from .topk import indexer_select, indexer_topk

    q, k, w, freqs = _inputs(seq, args.batch, heads, gen)
    chunked = seq >= args.chunked_from
    chunk = dict(chunk_bytes=args.chunk_bytes)

    def prep(impl: str, precision: str = "fp8"):
        return prepare_indexer_operands(pre, q, k, w, freqs, scoring_precision=precision, impl=impl)

    def score(ops, precision: str):
        if chunked:  # stream the chunks and drop them: never the full S x S matrix
            return _indexer_forward(
                None,
                None,
                None,
                scoring_precision=precision,
                backend="cudnn",
                operands=ops,
                on_chunk=lambda row, scores: None,
                **chunk,
            )
        return _indexer_forward(
            None, None, None, scoring_precision=precision, backend="cudnn", operands=ops, **chunk
        )

    def select(ops, precision: str):
        return indexer_select(
            None,
            None,
            None,
            args.topk,
            scoring_precision=precision,
            backend="cudnn",
            operands=ops,
            **chunk,
        )

    times: dict[str, float | None] = {}
    memory: dict[str, float | None] = {}
    times["prep_fused"] = timer(lambda: prep("triton"))
    memory["prep_fused"] = _peak_extra_mib(lambda: prep("triton"))
    times["prep_torch"] = timer(lambda: prep("torch")) if args.torch_reference else None
    times["prep_bf16"] = timer(lambda: prep("torch", "bf16"))
    ops8, ops16 = prep("triton"), prep("torch", "bf16")
    times["score_bf16"] = timer(lambda: score(ops16, "bf16"))
    times["score_fp8"] = timer(lambda: score(ops8, "fp8"))
    if chunked:
        times["topk"] = None  # derived below from the end-to-end time
    else:
        scores = score(ops8, "fp8")
        times["topk"] = timer(lambda: indexer_topk(scores, args.topk, backend="cudnn"))
        del scores
    times["e2e_bf16"] = timer(lambda: select(prep("torch", "bf16"), "bf16"))
    times["e2e_fp8"] = timer(lambda: select(prep("triton"), "fp8"))
    memory["select_bf16"] = _peak_extra_mib(lambda: select(ops16, "bf16"))
    memory["select_fp8"] = _peak_extra_mib(lambda: select(ops8, "fp8"))
    memory["e2e_bf16"] = _peak_extra_mib(lambda: select(prep("torch", "bf16"), "bf16"))
    memory["e2e_fp8"] = _peak_extra_mib(lambda: select(prep("triton"), "fp8"))
    topk_derived = chunked
    if chunked:
        times["topk"] = times["e2e_fp8"] - times["prep_fused"] - times["score_fp8"]

    flops = 2.0 * args.batch * heads * HEAD_DIM * seq * (seq + 1) / 2
    prep_bytes = _prep_bytes(seq, args.batch, heads)
    return {
        "seq": seq,
        "heads": heads,
        "batch": args.batch,
        "chunked": chunked,
        "topk_derived": topk_derived,
        "times_ms": times,
        "tflops": {
            name: _tflops(flops, times[name])
            for name in ("score_bf16", "score_fp8", "e2e_bf16", "e2e_fp8")
        },
        "fp8_speedup": {
            "score": times["score_bf16"] / times["score_fp8"],
            "e2e": times["e2e_bf16"] / times["e2e_fp8"],
        },
        "prep_share_of_fp8_score": times["prep_fused"] / times["score_fp8"],
        "prep_min_bytes": prep_bytes,
        "prep_fused_tb_per_s": prep_bytes / (times["prep_fused"] * 1e-3) / 1e12,
        "peak_extra_mib": memory,
    }


# --------------------------------------------------------------------------------------------
# output


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_tables(report: dict[str, Any]) -> str:
    """The human-readable tables of a :func:`run` report (times in ms, TFLOP/s, MiB)."""
    lines = []
    c = report.get("ceilings")
    if c:
        lines.append(
            f"ceilings: bf16 matmul {_fmt(c['bf16_matmul_tflops'], '.0f')} TFLOP/s, "
            f"fp8 _scaled_mm {_fmt(c['fp8_scaled_mm_tflops'], '.0f')} TFLOP/s, "
            f"copy {_fmt(c['copy_tb_per_s'], '.2f')} TB/s"
        )
    cfg = report["config"]
    lines.append(
        f"B={cfg['batch']} D={HEAD_DIM} causal, top-k {cfg['topk']}, rope_fp32={cfg['rope_fp32']}, "
        f"hadamard={cfg['hadamard']}; median of {cfg['reps']} reps (ms)"
    )
    head = (
        f"{'S':>6} {'H':>3} | {'prep':>7} {'prep':>7} {'TB/s':>5} {'%fp8':>5} | {'score':>7} "
        f"{'TF/s':>5} {'score':>7} {'TF/s':>5} {'x':>5} | {'top-k':>7} | {'e2e':>7} {'e2e':>7} "
        f"{'x':>5} | {'peak extra MiB':>34}"
    )
    sub = (
        f"{'':>6} {'':>3} | {'fused':>7} {'torch':>7} {'':>5} {'':>5} | {'bf16':>7} {'':>5} "
        f"{'fp8':>7} {'':>5} {'':>5} | {'fp8':>7} | {'bf16':>7} {'fp8':>7} {'':>5} | "
        f"{'prep':>6} {'sel16':>6} {'sel8':>6} {'e2e16':>6} {'e2e8':>6}"
    )
    lines += [head, sub, "-" * len(head)]
    for r in report["results"]:
        t, tf, m = r["times_ms"], r["tflops"], r["peak_extra_mib"]
        star = "*" if r["topk_derived"] else " "
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t['prep_fused']):>7} {_fmt(t['prep_torch']):>7} "
            f"{_fmt(r['prep_fused_tb_per_s'], '.2f'):>5} {100 * r['prep_share_of_fp8_score']:>4.1f}% | "
            f"{_fmt(t['score_bf16']):>7} {_fmt(tf['score_bf16'], '.0f'):>5} "
            f"{_fmt(t['score_fp8']):>7} {_fmt(tf['score_fp8'], '.0f'):>5} "
            f"{r['fp8_speedup']['score']:>5.2f} | {_fmt(t['topk']):>6}{star} | "
            f"{_fmt(t['e2e_bf16']):>7} {_fmt(t['e2e_fp8']):>7} {r['fp8_speedup']['e2e']:>5.2f} | "
            f"{_fmt(m['prep_fused'], '.0f'):>6} {_fmt(m['select_bf16'], '.0f'):>6} "
            f"{_fmt(m['select_fp8'], '.0f'):>6} {_fmt(m['e2e_bf16'], '.0f'):>6} "
            f"{_fmt(m['e2e_fp8'], '.0f'):>6}"
        )
    if any(r["topk_derived"] for r in report["results"]):
        lines.append("* chunked: top-k = e2e fp8 - prep fused - score fp8")
    lines.append("x = BF16 time / FP8 time; %fp8 = prep fused / score fp8")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    _check_environment(args)
    from importlib import metadata

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    pre = _preprocess(args)
    timer = _Timer(args.reps, args.warmup)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": metadata.version("triton")},
        "config": {
            "batch": args.batch,
            "topk": args.topk,
            "reps": args.reps,
            "warmup": args.warmup,
            "rope_fp32": args.rope_fp32,
            "hadamard": args.hadamard,
            "chunked_from": args.chunked_from,
            "chunk_bytes": args.chunk_bytes,
        },
        "flops": "2 * B * H * D * S * (S + 1) / 2 (causal multiply-adds of q . k)",
    }
    try:
        import cudnn

        report["versions"]["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    except ImportError:
        pass
    report["check"] = _verify(args, pre, gen)
    if args.ceilings:
        report["ceilings"] = _ceilings(timer)
    configs = [(s, h) for s in args.seq for h in args.heads]
    report["results"] = [
        _measure(args, pre, timer, s, h, gen)
        for s, h in progress(configs, total=len(configs), desc="bench")
    ]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_tables(report))
    return 0
