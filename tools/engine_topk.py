"""vLLM's own top-k kernels against the exact top-k, and the tie replay that closes the gap.

    DSA_VLLM_OPS=.../_C_stable_libtorch.abi3.so PYTHONPATH=$PWD:$VDG \\
        python tools/engine_topk.py [--seq 2048 8192 ...] [--heads 32 64] [--out DIR]

For each sequence length and head count: the package's FP8 operands of the demo's structured
synthetic projections (``rope_fp32+fp8``, profile ``vllm``), scored by DeepGEMM (``indexer_scores
(backend="deepgemm")``: the kernel vLLM scores with) on sampled query rows (every row past the
first top-k up to ``--all-rows``, else ``--blocks`` blocks of ``--block`` consecutive rows spread
over the sequence), then each of vLLM's four top-k kernels on those logits, and (``--engines``;
not yet run on a GPU) SGLang 0.5.23's (``sglang-decode`` / ``sglang-prefill``: its JIT top-k v2
from ``DSA_ENGINE_KERNELS``; ``sglang-prefill-paged``: sgl-kernel's compiled op,
``DSA_SGL_KERNEL_OPS``, under torch 2.14 only) and LMDeploy 0.18.0's (``lmdeploy-tilelang``,
``lmdeploy-bitonic``: :mod:`conformance.lmdeploy_topk`); a kernel that cannot run here
is listed with the reason. Per kernel:

- rows that differ from the exact top-k (ties to the lower key), split by
  :func:`dsa_precision.ties.classify_rows` into tie (the kernel's set is a valid top-k of the
  logits), wrong (a valid key set that is no top-k) and invalid (out of range, past the row,
  repeated);
- stability: the rows whose set changes over ``--runs`` runs (and the most distinct sets of one
  row), and between a batched call and calls of ``--split`` rows;
- the share of rows with a boundary tie (margin 0), ties at an exact-zero score apart;
- the tie replay: :func:`dsa_precision.capture.engine_tie_rows` on the kernel's picks, training's
  own exact picks with the sent rows replaced: rows identical to the kernel's, rows training
  finds tied that were not sent; the frame's bytes per row against full replay (int32 and
  delta);
- the engine-side cost: ``engine_tie_rows`` against the kernel itself (CUDA events, median).

Prints one table per section; ``--out`` writes the JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import statistics

import torch

from conformance import lmdeploy_topk, sglang_topk, vllm_topk
from dsa_precision import IndexerPrecisionConfig, indexer_scores, indexer_topk
from dsa_precision.capture import encode_picks, engine_tie_rows
from dsa_precision.cli.demo_operands import IndexerFields, training_operands
from dsa_precision.cli.synthetic import synthetic_indexer_inputs
from dsa_precision.ties import INVALID, PRECISION, TIE, classify_rows, selection_margins


def _rows(seq: int, topk: int, args: argparse.Namespace) -> list[tuple[int, int]]:
    """Blocks ``[start, stop)`` of query rows to score: every row past the first top-k when
    there are at most ``--all-rows`` of them, else ``--blocks`` blocks spread evenly."""
    if seq - topk <= args.all_rows:
        return [(r, min(r + args.block, seq)) for r in range(topk, seq, args.block)]
    span = seq - topk - args.block
    starts = [topk + span * i // max(args.blocks - 1, 1) for i in range(args.blocks)]
    return [(a, a + args.block) for a in starts]


def _kernels(engines: list[str]) -> dict[str, tuple]:
    """Table label -> (oracle module, its kernel): vLLM's four under their own names, SGLang's
    and LMDeploy's prefixed with the engine (not yet run on a GPU)."""
    out: dict[str, tuple] = {}
    if "vllm" in engines:
        out.update({name: (vllm_topk, name) for name in vllm_topk.KERNELS})
    if "sglang" in engines:
        out.update({f"sglang-{name}": (sglang_topk, name) for name in sglang_topk.KERNELS})
    if "lmdeploy" in engines:
        out.update({f"lmdeploy-{name}": (lmdeploy_topk, name) for name in lmdeploy_topk.KERNELS})
    return out


def _missing(engine, name: str) -> str | None:
    """Why the oracle ``engine``'s kernel ``name`` cannot run here (``None``: it can)."""
    return engine.missing_reason() if engine is vllm_topk else engine.missing_reason(name)


def _time(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls (CUDA events; NaN on the CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(repeat + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def run_case(seq: int, heads: int, args: argparse.Namespace) -> dict:
    topk = 256 if seq <= 2048 else args.topk
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine="vllm")
    device = args.device
    inputs = synthetic_indexer_inputs(seq, n_heads=heads, seed=args.seed).to(device)
    ops = training_operands(inputs, config, IndexerFields())
    logits, lengths = [], []
    for a, b in _rows(seq, topk, args):
        scores = indexer_scores(ops.rows(a, b), q_causal_offsets=a, backend=args.scores)[0]
        logits.append(scores)
        lengths.append(torch.arange(a + 1, b + 1, device=device, dtype=torch.int32))
    del ops, inputs
    s = torch.cat(logits).contiguous()
    lens = torch.cat(lengths)
    rows = s.shape[0]
    exact = indexer_topk(s, topk, seq_lens=lens)
    margin = selection_margins(s, exact, lens)
    kth = s.gather(-1, exact.clamp(min=0).long()).masked_fill(exact < 0, float("inf")).amin(-1)
    tied = margin == 0
    case = {
        "seq": seq, "heads": heads, "topk": topk, "rows": rows,
        "tied_rows": int(tied.sum()), "tied_at_zero": int((tied & (kth == 0)).sum()),
        "kernels": {},
    }  # fmt: skip
    for label, (engine, name) in _kernels(args.engines).items():
        cooperative = engine is vllm_topk and name == "cooperative"
        why = _missing(engine, name) or engine.applies(
            name, min(rows, args.split) if cooperative else rows, topk
        )
        if why is not None:
            case["kernels"][label] = {"skipped": why}
            continue

        def call(rows_: slice, engine=engine, name=name, cooperative=cooperative) -> torch.Tensor:
            if cooperative:  # vLLM runs it on up to 64 rows: calls of --split rows
                parts = [
                    engine.run(name, s[i : i + args.split], lens[i : i + args.split], topk)
                    for i in range(rows_.start or 0, rows_.stop or rows, args.split)
                ]
                return torch.cat(parts)
            return engine.run(name, s[rows_], lens[rows_], topk)

        every = slice(0, rows)
        picks = call(every)
        causes = classify_rows(exact, picks, s, lengths=lens).cause
        runs = [picks] + [call(every) for _ in range(args.runs - 1)]
        keys = [r.long().sort(-1).values for r in runs]
        changing = torch.zeros(rows, dtype=torch.bool, device=device)
        distinct = torch.ones(rows, dtype=torch.int64, device=device)
        for i in range(1, len(keys)):
            new = torch.ones(rows, dtype=torch.bool, device=device)
            for j in range(i):
                new &= (keys[i] != keys[j]).any(-1)
            changing |= (keys[i] != keys[0]).any(-1)
            distinct += new.long()
        split = torch.cat(
            [call(slice(i, min(i + args.split, rows))) for i in range(0, rows, args.split)]
        )
        composition = (split.long().sort(-1).values != keys[0]).any(-1)
        # The tie replay: the engine sends its tied rows, training keeps its own elsewhere.
        frame = engine_tie_rows(s, picks, lens)
        merged = exact.clone()
        merged[frame.rows] = frame.picks
        same = (merged.long().sort(-1).values == keys[0]).all(-1)
        sent = torch.zeros(rows, dtype=torch.bool, device=device)
        sent[frame.rows] = True
        try:  # a row that repeats a key (LMDeploy's bitonic_topk on ties) has no wire format
            tie_bytes: float = len(frame.to_bytes())
            delta_bytes: float = encode_picks(picks.cpu(), "delta").nbytes
        except ValueError as exc:
            print(f"engine_topk: {label}: no frame bytes: {exc}", file=sys.stderr)
            tie_bytes, delta_bytes = float("nan"), float("nan")
        t_kernel = _time(lambda every=every: call(every), args.repeat)
        t_ties = _time(lambda picks=picks: engine_tie_rows(s, picks, lens), args.repeat)
        differs = causes != 0
        case["kernels"][label] = {
            "differ": int(differs.sum()),
            "tie": int((causes == TIE).sum()),
            "wrong": int((causes == PRECISION).sum()),
            "invalid": int((causes == INVALID).sum()),
            "differ_untied": int((differs & ~tied).sum()),
            "changing_rows": int(changing.sum()),
            "changing_untied": int((changing & ~tied).sum()),
            "max_distinct_sets": int(distinct.max()),
            "composition_rows": int(composition.sum()),
            "sent": int(sent.sum()),
            "sent_not_tied": int((sent & ~tied).sum()),
            "tied_not_sent": int((tied & ~sent).sum()),
            "replay_identical": int(same.sum()),
            "bytes_per_row_ties": tie_bytes / rows,
            "bytes_per_row_int32": 4 * topk,
            "bytes_per_row_delta": delta_bytes / rows,
            "kernel_ms": t_kernel,
            "engine_tie_rows_ms": t_ties,
        }
    return case


def _table(cases: list[dict]) -> str:
    head = (
        "| S | H | k | rows | tied (at 0) | kernel | differ | tie | wrong | invalid | changing "
        "(untied) | sets | batch-dependent | sent | replay identical | ties B/row | x int32 | "
        "x delta | kernel ms | tie test ms |"
    )
    lines = [head, "|" + "---|" * 20]
    for c in cases:
        for name, k in c["kernels"].items():
            prefix = f"| {c['seq']} | {c['heads']} | {c['topk']} | {c['rows']} | "
            prefix += f"{c['tied_rows']} ({c['tied_at_zero']}) | {name} | "
            if "skipped" in k:
                lines.append(prefix + f"n/a: {k['skipped']} |" + " |" * 13)
                continue
            lines.append(
                prefix + f"{k['differ']} | {k['tie']} | {k['wrong']} | {k['invalid']} | "
                f"{k['changing_rows']} ({k['changing_untied']}) | {k['max_distinct_sets']} | "
                f"{k['composition_rows']} | {k['sent']} | "
                f"{100 * k['replay_identical'] / c['rows']:.2f} % | "
                f"{k['bytes_per_row_ties']:.1f} | "
                f"{k['bytes_per_row_ties'] / k['bytes_per_row_int32']:.4f} | "
                f"{k['bytes_per_row_ties'] / k['bytes_per_row_delta']:.4f} | "
                f"{k['kernel_ms']:.3f} | {k['engine_tie_rows_ms']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768, 65536, 131072])
    p.add_argument("--heads", type=int, nargs="+", default=[32, 64])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--all-rows", type=int, default=8192)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--split", type=int, default=16)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scores", default="deepgemm", help="the scoring backend (deepgemm: vLLM's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--engines", nargs="+", default=["vllm"], choices=["vllm", "sglang", "lmdeploy"],
        help="whose top-k kernels (default vLLM's: gpu_session.sh's engine-topk step); a kernel "
        "that cannot run here is listed with the reason",
    )  # fmt: skip
    args = p.parse_args(argv)
    kernels = _kernels(args.engines)
    reasons = {label: _missing(engine, name) for label, (engine, name) in kernels.items()}
    for label, why in reasons.items():
        if why is not None:
            print(f"engine_topk: {label}: {why}", file=sys.stderr)
    if all(why is not None for why in reasons.values()):
        return 2
    if "vllm" in args.engines and vllm_topk.missing_reason() is None:
        print("vLLM ops:", vllm_topk.load())
    if "sglang" in args.engines and reasons.get("sglang-decode") is None:
        print("SGLang top-k v2:", sglang_topk.build())
    if "lmdeploy" in args.engines:
        for name in lmdeploy_topk.KERNELS:
            if reasons[f"lmdeploy-{name}"] is None:
                print(f"LMDeploy {name}:", lmdeploy_topk.source(name))
    print("device:", torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    cases = []
    for seq in args.seq:
        for heads in args.heads:
            cases.append(run_case(seq, heads, args))
            print(json.dumps(cases[-1]), flush=True)
    print(_table(cases))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_topk.json").write_text(json.dumps(cases, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
