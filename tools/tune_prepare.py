"""Time the fused preprocess+quantize kernel's launch shapes on the GPU (bit-checked first).

    python tools/tune_prepare.py [--seq 16384] [--heads 64]

For each (vectors per program, warps) and each preprocessing variant it verifies the FP8 operands
against the torch reference, then prints the median time of q+k next to FP8 scoring.
"""

import argparse
import functools
import itertools
import json
import types

import torch

from dsa_precision import bench
from dsa_precision.kernels import preprocess_quantize as kernel
from dsa_precision.prepare import prepare_indexer_operands
from dsa_precision.scoring import _indexer_forward


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="write the timings and the best shape (JSON)")
    a = p.parse_args()
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, w, freqs = bench._inputs(a.seq, 1, a.heads, gen)
    timer = bench._Timer(a.reps, 2)
    shapes = [(16, 2), (16, 4), (8, 1), (8, 2), (32, 4), (32, 8), (4, 1)]
    print(f"S={a.seq} H={a.heads}: fused q+k preprocess+quantize (ms)")
    score_ms = None
    for rope_fp32, hadamard in itertools.product((True, False), (True, False)):
        args = types.SimpleNamespace(rope_fp32=rope_fp32, hadamard=hadamard)
        pre = bench._preprocess(args)
        prep = functools.partial(
            prepare_indexer_operands, pre, q, k, w, freqs, scoring_precision="fp8"
        )
        ref = prep(impl="torch")
        t_ref = timer(functools.partial(prep, impl="torch"))
        if score_ms is None:
            score_ms = timer(
                functools.partial(
                    _indexer_forward,
                    None,
                    None,
                    None,
                    scoring_precision="fp8",
                    backend="cudnn",
                    operands=ref,
                )
            )
            print(f"cuDNN FP8 scoring: {score_ms:.3f} ms")
        row = [f"rope_fp32={rope_fp32!s:5} hadamard={hadamard!s:5} torch {t_ref:7.3f}"]
        for block, warps in shapes:
            kernel.BLOCK_ROWS, kernel.NUM_WARPS = block, warps
            got = prep(impl="triton")
            same = all(
                torch.equal(getattr(got, n).view(torch.uint8), getattr(ref, n).view(torch.uint8))
                for n in ("q", "k", "q_scale", "k_scale", "w")
            )
            t = timer(functools.partial(prep, impl="triton"))
            row.append(f"{block}x{warps}: {t:6.3f}{'' if same else ' DIFF'}")
            results.append(
                dict(
                    rope_fp32=rope_fp32,
                    hadamard=hadamard,
                    block=block,
                    warps=warps,
                    ms=t,
                    bit_identical=same,
                    torch_ms=t_ref,
                    score_fp8_ms=score_ms,
                )
            )
        print(" | ".join(row), flush=True)
    # Best shape: the smallest total time over the variants, among shapes bit-identical on all.
    ok = {(r["block"], r["warps"]) for r in results} - {
        (r["block"], r["warps"]) for r in results if not r["bit_identical"]
    }
    best = min(ok, key=lambda bw: sum(r["ms"] for r in results if (r["block"], r["warps"]) == bw))
    print(f"best launch shape: {best[0]} vectors x {best[1]} warps")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"best": list(best), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
