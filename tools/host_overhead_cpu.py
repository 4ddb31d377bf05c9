"""The package's own host microseconds per call on the FP8 select path, on the CPU, kernels stubbed.

Where ``tools/host_profile.py`` (CUDA) times what a step waits for, this isolates the part the
package controls on a machine without a GPU: the Python, the argument checks and the small torch
ops around each kernel, with every kernel launch replaced by a stub that returns at once (cuDNN's
two wrappers answer with preallocated buffers; the fused Triton kernel's launch does nothing). The
shapes are tiny, so a torch op costs about what its launch costs on a GPU. Numbers are only
comparable on one machine, before and after a change:

    python tools/host_overhead_cpu.py            # median microseconds of each piece
    python tools/host_overhead_cpu.py --profile  # plus a cProfile of indexer_select by own time
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the fused path's device check, before Triton imports

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import dsa_precision as dp  # noqa: E402
from dsa_precision import _cudnn  # noqa: E402
from dsa_precision.kernels import preprocess_quantize as pq  # noqa: E402
from dsa_precision.preprocess import IndexerPreprocess  # noqa: E402


class _NullDSA:
    """cuDNN's wrappers answering at once with buffers of the right shapes (no numerics)."""

    def __init__(self, rows: int, topk: int) -> None:
        self.indices = torch.zeros(rows, topk, dtype=torch.int32)
        self.values = torch.zeros(rows, topk)

    def indexer_forward_wrapper(self, q, k, w, ratio=4, sm_scale=1.0, out=None, **kw):
        return {"scores": out}

    def indexer_top_k_wrapper(self, values, seq_lens, top_k, next_n=1, return_val=True, **kw):
        return {"indices": self.indices[:, :top_k], "values": self.values[:, :top_k]}


class _NullLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    s, h, topk = args.seq, args.heads, args.topk
    gen = torch.Generator().manual_seed(0)
    config = dp.IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine="vllm")
    preprocess = IndexerPreprocess(128, 64, rope_fp32=True, engine=config.engine)
    q = torch.randn(s, 1, h, 128, generator=gen).bfloat16()
    k = torch.randn(s, 1, 128, generator=gen).bfloat16()
    w = torch.randn(s, 1, h, generator=gen)
    freqs = torch.rand(s, 1, 1, 64, generator=gen)
    ops = dp.prepare_scoring_operands(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), w.transpose(0, 1), config=config
    )
    rows = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        fake = _NullDSA(s, topk)
        mp.setattr(_cudnn, "_import_dsa", lambda: (fake, None))
        mp.setattr(_cudnn, "_device_reason", lambda device: None)
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        mp.setattr(pq, "_preprocess_quantize_kernel", _NullLaunch())

        def prepare():
            return dp.prepare_indexer_operands(preprocess, q, k, w, freqs, config=config)

        def select():
            return dp.indexer_select(ops, topk=topk, q_causal_offsets=0)

        buf = torch.empty(1, s, s)
        lens = torch.arange(1, s + 1, dtype=torch.int32)
        offsets = torch.zeros(1, dtype=torch.int32)
        scores = buf.view(s, s)
        pieces = [
            ("prepare_indexer_operands (fused, launches stubbed)", prepare),
            ("indexer_select (cuDNN path, launches stubbed)", select),
            ("  indexer_scores(out=)", lambda: dp.indexer_scores(ops, out=buf, backend="cudnn")),
            ("  indexer_topk(seq_lens=)", lambda: dp.indexer_topk(scores, topk, seq_lens=lens)),
            ("  causal_key_counts", lambda: dp.scoring.causal_key_counts(offsets, 0, s, 1, s)),
            ("torch: one small add_", lambda: lens.add_(0)),
        ]
        for label, fn in pieces:
            rows.append((label, host_us(fn, args.reps)))
        print(f"host microseconds per call on the CPU (median of {args.reps}), S={s} H={h}")
        for label, us in rows:
            print(f"  {label:<56}{us:>8.1f}")
        if args.profile:
            for label, fn in pieces[:2]:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    fn()
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                print(f"cProfile of 200 calls: {label}\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
