"""Where the toy model's training step spends its time, phase by phase, on a CUDA device.

For the toy GLM-5-like model of ``examples/toy_glm5_train.py`` this trains the baseline,
``rope_fp32+fp8`` and ``rope_fp32+fp8+graph`` interleaved (step i of each in turn) and prints,
per configuration, the median host time of the forward, the backward and the optimizer (until
each call returns) beside their GPU spans (CUDA events), with Python's garbage collector on and
off; then a ``torch.profiler`` summary of three steps each: the operations with the most host
time and the CUDA runtime calls (launches, synchronisations, copies, graph launches).

    python tools/step_phases.py                 # S 2048, top-256 (the toy's default)
    python tools/step_phases.py --seq 8192 --topk 2048
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch
import toy_session

CONFIGS = ("baseline", "rope_fp32+fp8", "rope_fp32+fp8+graph")
RUNTIME_CALLS = (
    "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
    "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
    "cudaEventSynchronize", "cudaMalloc", "cudaFree",
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tools/step_phases.py needs a CUDA device", file=sys.stderr)
        return 2
    import torch.distributed as dist

    toy = toy_session.start(29534)
    ns = toy_session.toy_args(args.seq, args.topk)
    trainers = {}
    for name in CONFIGS:
        model, vocab = toy.build_model(ns, toy.model_config(ns, **toy.CONFIGS[name]))
        trainers[name] = toy.Trainer(model, ns.lr)
    batch = toy.copy_task(ns, vocab, 1)[0]
    for _ in range(args.warmup):
        for trainer in trainers.values():
            trainer.step(*batch)
    print(f"S={args.seq} top-{args.topk}: median ms of {args.steps} interleaved steps "
          f"(host: until the call returns; gpu: CUDA events)")  # fmt: skip
    for collect in (True, False):
        times = {name: [] for name in CONFIGS}
        if not collect:
            gc.collect()
            gc.disable()
        try:
            for _ in range(args.steps):
                for name, trainer in trainers.items():
                    times[name].append(toy_session.step_phases(trainer, *batch))
        finally:
            gc.enable()
        print(f"garbage collector {'on' if collect else 'off'}")
        for name in CONFIGS:
            med = {k: statistics.median(r[k] for r in times[name]) for k in times[name][0]}
            print(f"  {name:<22}" + "  ".join(f"{k} {v:6.2f}" for k, v in med.items()))
    sys.stdout.flush()

    from torch.profiler import ProfilerActivity, profile

    for name, trainer in trainers.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                trainer.step(*batch)
        averages = prof.key_averages()
        print(f"{name}: host ms of 3 steps, the 20 operations with the most, and runtime calls")
        for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:20]:
            print(f"  {e.key[:60]:<60} {e.self_cpu_time_total / 1e3:8.2f} x{e.count}")
        for e in averages:
            if e.key in RUNTIME_CALLS:
                print(f"  [{e.key}] x{e.count}, {e.self_cpu_time_total / 1e3:.2f} ms")
        sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
