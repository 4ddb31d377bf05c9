"""Top-k replay and verification on the toy GLM-5-like model (examples/toy_glm5_train.py).

Stands in for an RL step: before each training step an "engine" forward of the current weights
captures every layer's top-k (``dsa_precision.megatron.record_topk``: the picks of a
``rope_fp32+fp8`` forward, or of the baseline's for comparison), and the training step runs with
those indices handed in (``engine_topk``). It reports, side by side:

- ``verify`` (rope_fp32+fp8 training) against the rope_fp32+fp8 engine: the per-layer metrics of
  ``topk_metrics`` (expected: 100 % agreement), and against the baseline's picks (less);
- ``replay`` against ``compute``: the step time saved by not scoring (the indexer is skipped);
- the host-to-device cost of the indices (layers x tokens x top-k x 4 bytes), pinned memory.

The step hands the indices in with ``engine_topk``'s default: host checks only, no host
synchronisation; ``DSA_PRECISION_VALIDATE=1`` also checks their data in every layer (a debug run).

GPU:  python examples/replay_verify.py --out replay.json        (S=8192, top-k 2048)
CPU:  python examples/replay_verify.py --tiny --device cpu --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest.mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flag_checks as fc
import toy_glm5_train as toy


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # Refused with one line (exit status 2) before anything is built.
    fc.check_counts(p, args, dict(steps=1, seq=1, topk=1, batch=1))
    fc.check_lr(p, args.lr)
    fc.check_engine(p, args.engine)
    args.device = fc.check_device(p, args.device)
    fc.check_output(p, "out", args.out)
    return args


ENGINE = toy.ENGINE  # the rope_fp32+fp8 fields
BASELINE = dict(dsa_indexer_rope_fp32=False, dsa_indexer_scoring_precision="bf16")


def run(args, source: str, engine_fields: dict | None) -> dict:
    import dsa_precision.megatron as dsap

    config = toy.model_config(args, **ENGINE, dsa_indexer_topk_source=source)
    model, vocab = toy.build_model(args, config)
    engine_config = toy.model_config(args, **(engine_fields or ENGINE))
    engine_model, _ = toy.build_model(args, engine_config)
    trainer = toy.Trainer(model, args.lr)
    data = toy.copy_task(args, vocab, args.steps)
    times, metrics, losses = [], [], []
    for tokens, labels in data:
        picks = toy.engine_picks(engine_model, model, tokens)
        with dsap.engine_topk(picks, seq_len=tokens.shape[1]):
            loss, ms = toy.timed(lambda t=tokens, y=labels: trainer.step(t, y), args.device)
        losses.append(loss)
        times.append(ms)
        metrics.append(dsap.topk_metrics(model))
    steady = times[3:] or times
    return dict(
        source=source,
        step_ms_median=sorted(steady)[len(steady) // 2],
        first_loss=losses[0],
        last_loss=losses[-1],
        metrics=metrics,
    )


def h2d_ms(args, layers: int) -> dict:
    """Copy one micro-batch of indices (layers x tokens x top-k int32) from pinned host memory."""
    if args.device == "cpu":
        return {}
    host = torch.randint(0, 1 << 20, (layers, args.seq * args.batch, args.topk), dtype=torch.int32)
    host = host.pin_memory()
    ms = [toy.timed(lambda: host.to("cuda", non_blocking=True), "cuda")[1] for _ in range(6)][1:]
    nbytes = host.numel() * 4
    return dict(bytes=nbytes, ms=sorted(ms)[2], gb_per_s=nbytes / (sorted(ms)[2] * 1e-3) / 1e9,
                bytes_per_token=nbytes // (args.seq * args.batch))  # fmt: skip


def main() -> int:
    args = parse()
    if args.device != "cpu":
        return _run(args)
    # Megatron's RotaryEmbedding places its buffers on torch.cuda.current_device(): on the CPU,
    # for this run only.
    with unittest.mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.tiny:
        args.seq, args.topk = min(args.seq, 256), min(args.topk, 32)
    args.configs, args.share_steps = "", 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    t0 = time.time()
    results = {
        "compute": run(args, "compute", None),
        "verify_vs_rope_fp32_fp8": run(args, "verify", ENGINE),
        "verify_vs_baseline": run(args, "verify", BASELINE),
        "replay": run(args, "replay", ENGINE),
    }
    results["h2d"] = h2d_ms(args, layers=2)
    print(f"S={args.seq} top-k={args.topk} {args.device}, {args.steps} steps each "
          f"({time.time() - t0:.0f} s)")  # fmt: skip
    print(f"{'run':<26}{'ms/step':>9}{'loss[0]':>9}{'loss[-1]':>10}{'member agr.':>13}"
          f"{'rows ident.':>12}{'margin':>10}{'margin flip':>12}")  # fmt: skip
    for name, r in results.items():
        if name == "h2d":
            continue
        last = r["metrics"][-1] if r["metrics"] and r["metrics"][-1] else {}
        agr = [m["dsa_topk/all/member_agreement"] for m in r["metrics"] if m]
        rows = [m["dsa_topk/all/rows_identical"] for m in r["metrics"] if m]
        print(f"{name:<26}{r['step_ms_median']:>9.1f}{r['first_loss']:>9.3f}{r['last_loss']:>10.3f}"
              f"{(min(agr) if agr else float('nan')):>13.4%}{(min(rows) if rows else float('nan')):>12.2%}"
              f"{last.get('dsa_topk/all/margin_mean', float('nan')):>10.3g}"
              f"{last.get('dsa_topk/all/margin_mean_flipped', float('nan')):>12.3g}")  # fmt: skip
    if results["h2d"]:
        h = results["h2d"]
        print(f"indices host->device: {h['bytes'] / 2**20:.0f} MiB ({h['bytes_per_token']} B/token) "
              f"in {h['ms']:.2f} ms = {h['gb_per_s']:.1f} GB/s")  # fmt: skip
    saved = results["compute"]["step_ms_median"] - results["replay"]["step_ms_median"]
    print(f"replay saves {saved:.1f} ms/step against compute")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    ok = all(m["dsa_topk/all/member_agreement"] == 1.0
             for m in results["verify_vs_rope_fp32_fp8"]["metrics"] if m)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
