"""Where the package's top-k time goes beyond cuDNN's raw deterministic top-k (H200 probe).

    python tools/probe_topk_overhead.py [--seq 8192 16384] [--topk 2048] [--launch-shapes]

Times, on the same causal float32 scores: the raw kernel without and with ``return_val``, the
one-pass ``-inf``/NaN fix-up alone, and :func:`dsa_precision.indexer_topk`; with
``--launch-shapes`` also the fix-up at every block size and warp count beside ``torch.sum`` of the
same picks' scores (a single read of them: the pass's floor).
"""

import argparse

import torch

from dsa_precision import indexer_topk
from dsa_precision.backends import cudnn
from dsa_precision.cli.bench import Timer
from dsa_precision.kernels.topk_picks import drop_invalid_picks


def _row(s: int, topk: int, timer: Timer, shapes: bool = False) -> list[float]:
    dsa = cudnn.dsa()
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(s, s, device="cuda", generator=g)
    scores = scores.masked_fill(torch.ones(s, s, device="cuda").triu(1).bool(), float("-inf"))
    lens = torch.arange(1, s + 1, device="cuda", dtype=torch.int32)

    def raw(val: bool):
        return dsa.indexer_top_k_wrapper(
            scores, lens, top_k=topk, next_n=1, return_val=val, deterministic=True
        )

    out = raw(True)
    idx, vals = out["indices"], out["values"]
    if shapes:
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                if block // (32 * warps) < 4:
                    continue

                def fixup(block=block, warps=warps):
                    drop_invalid_picks(idx, vals, block=block, num_warps=warps)

                print(f"  S={s} fix-up BLOCK={block:>5} warps={warps:>2}: "
                      f"{timer(fixup) * 1e3:7.1f} us")  # fmt: skip
        print(f"  S={s} torch.sum of the picks' scores: {timer(vals.sum) * 1e3:7.1f} us")
    return [
        timer(lambda: raw(False)),
        timer(lambda: raw(True)),
        timer(lambda: drop_invalid_picks(idx, vals)),
        timer(lambda: indexer_topk(scores, topk, seq_lens=lens)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--launch-shapes", action="store_true", help="time the fix-up's launch shapes")
    a = p.parse_args()
    timer = Timer(a.reps, 3)
    print("S      raw(no val)  raw(val)  fix-up  indexer_topk  (ms)")
    for s in a.seq:
        t = _row(s, a.topk, timer, a.launch_shapes)
        print(f"{s:<6} " + "  ".join(f"{x:9.3f}" for x in t), flush=True)


if __name__ == "__main__":
    main()
