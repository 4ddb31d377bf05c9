"""The package's own host work per call on the FP8 select path, on the CPU, kernels stubbed.

Where ``tools/host_profile.py`` (CUDA) times what a step waits for, this isolates the part the
package controls on a machine without a GPU: the Python, the argument checks and the small torch
ops around each kernel, with every kernel launch replaced by a stub that returns at once (cuDNN's
wrappers and top-k plan answer at once, allocating what the real ones allocate; the fused Triton
kernel's launch does nothing).
Beside the microseconds (comparable only on one machine, before and after a change) it counts
the torch operations each piece issues, views apart: on a GPU each one is a launch or an
allocation (5-8 us of host time each on the H200), so the count is what carries over. The
cuDNN stand-in makes the CPU look like an SM90 device; the package remembers its backend checks
for CUDA devices only, so their cost shows here but not on the GPU.

    python tools/host_overhead_cpu.py                 # microseconds and torch ops of each piece
    python tools/host_overhead_cpu.py --interleaved   # the model's RoPE pairs interleaved
    python tools/host_overhead_cpu.py --profile       # plus a cProfile of the first two pieces
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the fused path's device check, before Triton imports

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import dsa_precision as dp  # noqa: E402
from dsa_precision.preprocess import IndexerPreprocess  # noqa: E402
from dsa_precision.rows import causal_key_counts  # noqa: E402
from tests.support import fake_cudnn  # noqa: E402  (the tests' stand-ins for the hardware)

_VIEWS = {
    "view", "unsqueeze", "squeeze", "transpose", "permute", "slice", "select", "t", "expand",
    "as_strided", "reshape", "_reshape_alias", "_unsafe_view", "alias", "detach",
}  # fmt: skip


class _NullDSA:
    """cuDNN's wrappers answering at once with buffers of the right shapes (no numerics)."""

    def indexer_forward_wrapper(self, q, k, w, ratio=4, sm_scale=1.0, out=None, **kw):
        return {"scores": out}

    def indexer_top_k_wrapper(self, values, seq_lens, top_k, next_n=1, return_val=True, **kw):
        # the wrapper allocates its outputs and the radix scratch, as the plan's caller does
        rows = values.shape[0]
        torch.empty(rows * 3 * values.shape[1] * 4, dtype=torch.uint8)
        return {
            "indices": torch.empty(rows, top_k, dtype=torch.int32),
            "values": torch.empty(rows, top_k, dtype=values.dtype),
        }

    def IndexerTopK(self, *args, **kwargs):
        return _NullPlan()


class _NullPlan:
    def check_support(self) -> bool:
        return True

    def compile(self) -> None:
        pass

    def scratch_workspace_bytes(self) -> int:
        return 128

    def execute(self, values, seq_lens, current_stream=None, **buffers):
        return buffers["out_indices"], buffers["out_values"]


class _NullLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def torch_ops(fn) -> collections.Counter[str]:
    """The non-view torch operations one call of ``fn`` issues."""
    with _CountOps() as mode:
        fn()
    return mode.ops


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
    p.add_argument("--interleaved", action="store_true", help="dsa_indexer_rope_interleaved")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    s, h, topk = args.seq, args.heads, args.topk
    gen = torch.Generator().manual_seed(0)
    config = dp.IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine="vllm")
    preprocess = IndexerPreprocess(
        128, 64, rope_fp32=True, engine=config.engine, rope_interleaved=args.interleaved
    )
    q = torch.randn(s, 1, h, 128, generator=gen).bfloat16()
    k = torch.randn(s, 1, 128, generator=gen).bfloat16()
    w = torch.randn(s, 1, h, generator=gen).bfloat16()
    freqs = torch.rand(s, 1, 1, 64, generator=gen)
    ops = dp.prepare_scoring_operands(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), w.transpose(0, 1), config=config
    )
    cu = torch.tensor([0, s // 2, s], dtype=torch.int32)
    rows = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        fake_cudnn.install(mp, _NullDSA())
        fake_cudnn.stub_fused_kernel(mp, _NullLaunch())

        def prepare():
            return dp.prepare_indexer_operands(preprocess, q, k, w, freqs, config=config)

        def select():
            return dp.indexer_select(ops, topk=topk, q_causal_offsets=0)

        def select_varlen():
            return dp.indexer_select_varlen(
                ops, topk=topk, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s - s // 2,
                max_seqlen_k=s - s // 2,
            )  # fmt: skip

        buf = torch.empty(1, s, s)
        lens = torch.arange(1, s + 1, dtype=torch.int32)
        offsets = torch.zeros(1, dtype=torch.int32)
        scores = buf.view(s, s)
        pieces = [
            ("prepare_indexer_operands (fused)", prepare),
            ("indexer_select (cuDNN, int offset)", select),
            ("indexer_select_varlen (cuDNN, 2 sequences)", select_varlen),
            ("indexer_scores(out=)", lambda: dp.indexer_scores(ops, out=buf, backend="cudnn")),
            ("indexer_topk(seq_lens=)", lambda: dp.indexer_topk(scores, topk, seq_lens=lens)),
            ("causal_key_counts", lambda: causal_key_counts(offsets, 0, s, 1, s)),
            ("torch: one small add_", lambda: lens.add_(0)),
        ]
        for label, fn in pieces:
            rows.append((label, host_us(fn, args.reps), torch_ops(fn)))
        print(
            f"host microseconds per call on the CPU (median of {args.reps}) and torch ops issued "
            f"(views apart), launches stubbed, S={s} H={h}, interleaved={args.interleaved}"
        )
        for label, us, ops_issued in rows:
            names = ", ".join(f"{n} {c}" for n, c in sorted(ops_issued.items()))
            print(f"  {label:<44}{us:>8.1f} us {sum(ops_issued.values()):>4} ops  ({names})")
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
