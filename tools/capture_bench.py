"""Bytes per token and host-to-device time of the compact pick formats against plain int32.

    PYTHONPATH=$PWD python tools/capture_bench.py [--seq 8192 65536] [--topk 2048] [--layers 1]

One micro-batch = one sequence of ``--seq`` tokens, ``--topk`` picks per token and layer,
synthetic causal picks (``--picks uniform``: random subsets of each row's visible keys;
``window``: sinks + the recent half + random in between, the usual indexer shape). On a CUDA device it also times, per format,
the copy of one layer's encoded picks to the device from pageable and from pinned memory, and
the decode on the device (CUDA events, median of ``--repeat``); on the CPU it prints bytes only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dsa_precision.capture import FORMATS, decode_picks, encode_picks


def synthetic_picks(
    seq: int, topk: int, profile: str = "uniform", seed: int = 0, rows_per_chunk: int = 4096
) -> torch.Tensor:
    """``(seq, topk)`` int32 causal picks, ``-1`` padding; row ``p < topk`` holds every key.

    ``uniform``: a random ``topk``-subset of ``[0, p]`` (sorted iid draws from
    ``[0, p - topk + 1)`` plus the slot: distinct, no structure). ``window``: the indexer's usual
    shape, 64 sink keys, the ``topk / 2`` most recent keys and the rest uniform in between (one
    wide gap per row, which sets the row's delta width).
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(seq, topk, dtype=torch.int32)
    slot = torch.arange(topk, dtype=torch.int64)
    for r0 in range(0, seq, rows_per_chunk):
        pos = torch.arange(r0, min(seq, r0 + rows_per_chunk), dtype=torch.int64)[:, None]
        visible = pos + 1
        u = torch.rand(pos.shape[0], topk, generator=g, dtype=torch.float64)
        if profile == "uniform":
            draws = (u * (visible - topk + 1).clamp(min=1)).floor().to(torch.int64)
            keys = draws.sort(-1).values + slot
        else:
            sinks, recent = 64, topk // 2
            middle = topk - sinks - recent
            span = (visible - sinks - recent).clamp(min=middle)
            draws = (u[:, :middle] * (span - middle + 1)).floor().to(torch.int64)
            mid = sinks + draws.sort(-1).values + torch.arange(middle)
            keys = torch.cat(
                (slot[:sinks].expand(pos.shape[0], -1), mid, pos - recent + 1 + slot[:recent]), 1
            )
        dense = torch.where(slot < visible, slot, -1)
        out[r0 : r0 + pos.shape[0]] = torch.where(visible > topk, keys, dense).to(torch.int32)
    return out


def _h2d_ms(picks, device, pinned: bool, repeat: int) -> float:
    src = picks.pin_memory() if pinned else picks
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        moved = src.to(device, non_blocking=pinned)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        del moved
    return statistics.median(times[1:])  # the first copy warms the allocator


def _decode_ms(picks_on_device, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = decode_picks(picks_on_device)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        del out
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--layers", type=int, default=1, help="indexer layers (bytes scale with it)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--picks", choices=["uniform", "window"], default="uniform")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if any(s < 1 for s in args.seq) or args.topk < 1 or args.layers < 1 or args.repeat < 1:
        p.error("--seq, --topk, --layers and --repeat must be positive")
    device = torch.device(args.device)
    timed = device.type == "cuda"
    if timed and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available")
    rows = []
    for seq in args.seq:
        picks = synthetic_picks(seq, args.topk, args.picks)
        reference = None
        for fmt in FORMATS:
            if fmt == "int16" and seq > 32768:
                rows.append(dict(seq=seq, format=fmt, note="keys > 32767: not applicable"))
                continue
            t0 = time.perf_counter()  # encode where it is fast (the device), store on the host
            enc = encode_picks(picks.to(device), fmt).to("cpu")
            encode_s = time.perf_counter() - t0
            row = dict(
                seq=seq,
                format=fmt,
                bytes_per_token=args.layers * enc.nbytes / seq,
                ratio_vs_int32=enc.nbytes / (picks.numel() * 4),
                encode_s=encode_s,
            )
            if timed:
                row["h2d_ms_pageable"] = _h2d_ms(enc, device, False, args.repeat) * args.layers
                row["h2d_ms_pinned"] = _h2d_ms(enc, device, True, args.repeat) * args.layers
                on_device = enc.to(device)
                row["decode_ms_device"] = _decode_ms(on_device, args.repeat) * args.layers
                decoded = decode_picks(on_device).cpu()
                if reference is None:
                    reference = torch.where(picks < 0, 2**40, picks.long()).sort(-1).values
                got = torch.where(decoded < 0, 2**40, decoded.long()).sort(-1).values
                row["exact"] = bool(torch.equal(got, reference))
                del on_device, decoded, got
            rows.append(row)
    if args.json:
        json.dump(
            dict(
                topk=args.topk, layers=args.layers, picks=args.picks, device=str(device), rows=rows
            ),
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    where = torch.cuda.get_device_name(device) if timed else "CPU: bytes only"
    print(
        f"top-k picks, k={args.topk}, {args.picks} picks, {args.layers} layer(s) per micro-batch "
        f"({where})"
    )
    head = f"{'seq':>7} {'format':>6} {'B/token':>10} {'x int32':>8} {'encode s':>9}"
    if timed:
        head += f" {'H2D pageable ms':>16} {'H2D pinned ms':>14} {'decode ms':>10} {'exact':>6}"
    print(head)
    for r in rows:
        if "note" in r:
            print(f"{r['seq']:>7} {r['format']:>6}  {r['note']}")
            continue
        line = (
            f"{r['seq']:>7} {r['format']:>6} {r['bytes_per_token']:>10.0f} "
            f"{r['ratio_vs_int32']:>8.3f} {r['encode_s']:>9.2f}"
        )
        if timed:
            line += (
                f" {r['h2d_ms_pageable']:>16.2f} {r['h2d_ms_pinned']:>14.2f} "
                f"{r['decode_ms_device']:>10.2f} {r['exact']!s:>6}"
            )
        print(line)
    print(
        "B/token: bytes per token per micro-batch (all layers); H2D and decode: per micro-batch "
        "(one layer's time x layers); exact: the decoded set equals the encoded one."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
