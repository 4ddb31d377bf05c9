"""Where the toy model's training step spends its time, phase by phase, on a CUDA device.

For the toy GLM-5-like model of ``examples/toy_glm5_train.py`` this trains the baseline,
``rope_fp32+fp8`` and ``rope_fp32+fp8+graph`` interleaved (step i of each in turn) and prints,
per configuration, the median host time of the forward, the backward and the optimizer (until
each call returns) beside their GPU spans (CUDA events), with Python's garbage collector on and
off; then a ``torch.profiler`` summary of three steps each: the operations with the most host
time and the CUDA runtime calls (launches, synchronisations, copies, graph launches). With
``--gaps`` it adds ``replay`` (rope_fp32+fp8's picks handed in: no indexer) and, from a profile
with Python stacks, where the device waits for the host: every interval in which no kernel,
copy or memset runs, charged to the innermost non-torch Python function (or, on the autograd
thread, the autograd node) that launched the work ending it (profiling slows the host: the
split, not the sums, is the information).

    python tools/step_phases.py                 # S 2048, top-256 (the toy's default)
    python tools/step_phases.py --seq 8192 --topk 2048
    python tools/step_phases.py --gaps --steps 5
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import json
import os
import statistics
import sys
import tempfile

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
    p.add_argument("--gaps", action="store_true", help="add replay; split the device's idle time")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tools/step_phases.py needs a CUDA device", file=sys.stderr)
        return 2
    import torch.distributed as dist

    toy = toy_session.start(29534)
    ns = toy_session.toy_args(args.seq, args.topk)
    configs = CONFIGS + (("replay",) if args.gaps else ())
    trainers, engines = {}, {}
    for name in configs:
        model, vocab = toy.build_model(ns, toy.model_config(ns, **toy.CONFIGS[name]))
        trainers[name] = toy.Trainer(model, ns.lr)
        if name in toy.REPLAYED:  # its picks come from a model of rope_fp32+fp8's fields
            engines[name] = toy.build_model(ns, toy.model_config(ns, **toy.ENGINE))[0]
    batch = toy.copy_task(ns, vocab, 1)[0]

    def picks(name: str):
        """The replaying configuration's picks on its current weights (a no-op for others)."""
        return toy.handed_in(engines.get(name), trainers[name].model, batch[0])

    for _ in range(args.warmup):
        for name, trainer in trainers.items():
            with picks(name):
                trainer.step(*batch)
    print(f"S={args.seq} top-{args.topk}: median ms of {args.steps} interleaved steps "
          f"(host: until the call returns; gpu: CUDA events)")  # fmt: skip
    for collect in (True, False):
        times = {name: [] for name in configs}
        if not collect:
            gc.collect()
            gc.disable()
        try:
            for _ in range(args.steps):
                for name, trainer in trainers.items():
                    with picks(name):
                        times[name].append(toy_session.step_phases(trainer, *batch))
        finally:
            gc.enable()
        print(f"garbage collector {'on' if collect else 'off'}")
        for name in configs:
            med = {k: statistics.median(r[k] for r in times[name]) for k in times[name][0]}
            print(f"  {name:<22}" + "  ".join(f"{k} {v:6.2f}" for k, v in med.items()))
    sys.stdout.flush()

    from torch.profiler import ProfilerActivity, profile

    if args.gaps:
        for name, trainer in trainers.items():
            with picks(name):
                print_gaps(name, trainer, batch)
        sys.stdout.flush()
    for name, trainer in trainers.items():
        with picks(name):
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


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def print_gaps(name: str, trainer, batch, steps: int = 3, top: int = 14) -> None:
    """Profile ``steps`` steps with Python stacks; print the device's idle ms per step, charged
    to who launched the work that ended each idle interval (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as p:
        for _ in range(steps):
            trainer.step(*batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    # Host frames per thread, by start time: Python functions and operators (autograd nodes).
    frames = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("python_function", "cpu_op"):
            frames[e["tid"]].append(e)
    for stack in frames.values():
        stack.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in stack] for tid, stack in frames.items()}

    def culprit(launch) -> str:
        """The innermost frame around ``launch`` that is not torch's own (or an autograd node)."""
        tid, ts = launch["tid"], launch["ts"]
        stack = frames.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        around = [e for e in stack[max(0, i - 400) : i] if e["ts"] + e["dur"] >= ts]
        for e in sorted(around, key=lambda e: -e["ts"]):  # innermost first
            label = e["name"]
            if e["cat"] == "cpu_op" and label.startswith("autograd::engine::evaluate_function"):
                return label.split(": ", 1)[-1] + " (autograd)"
            if e["cat"] == "python_function" and "torch/" not in label and "<built-in" not in label:
                return label
        return "(no frame)"

    idle: collections.Counter[str] = collections.Counter()
    busy_end = device[0]["ts"] + device[0]["dur"]
    total_idle = 0.0
    for e in device[1:]:
        gap = e["ts"] - busy_end
        if gap > 0:
            launch = launches.get(e.get("args", {}).get("correlation"))
            who = culprit(launch) if launch is not None else "(no launch)"
            idle[who] += gap
            total_idle += gap
        busy_end = max(busy_end, e["ts"] + e["dur"])
    busy = sum(e["dur"] for e in device)
    print(f"{name}: device idle {total_idle / 1e3 / steps:.2f} ms per step (busy "
          f"{busy / 1e3 / steps:.2f}; profiled with stacks), by who launched the work after "
          f"it:")  # fmt: skip
    for who, us in idle.most_common(top):
        print(f"  {us / 1e3 / steps:7.3f}  {who[:110]}")


if __name__ == "__main__":
    raise SystemExit(main())
