"""Where the host time of the owned FP8 top-k goes, call by call, on a CUDA device.

For the toy GLM-5-like model of ``examples/toy_glm5_train.py`` (its layer 1, on the inputs of a
training step) this times the host side of every piece of the indexer's path: the time from
the call until it returns, with the device idle before it (kernels run asynchronously, so this
is the Python, the checks and the launches, what a small step waits for). Beside each package
call it times the raw kernel calls it wraps and Megatron's own BF16 indexer, then prints a
``cProfile`` of the owned top-k sorted by own time.

    python tools/host_profile.py                       # S 2048, top-256 (the toy's default)
    python tools/host_profile.py --seq 8192 --topk 2048 --heads 64
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time

import torch
import toy_session

# Device work queued before each "busy" call: about 20 ms of torch.cuda._sleep on an H200.
_BUSY_CYCLES = 40_000_000


def host_us(fn, reps: int, busy: bool = False) -> float:
    """Median host microseconds of ``fn()``, the device idle before each call, or with
    ``busy`` behind ~20 ms of queued device work: a call that waits for the device (a
    synchronisation the sync-debug mode does not see, inside a third-party library) takes that
    long there, where a call that only launches takes its idle time."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(_BUSY_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile-calls", type=int, default=20)
    p.add_argument("--split-steps", type=int, default=10)
    args = p.parse_args()

    import torch.distributed as dist

    toy = toy_session.start(29533)
    ns = toy_session.toy_args(args.seq, args.topk)

    import dsa_precision as dp
    from dsa_precision.backends import cudnn
    from dsa_precision.rows import causal_key_counts

    rows = []
    steps = []
    splits_by_function = {}
    cores = {}
    inputs = {}
    for name in ("baseline", "rope_fp32+fp8", "rope_fp32+fp8+graph"):
        config = toy.model_config(ns, dsa_indexer_n_heads=args.heads, **toy.CONFIGS[name])
        model, vocab = toy.build_model(ns, config)
        tokens, _ = toy.copy_task(ns, vocab, 1)[0]
        core = model.decoder.layers[0].self_attention.core_attention
        captured = {}

        def hook(_m, a, kw, captured=captured):
            captured.update({n: toy.call_arg(a, kw, n) for n in ("query", "x", "qr")})

        handle = core.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
            model(tokens, pos, None)
        handle.remove()
        cores[name], inputs[name] = (core, model), captured
        trainer, labels = toy.Trainer(model, ns.lr), toy.copy_task(ns, vocab, 1)[0][1]
        splits = [toy_session.step_phases(trainer, tokens, labels) for _ in range(12)][2:]
        steps.append((name, {k: statistics.median(s[k] for s in splits) for k in splits[0]}))
        if name != "baseline":
            by_function: dict[str, float] = {}
            total = toy.package_host_ms(trainer, (tokens, labels), args.split_steps,
                                        len(model.decoder.layers), by_function)  # fmt: skip
            splits_by_function[name] = (total, by_function)

    stock, _ = cores["baseline"]
    b16 = inputs["baseline"]
    rows.append(
        ("megatron bf16 indexer (x, qr -> top-k)", lambda: stock.indexer(b16["x"], b16["qr"]))
    )
    graphed, _ = cores["rope_fp32+fp8+graph"]
    g = inputs["rope_fp32+fp8+graph"]
    rows.append(
        (
            "compute_topk from its CUDA graph (all of it)",
            lambda: graphed.compute_topk(g["query"], g["x"], g["qr"], None),
        )
    )
    core, _ = cores["rope_fp32+fp8"]
    c = inputs["rope_fp32+fp8"]
    x, qr, query = c["x"], c["qr"], c["query"]
    topk = core.index_topk
    with torch.no_grad():
        layout = core.rank_layout(query, x, None)
        rows.append(
            (
                "compute_topk (owned, all of it)",
                lambda: core.compute_topk(query, x, qr, None),
            )
        )
        rows.append(("  rank_layout", lambda: core.rank_layout(query, x, None)))
        rows.append(
            (
                "  indexer.projections",
                lambda: core.indexer.projections(x, qr, None, True),
            )
        )
        rows.append(
            (
                "  indexer.scoring_operands",
                lambda: core.indexer.scoring_operands(x, qr, None),
            )
        )
        ops = core.indexer.scoring_operands(x, qr, None)
        from dsa_precision.megatron.layout import owned_topk

        rows.append(("  owned_topk", lambda: owned_topk(ops, layout, topk)))
        rows.append(("    indexer_select", lambda: dp.indexer_select(ops, topk=topk)))
        s = ops.q.shape[1]
        offsets = torch.zeros(1, dtype=torch.int32, device="cuda")
        buf = torch.empty(s * s, dtype=torch.float32, device="cuda").view(1, s, s)
        rows.append(
            (
                "      indexer_scores(out=)",
                lambda: dp.indexer_scores(ops, out=buf),
            )
        )
        lens = causal_key_counts(offsets, 0, s, 1, s).view(-1)
        rows.append(
            (
                "      causal_key_counts",
                lambda: causal_key_counts(offsets, 0, s, 1, s),
            )
        )
        scores = buf.view(s, s)
        rows.append(
            (
                "      indexer_topk(seq_lens=)",
                lambda: dp.indexer_topk(scores, topk, seq_lens=lens),
            )
        )
        dsa = cudnn.dsa()

        def raw_scores():
            return dsa.indexer_forward_wrapper(
                ops.q, ops.k.unsqueeze(2), ops.weights, ratio=1, sm_scale=1.0, out=buf,
                q_causal_offsets=offsets, precision="fp8", q_scale=ops.q_descale,
                k_scale=ops.k_descale.unsqueeze(-1),
            )  # fmt: skip

        rows.append(("raw cudnn indexer_forward_wrapper(out=)", raw_scores))
        rows.append(
            (
                "raw cudnn indexer_top_k_wrapper(+val)",
                lambda: dsa.indexer_top_k_wrapper(
                    scores, lens, top_k=topk, return_val=True, deterministic=True
                ),
            )
        )
        rows.append(
            (
                "raw cudnn indexer_top_k_wrapper(no val)",
                lambda: dsa.indexer_top_k_wrapper(
                    scores, lens, top_k=topk, return_val=False, deterministic=True
                ),
            )
        )
        small = torch.empty(16, device="cuda")
        rows.append(("torch: one small add_ (launch floor)", lambda: small.add_(1)))
        rows.append(("torch: torch.empty(16)", lambda: torch.empty(16, device="cuda")))

    print(f"host microseconds per call (median of {args.reps}), the device idle before each "
          f"call, and busy (~20 ms of work queued), S={args.seq} H={args.heads} "
          f"top-{args.topk}, layer 1 of the toy model")  # fmt: skip
    print(f"  {'':<48}{'idle':>10}{'busy':>10}")
    for label, fn in rows:
        with torch.no_grad():
            idle, busy = host_us(fn, args.reps), host_us(fn, args.reps, busy=True)
        print(f"  {label:<48}{idle:>10.1f}{busy:>10.1f}")
    print("training step split (ms, median of 10 after 2): host = until the call returns, "
          "gpu = events")  # fmt: skip
    for name, split in steps:
        print(f"  {name:<16}" + "  ".join(f"{k} {v:7.2f}" for k, v in split.items()))
    from host_time import package_host_seconds  # examples/, on the path through toy_session

    for name, (total, by_function) in splits_by_function.items():
        layer, a = cores[name][0], inputs[name]
        call = functools.partial(layer.compute_topk, a["query"], a["x"], a["qr"], None)
        idle: dict[str, float] = {}
        idle_total = 0.0
        with torch.no_grad():
            for _ in range(args.split_steps):
                torch.cuda.synchronize()
                idle_total += package_host_seconds(call, by_function=idle)[1]
        torch.cuda.synchronize()
        scale = 1e3 / args.split_steps
        print(f"package host ms per layer forward, {name}: {total:.3f} in training forwards "
              f"(all of the layer), {idle_total * scale:.3f} in compute_topk calls on an idle "
              "device; own ms per function")  # fmt: skip
        for fn_name, ms in sorted(by_function.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {ms:8.4f}{idle.get(fn_name, 0.0) * scale:8.4f}  {fn_name}")
    sys.stdout.flush()

    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(args.profile_calls):
            core.compute_topk(query, x, qr, None)
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(45)
    print(f"cProfile of {args.profile_calls} compute_topk calls, by own time")
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(60)
    print(out.getvalue())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
