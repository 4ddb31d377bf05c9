"""Parallel parity: the dsa-precision drop-ins under Megatron's tensor and context parallelism.

Builds the toy GLM-5-like DSA model of ``examples/toy_glm5_train.py`` (2 decoder layers, hidden
1024, MLA with kv_lora_rank 512, DSA indexer 32 heads x 128, top-k 2048, S = 8192, random weights
from a fixed seed, copy-task mock data; ``--tiny``: hidden 256, S = 128, top-k 16) with Megatron's
parallel state and Megatron's own sparse attention (``dsa_kernel_backend="none"``), and runs the
same micro-batches under these layouts::

    ref        TP=1, CP=1, BSHD                  the single-GPU reference of the BSHD layouts
    ref-thd    TP=1, CP=1, packed THD            the single-GPU reference of the THD layouts
    tp2-sp     TP=2 with sequence_parallel=True, BSHD
    cp2-bshd   CP=2, cp_comm_type="allgather", BSHD
    cp2-thd    CP=2, cp_comm_type="allgather", packed THD (four sequences of unequal length)
    tp2-thd    TP=2 with sequence_parallel=True, packed THD

for each configuration: ``baseline`` (Megatron's BF16 path, the package's defaults), ``rope_fp32``,
``fp8``, ``rope_fp32+fp8``, and ``stock`` (Megatron's own DSAttention / DSAIndexer, not the
drop-ins: the reference point for differences that Megatron's parallel arithmetic makes).

The modules are the local (non-Transformer-Engine) spec of ``get_gpt_dsa_precision_block_spec``
in every layout (and on the GPU too, so that all layouts build the same arithmetic), with one
addition: Megatron's torch norm refuses ``sequence_parallel`` without TE or Apex, so the norms
are the same torch RMSNorm / LayerNorm with their parameters marked ``sequence_parallel`` (what
Megatron's fused norms do), see ``dsa_precision.testing.megatron.SequenceParallelTorchNorm``.

This file is the launcher: the runs are ``parallel_runs.py`` beside it and the
comparisons and verdicts ``parity_checks.py`` (tested in
``tests/examples/test_parallel_parity.py``). On the CPU the run happens inside
``dsa_precision.testing.megatron.megatron_on_cpu()``, which answers megatron-core's few
requests for a GPU on the CPU for the duration of the run and restores torch on exit.

Inputs are sharded the way Megatron's data pipeline shards them: under CP every rank holds two
zigzag chunks of each sequence (``dsa_layout.build_zigzag_cp_local_positions``, what
``megatron.core.utils.get_batch_on_this_cp_rank`` cuts), and for packed THD the two zigzag
chunks of every packed sequence (``dsa_layout.build_packed_allgather_cp_local_positions``, the
allgather-CP layout Transformer Engine's ``thd_get_partitioned_indices`` produces); each packed
sequence's length is divisible by 2 * CP. Under TP every rank holds the whole micro-batch (the
embedding scatters it over the sequence). Gradients are reduced as Megatron's
``finalize_model_grads`` does without a DDP wrapper: summed over the CP group (here the whole
data-parallel x context-parallel group), and the sequence-parallel LayerNorm gradients summed
over TP; the loss is the global per-token mean (each rank back-propagates its token sum over the
global token count). The optimizer is AdamW on FP32 master copies, as in the toy example.

How the single-process reference is made: in the same launcher, before the parallel layouts.
Megatron's ``parallel_state`` is global, so the launcher initialises it once per layout
(``destroy_model_parallel`` then ``initialize_model_parallel``): first with TP = CP = 1, where the
world of 2 ranks is data-parallel and every rank runs the whole unsharded model on the whole
micro-batch with no gradient reduction (a single-GPU run, twice; rank 0's copy is the reference,
rank 1's must reproduce its losses), then TP=2 and CP=2. Every layout loads the same weights: the
reference model's parameters, sliced along each tensor-parallel parameter's ``partition_dim``.
With ``--nproc-per-node 1`` only the reference layouts run.

What is measured, per layout, configuration and layer, against the reference:

- top-k: every rank records its picks with ``dsa_precision.megatron.record_topk()`` (the
  engines' layout: each query row's global token and its sequence-relative keys) on the first
  micro-batch, before training; rank 0 gathers them and assembles them by global token.
  ``rows identical`` is the share of rows whose top-k *set* equals the reference's (order and
  ``-1`` padding ignored), ``member agreement`` the share of the reference's picks the parallel
  run also picked (``dsa_precision.topk_agreement``). For ``stock`` the picks are Megatron's own
  selection (``dsa.fused_qk_topk_naive``) of the gathered operands.
- ``split``: the share of rows whose parallel picks equal a single-process selection of the
  parallel run's own indexer operands, gathered into global order (``indexer_select`` /
  ``indexer_select_varlen``). This is the package's claim -- scoring a row does not depend on
  how rows are split over ranks -- and must be 100 % whatever Megatron's arithmetic did upstream.
- ``ops``: whether the indexer's scoring operands (the FP8 bytes and descales, or the BF16 q, k
  and weights), gathered into global order, are bit-identical to the reference's, and
  ``score rel``: the largest difference of the indexer scores over every causal (query, key)
  pair, relative to the largest reference score (``indexer_scores`` / ``indexer_scores_varlen``
  of both operand sets). When the operands differ it is Megatron's parallel arithmetic upstream
  of the indexer: under TP the attention projection and the MLP's second linear are row
  parallel, each rank's BF16 partial sum is rounded before the TP reduce-scatter adds them, so
  layer 2's hidden states differ from one GEMM's in the last bits (layer 1 reads the embedding,
  whose TP reduction only adds zeros); on a GPU a GEMM over half the rows may also pick another
  kernel. The stock model shows the same difference, and FP8 turns it into more flipped picks
  than BF16 (an E4M3 value moves a whole 3-bit-mantissa step when a last-bit change of its input
  crosses a rounding midpoint).
- ``loss`` / ``gnorm``: the relative difference of the loss and of the gradient norm (after the
  gradient reduction, before the step) at the last of ``--steps`` training steps (default 10).
- ``fp8 calls``: the FP8 scoring calls counted on every rank during training
  (``dsa_precision.scoring_calls``), with ``DSA_PRECISION_STRICT=1`` (set here unless the
  environment sets it): a scoring call of an FP8 layer in another precision raises.

"Identical" means equal sets of key indices per row (``rows identical`` = 100 %); the launcher
exits non-zero when an FP8 configuration's picks are not identical on every row where its
operands are bit-identical, or ``split`` is below 100 % anywhere.

``--throughput``: at CP=2 (the world size, at most 2), step time, the indexer's share (the
top-k of every layer timed alone on the step's inputs) and the peak memory per GPU
(``torch.cuda.max_memory_allocated``) at S = 16384 and 32768 per configuration, as a table.
A layout that runs out of memory is reported as OOM (Megatron's unfused sparse attention
materialises [heads, S/CP, S] scores).

NVLink multicast is off in every process (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, set before
``torch.distributed`` starts unless the environment sets them). CPU runs use gloo, CUDA runs NCCL
(and a gloo group for the result gathers).

GPU:   torchrun --nproc-per-node 2 examples/parallel_parity.py --json $OUT/parity.json
       torchrun --nproc-per-node 1 examples/parallel_parity.py            # the reference alone
       torchrun --nproc-per-node 2 examples/parallel_parity.py --throughput
CPU:   torchrun --nproc-per-node 2 examples/parallel_parity.py --tiny --device cpu
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("DSA_PRECISION_STRICT", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

from dsa_precision.testing.megatron import megatron_on_cpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flag_checks as fc  # noqa: E402
import parallel_runs as runs  # noqa: E402
import toy_glm5_train as toy  # noqa: E402

CONFIGS = {**toy.CONFIGS, "stock": {}}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU shapes: hidden 256, S=128, k=16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seq", type=int, default=None, help="tokens per micro-batch (8192; tiny 128)")
    p.add_argument("--topk", type=int, default=None, help="dsa_indexer_topk (2048; tiny 16)")
    p.add_argument("--batch", type=int, default=1, help="sequences per BSHD micro-batch")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--engine", default="vllm", help="dsa_indexer_engine of every config")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layouts", default=",".join(runs.LAYOUTS))
    p.add_argument("--json", default=None, help="write the results (rank 0) as JSON here")
    p.add_argument("--throughput", action="store_true", help="the CP=2 throughput table instead")
    p.add_argument(
        "--throughput-seqs", default=None, help="S of the throughput table (16384,32768)"
    )
    p.add_argument("--throughput-steps", type=int, default=5, help="timed steps (after 2 warm-up)")
    args = p.parse_args(argv)
    # Refused with one line (exit status 2) before torch.distributed starts.
    fc.check_counts(p, args, dict(seq=1, topk=1, batch=1, steps=1, throughput_steps=1))
    fc.check_lr(p, args.lr)
    fc.check_engine(p, args.engine)
    args.device = fc.check_device(p, args.device)
    fc.check_output(p, "json", args.json)
    if args.seq is None:  # "or" would take --seq 0 for the default
        args.seq = 128 if args.tiny else 8192
    if args.topk is None:
        args.topk = 16 if args.tiny else 2048
    seqs = args.throughput_seqs or ("128,256" if args.tiny else "16384,32768")
    try:
        args.throughput_seqs = [int(s) for s in seqs.split(",")]
    except ValueError:
        p.error(f"--throughput-seqs {seqs}: give comma-separated token counts, e.g. 16384,32768")
    args.configs = args.configs.split(",")
    args.model = runs.ToyModel(toy.model_config, toy._unswap, CONFIGS)
    args.layouts = args.layouts.split(",")
    for name in args.configs:
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    for name in args.layouts:
        if name not in runs.LAYOUTS:
            p.error(f"unknown layout {name!r}; choose from {', '.join(runs.LAYOUTS)}")
    world = os.environ.get("WORLD_SIZE", "1")
    if args.throughput:
        # CP = 2 splits each sequence into 2 * CP zigzag chunks.
        bad = [s for s in args.throughput_seqs if s < 4 or s % 4]
        if bad:
            p.error(f"--throughput-seqs {bad[0]}: give a multiple of 4 (CP=2's four chunks)")
    else:
        if world not in ("1", "2"):
            p.error(f"WORLD_SIZE={world}: parallel_parity runs on 1 or 2 ranks "
                    f"(torchrun --nproc-per-node 1|2)")  # fmt: skip
        if args.seq % 64:  # the packed batches: four sequences of 7, 5, 3, 1 sixteenths
            p.error(f"--seq {args.seq}: give a multiple of 64 (the packed THD micro-batches)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    world = runs.Dist(args.device)
    on_cpu = megatron_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    with on_cpu:
        ok = run(args, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def run(args, world: runs.Dist) -> bool:
    """The parity table or the throughput table; whether the checks passed."""
    strict = os.environ["DSA_PRECISION_STRICT"]
    if args.throughput:
        if world.rank == 0:
            print(
                f"throughput: CP={min(world.world, 2)} on {world.world} x {args.device}, "
                f"top-k {args.topk}, engine {args.engine}, median of {args.throughput_steps} "
                f"steps after 2 warm-up, DSA_PRECISION_STRICT={strict}",
                flush=True,
            )
            print(
                f"{'config':<14}{'S':>7}{'step ms':>10}{'indexer ms':>12}{'share':>8}"
                f"{'peak GiB/rank':>16}",
                flush=True,
            )
        results = runs.throughput(args, world)
        ok = True
    else:
        if world.rank == 0:
            print(
                f"parallel parity: {world.world} x {args.device}, S={args.seq}, top-k "
                f"{args.topk}, engine {args.engine}, {args.steps} training steps, "
                f"DSA_PRECISION_STRICT={strict}",
                flush=True,
            )
            print(runs.HEADER, flush=True)
        results = runs.parity(args, world)
        ok = results["checks"].get("ok", True) if world.rank == 0 else True
        if world.rank == 0:
            print("checks:", json.dumps(results["checks"]), flush=True)
    if world.rank == 0 and args.json:
        results["args"] = {k: v for k, v in vars(args).items() if k != "model"}
        results["world_size"] = world.world
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
