"""Time the fused preprocess+quantize kernel's launch shapes on the GPU (bit-checked first).

    python tools/tune_prepare.py [--seq 16384] [--heads 64] [--reps 10] [--out FILE.json]

For each (vectors per program, warps) and each preprocessing variant (FP32 or BF16 RoPE, Hadamard
on or off) it launches the q and k kernels, checks their bytes against the default launch shape,
then prints the median time of q+k. The default shape (``BLOCK_ROWS``, ``NUM_WARPS`` in
``dsa_precision/kernels/preprocess_quantize.py``) is the fastest shape this prints on the H200.
"""

import argparse
import functools
import itertools
import json

import torch

from dsa_precision.cli.bench import Timer, bench_inputs
from dsa_precision.engines import DEFAULT_ENGINE
from dsa_precision.kernels import preprocess_quantize as kernel
from dsa_precision.kernels.rules import PreprocessRules
from dsa_precision.rope import rope_tables

SHAPES = ((16, 2), (16, 4), (8, 1), (8, 2), (32, 4), (32, 8), (4, 1))


def _launch(q, k, cos, sin, rope_fp32, hadamard, block_rows, num_warps):
    rules = PreprocessRules(
        DEFAULT_ENGINE.q_quant, DEFAULT_ENGINE.k_quant, rope_dim=cos.shape[-1], hadamard=hadamard,
        bf16_math=not rope_fp32, q_out_bf16=not rope_fp32, k_out_bf16=not rope_fp32,
    )  # fmt: skip
    common = dict(cos=cos, sin=sin, block_rows=block_rows, num_warps=num_warps)
    q8, qs, _ = kernel.preprocess_quantize(q, rules, **common)
    # rope_fp32 keys take the LayerNorm in the kernel (unit weight, zero bias here).
    layer_norm = (None, None, 1e-6) if rope_fp32 else None
    k8, ks, _ = kernel.preprocess_quantize(k, rules, layer_norm=layer_norm, **common)
    return q8.view(torch.uint8), qs, k8.view(torch.uint8), ks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="write the timings and the best shape (JSON)")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, _, freqs = bench_inputs(a.seq, 1, a.heads, gen)
    timer = Timer(a.reps, 2)
    results = []
    print(f"S={a.seq} H={a.heads}: fused q+k preprocess+quantize (ms)")
    for rope_fp32, hadamard in itertools.product((True, False), (True, False)):
        dtype = torch.float32 if rope_fp32 else torch.bfloat16
        cos, sin = (t.reshape(a.seq, -1) for t in rope_tables(freqs, 1.0, dtype))
        args = (q, k, cos, sin, rope_fp32, hadamard)
        ref = _launch(*args, kernel.BLOCK_ROWS, kernel.NUM_WARPS)
        row = [f"rope_fp32={rope_fp32!s:5} hadamard={hadamard!s:5}"]
        for block, warps in SHAPES:
            same = all(map(torch.equal, _launch(*args, block, warps), ref))
            ms = timer(functools.partial(_launch, *args, block, warps))
            row.append(f"{block}x{warps}: {ms:6.3f}{'' if same else ' DIFF'}")
            results.append(
                dict(rope_fp32=rope_fp32, hadamard=hadamard, block=block, warps=warps, ms=ms,
                     bit_identical=same)
            )  # fmt: skip
        print(" | ".join(row), flush=True)
    # Best shape: the smallest total time over the variants, among shapes bit-identical on all.
    bad = {(r["block"], r["warps"]) for r in results if not r["bit_identical"]}
    ok = [shape for shape in SHAPES if shape not in bad]
    best = min(ok, key=lambda s: sum(r["ms"] for r in results if (r["block"], r["warps"]) == s))
    print(f"best launch shape: {best[0]} vectors x {best[1]} warps")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"best": list(best), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
