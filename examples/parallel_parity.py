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
Megatron's fused norms do), see :class:`SequenceParallelTorchNorm`.

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

- top-k: every rank records its picks with ``dsa_precision.megatron.capture_topk()`` (the
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
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_glm5_train as toy  # noqa: E402

CONFIGS = {**toy.CONFIGS, "stock": {}}
FP8_CONFIGS = ("fp8", "rope_fp32+fp8")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    cp: int
    packed: bool

    @property
    def reference(self) -> str:
        return "ref-thd" if self.packed else "ref"


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("ref", 1, 1, False),
        Layout("ref-thd", 1, 1, True),
        Layout("tp2-sp", 2, 1, False),
        Layout("cp2-bshd", 1, 2, False),
        Layout("cp2-thd", 1, 2, True),
        Layout("tp2-thd", 2, 1, True),
    )
}


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
    p.add_argument("--engine", default="vllm-exact", help="dsa_indexer_engine of every config")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--json", default=None, help="write the results (rank 0) as JSON here")
    p.add_argument("--throughput", action="store_true", help="the CP=2 throughput table instead")
    p.add_argument(
        "--throughput-seqs", default=None, help="S of the throughput table (16384,32768)"
    )
    p.add_argument("--throughput-steps", type=int, default=5, help="timed steps (after 2 warm-up)")
    args = p.parse_args(argv)
    args.seq = args.seq or (128 if args.tiny else 8192)
    args.topk = args.topk or (16 if args.tiny else 2048)
    seqs = args.throughput_seqs or ("128,256" if args.tiny else "16384,32768")
    args.throughput_seqs = [int(s) for s in seqs.split(",")]
    args.configs = args.configs.split(",")
    args.layouts = args.layouts.split(",")
    for name in args.configs:
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    for name in args.layouts:
        if name not in LAYOUTS:
            p.error(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    return args


# ------------------------------------------------------------------------------ process setup


def _cpu_shims() -> None:
    """Where Megatron asks for a GPU on this path, answer on the CPU (``--device cpu`` only; torch
    is redirected, no megatron-core attribute is replaced):

    - RoPE places its buffers on ``torch.cuda.current_device()`` (tests/conftest.py's
      ``cpu_rotary`` does the same redirect), and Megatron's ``get_pos_emb_on_this_cp_rank``
      builds its CP index as a pinned CPU tensor moved with ``.cuda()``: without a GPU, pinning is
      dropped and ``.cuda()`` leaves a CPU tensor where it is, so Megatron's own function runs;
    - sequence parallelism forks the CUDA RNG tracker around the embedding's dropout: the
      tracker is initialised without CUDA states and its ``fork`` does nothing (dropout is 0).
    """
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    make_tensor = torch.tensor

    def unpinned_tensor(*args, pin_memory=False, **kwargs):
        return make_tensor(*args, **kwargs)

    torch.tensor = unpinned_tensor
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    mp_random.initialize_rng_tracker()
    mp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


class Dist:
    """The world, and a gloo group for gathering results (the default group on the CPU)."""

    def __init__(self, device: str):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "gloo" if device == "cpu" else "nccl"
        dist.init_process_group(backend, rank=rank, world_size=world)
        self.rank, self.world = rank, world
        self.objects = dist.group.WORLD if device == "cpu" else dist.new_group(backend="gloo")

    def gather(self, obj):
        """``obj`` of every rank on rank 0 (CPU tensors inside); ``None`` elsewhere."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.objects)
        return out


def use_layout(args, layout: Layout) -> None:
    """(Re)initialise Megatron's parallel state for ``layout``."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, context_parallel_size=layout.cp
    )
    if args.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ model


def model_config(args, layout: Layout, name: str):
    toy_args = argparse.Namespace(
        tiny=args.tiny, device=args.device, topk=args.topk, engine=args.engine
    )
    return toy.model_config(
        toy_args,
        use_cpu_initialization=True,  # the full weights from the seed, then the TP slices
        dsa_indexer_topk=args.topk,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.tp > 1,
        cp_comm_type="allgather" if layout.cp > 1 else None,
        **CONFIGS[name],
    )


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) for sequence parallelism
    without Transformer Engine or Apex: a norm is row-wise, so it needs nothing of SP but what
    Megatron's fused norms do -- mark its parameters ``sequence_parallel`` so that their
    gradients, computed on a slice of the sequence, are summed over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def backend():
    """The local (non-TE) DSA spec provider with a norm that takes sequence parallelism."""
    import dsa_precision.megatron as dsap

    class Provider(dsap.LocalDSASpecProvider):
        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return SequenceParallelTorchNorm

    return Provider()


def vocab_size(args) -> int:
    return 512 if args.tiny else 4096


def build_model(args, layout: Layout, name: str, weights: dict | None, seq: int):
    """GPTModel of ``layout`` with the drop-ins (``stock``: Megatron's modules), loaded with
    ``weights`` (the reference model's parameters; their TP slices)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    import dsa_precision.megatron as dsap

    config = model_config(args, layout, name)
    spec = dsap.get_gpt_dsa_precision_block_spec(config, backend=backend())
    if name == "stock":
        spec = toy._unswap(spec)
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size(args),
        max_sequence_length=seq,
        position_embedding_type="rope",
    )
    model = model.to(args.device).bfloat16()
    if weights is not None:
        tp, rank = layout.tp, parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                full = weights[pname]
                if getattr(p, "tensor_model_parallel", False) and tp > 1:
                    full = full.chunk(tp, dim=p.partition_dim)[rank]
                if full.shape != p.shape:
                    raise RuntimeError(f"{pname}: weights {tuple(full.shape)} vs {tuple(p.shape)}")
                p.copy_(full)
    return model


def cores(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


# ------------------------------------------------------------------------------------- data


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor  # (B, S) or packed (1, T)
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None = None  # packed: (n + 1,) int64


def thd_lengths(seq: int) -> list[int]:
    """Four packed sequences of unequal length (7, 5, 3, 1 sixteenths of ``seq``), each
    divisible by 2 * CP = 4 (Megatron's CP padding)."""
    lengths = [seq * n // 16 for n in (7, 5, 3, 1)]
    if seq % 64 or sum(lengths) != seq:
        raise ValueError(f"--seq {seq}: packed THD needs a multiple of 64.")
    return lengths


def batches(args, seq: int, packed: bool, count: int) -> list[Batch]:
    """Copy-task micro-batches (a random segment repeated), the same on every rank."""
    g = torch.Generator().manual_seed(args.seed + 1)
    seg = 16 if args.tiny else 256
    sub_vocab = min(vocab_size(args), 256)

    def copy_task(rows: int, length: int) -> torch.Tensor:
        motif = torch.randint(0, sub_vocab, (rows, seg), generator=g)
        return motif.repeat(1, length // seg + 2)[:, : length + 1]

    out = []
    for _ in range(count):
        if not packed:
            t = copy_task(args.batch, seq)
            out.append(Batch(t[:, :-1], t[:, 1:]))
            continue
        lengths = thd_lengths(seq)
        parts = [copy_task(1, n) for n in lengths]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        out.append(
            Batch(
                torch.cat([p[:, :-1] for p in parts], 1),
                torch.cat([p[:, 1:] for p in parts], 1),
                cu,
            )
        )
    return out


@dataclasses.dataclass
class LocalBatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object
    global_tokens: int


def shard(args, layout: Layout, batch: Batch) -> LocalBatch:
    """This rank's part of the micro-batch, as Megatron's data pipeline cuts it for CP: BSHD
    through ``megatron.core.utils.get_batch_on_this_cp_rank`` (two zigzag chunks of every
    sequence); packed THD through ``dsa_layout.build_packed_allgather_cp_local_positions`` (the
    two zigzag chunks of every packed sequence, the rows Transformer Engine's
    ``thd_get_partitioned_indices`` gives Megatron's per-document split). TP ranks hold it all."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.experimental_attention_variant import dsa_layout
    from megatron.core.utils import get_batch_on_this_cp_rank

    device = args.device
    b, n = batch.tokens.shape
    if batch.cu_seqlens is None:
        part = get_batch_on_this_cp_rank(
            dict(
                tokens=batch.tokens,
                labels=batch.labels,
                position_ids=torch.arange(n).expand(b, n),
                cu_seqlens=None,
            ),
            is_hybrid_cp=False,
            cp_group=parallel_state.get_context_parallel_group(),
        )
        tokens, labels, positions, psp = part["tokens"], part["labels"], part["position_ids"], None
    else:
        cu = batch.cu_seqlens
        rows = dsa_layout.build_packed_allgather_cp_local_positions(
            cu,
            layout.cp,
            parallel_state.get_context_parallel_rank(),
            "cpu",
            output_size=n // layout.cp,
        )
        tokens, labels = batch.tokens[:, rows], batch.labels[:, rows]
        positions = (rows - cu[torch.searchsorted(cu[1:], rows, right=True)]).unsqueeze(0)
        longest = int((cu[1:] - cu[:-1]).max())
        cu_dev = cu.to(device=device, dtype=torch.int32)
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_dev,
            cu_seqlens_kv=cu_dev,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    return LocalBatch(
        tokens=tokens.contiguous().to(device),
        labels=labels.contiguous().to(device),
        position_ids=positions.contiguous().to(device),
        packed_seq_params=psp,
        global_tokens=batch.tokens.numel(),
    )


def run_model(model, lb: LocalBatch, labels: bool = True):
    return model(
        lb.tokens,
        lb.position_ids,
        None,
        labels=lb.labels if labels else None,
        packed_seq_params=lb.packed_seq_params,
    )


# ---------------------------------------------------------------------------------- training


class Trainer:
    """AdamW on FP32 master copies; gradients reduced as Megatron's finalize_model_grads does."""

    def __init__(self, model, layout: Layout, lr: float):
        from megatron.core import parallel_state

        self.model, self.layout = model, layout
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for _, p in self.named]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def _reduce(self) -> tuple[list[torch.Tensor | None], float]:
        """FP32 gradients after Megatron's reductions (``None`` where a parameter has none, e.g.
        the indexer's without an indexer loss), and their global norm."""
        config = self.model.config
        grads = [None if p.grad is None else p.grad.float() for _, p in self.named]
        present = [g for g in grads if g is not None]
        if self.layout.cp > 1:  # the data-parallel x context-parallel all-reduce (DP = 1 here)
            flat = torch.cat([g.reshape(-1) for g in present])
            dist.all_reduce(flat, group=self.cp_group)
            for g, r in zip(present, flat.split([g.numel() for g in present]), strict=True):
                g.copy_(r.view_as(g))
        if self.layout.tp > 1:  # sequence-parallel norms (sum) and duplicated modules (mean)
            for (name, p), g in zip(self.named, grads, strict=True):
                if g is None:
                    continue
                if getattr(p, "average_gradients_across_tp_domain", False):
                    dist.all_reduce(g, group=self.tp_group)
                    g.div_(self.layout.tp)
                elif (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                ):
                    dist.all_reduce(g, group=self.tp_group)
        # Gradient norm over unique parameters: TP slices on every rank, duplicates once.
        squares = torch.zeros((), dtype=torch.float64, device=present[0].device)
        for (_, p), g in zip(self.named, grads, strict=True):
            if g is not None and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0):
                squares += g.double().pow(2).sum()
        if self.layout.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return grads, float(squares.sqrt())

    def step(self, lb: LocalBatch) -> tuple[float, float]:
        losses = run_model(self.model, lb)
        loss = losses.float().sum() / lb.global_tokens
        for _, p in self.named:
            p.grad = None
        loss.backward()
        total = loss.detach().double()
        if self.layout.cp > 1:
            dist.all_reduce(total, group=self.cp_group)
        grads, norm = self._reduce()
        for m, g in zip(self.master, grads, strict=True):
            m.grad = g
        self.opt.step()
        with torch.no_grad():
            for (_, p), m in zip(self.named, self.master, strict=True):
                p.copy_(m)
        return float(total), norm


# ---------------------------------------------------------------------------------- capture

_POSITION = {"query": 0, "x": 4, "qr": 5}


def _arg(a: tuple, kw: dict, name: str):
    return kw[name] if name in kw else a[_POSITION[name]]


def _ops_dict(ops) -> dict:
    """ScoringOperands as CPU tensors (E4M3 as bytes, for pickling)."""
    out = {}
    for f in ("q", "k", "weights", "q_descale", "k_descale"):
        t = getattr(ops, f)
        if t is not None:
            t = t.detach()
            out[f] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).cpu()
    out["fp8"] = ops.q.dtype == torch.float8_e4m3fn
    out["sm_scale"] = float(ops.sm_scale)
    return out


def capture(args, layout: Layout, name: str, model, lb: LocalBatch) -> dict:
    """Each layer's picks (engines' layout) and indexer operands on this rank."""
    from megatron.core import parallel_state

    import dsa_precision.megatron as dsap
    from dsa_precision.megatron.layout import RankLayout, query_positions

    inputs = {}

    def hook(mod, a, kw):
        inputs[mod.layer_number] = (_arg(a, kw, "x"), _arg(a, kw, "qr"))

    handles = [c.register_forward_pre_hook(hook, with_kwargs=True) for c in cores(model)]
    with torch.no_grad(), dsap.capture_topk() as captured:
        run_model(model, lb, labels=False)
    for h in handles:
        h.remove()
    psp = lb.packed_seq_params
    cp_rank = parallel_state.get_context_parallel_rank()
    out = {}
    for core in cores(model):
        n = core.layer_number
        x, qr = inputs[n]
        rows = x.size(0) * layout.tp  # the indexer rows: sequence parallelism gathers them
        cu = None if psp is None else psp.cu_seqlens_q
        positions = query_positions(
            RankLayout(cp_size=layout.cp, cp_rank=cp_rank, cu_seqlens=cu), rows, torch.device("cpu")
        )
        with torch.no_grad():
            if name == "stock":
                q, k, w = core.indexer.forward_before_topk(x, qr, psp)
                ops = {
                    "q": q.transpose(0, 1).cpu(),
                    "k": k.transpose(0, 1).cpu(),
                    "weights": w.transpose(0, 1).cpu(),
                    "fp8": False,
                    "stock": True,
                }
            else:
                ops = _ops_dict(core.indexer.scoring_operands(x, qr, psp, core.precision))
        entry = {"positions": positions, "ops": ops}
        if n in captured:
            entry["tokens"] = captured[n].tokens.cpu()
            entry["picks"] = captured[n].indices.cpu()
        out[n] = entry
    return out


# -------------------------------------------------------------------------------- comparison


def assemble_picks(parts: list[dict]) -> tuple[torch.Tensor, bool]:
    """The ranks' picks in global token order (every token once), and whether ranks holding the
    same rows (TP ranks, when the attention's query rows are not sequence-local) picked alike."""
    tokens = torch.cat([p["tokens"] for p in parts])
    picks = torch.cat([p["picks"] for p in parts])
    total = int(tokens.max()) + 1
    out = torch.full((total, picks.shape[-1]), -2, dtype=picks.dtype)
    agree = True
    for p in parts:
        held = out[p["tokens"]]
        seen = held[:, 0] != -2
        if bool(seen.any()):
            agree &= same_rows(held[seen], p["picks"][seen]) == 1.0
        out[p["tokens"]] = p["picks"]
    if bool((out[:, 0] == -2).any()):
        raise RuntimeError("the ranks' captured rows do not cover every token")
    return out, agree


def assemble_ops(parts: list[dict], batch: int, total: int) -> tuple[dict, bool]:
    """The ranks' indexer operands in global row order, and whether ranks holding the same rows
    (TP) hold the same bytes."""
    first = parts[0]["ops"]
    out = {}
    agree = True
    for f, t in first.items():
        if not isinstance(t, torch.Tensor):
            out[f] = t
            continue
        g = torch.zeros((batch, total, *t.shape[2:]), dtype=t.dtype)
        seen = torch.zeros(total, dtype=torch.bool)
        for p in parts:
            pos, v = p["positions"], p["ops"][f]
            dup = seen[pos]
            if bool(dup.any()):
                agree &= torch.equal(g[:, pos[dup]], v[:, dup])
            g[:, pos] = v
            seen[pos] = True
        if not bool(seen.all()):
            raise RuntimeError(f"operand {f}: the ranks' rows do not cover the micro-batch")
        out[f] = g
    return out, agree


def to_operands(d: dict, device: str):
    from dsa_precision import ScoringOperands

    def t(f):
        v = d.get(f)
        if v is None:
            return None
        v = v.to(device)
        return v.view(torch.float8_e4m3fn) if d["fp8"] and f in ("q", "k") else v

    if d.get("stock"):
        return None
    return ScoringOperands(
        t("q"), t("k"), t("weights"), t("q_descale"), t("k_descale"), sm_scale=d["sm_scale"]
    )


def bits_equal(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[f], b[f]) for f in a if isinstance(a[f], torch.Tensor) and f in b
    ) and {f for f in a if isinstance(a[f], torch.Tensor)} == {
        f for f in b if isinstance(b[f], torch.Tensor)
    }


def scores_and_picks(d: dict, cu: torch.Tensor | None, topk: int, device: str):
    """Single-process scores (float32, ``-inf`` off the causal pairs) and picks (sequence-relative
    keys, one row per global token) of global operands: the package's functions, or for ``stock``
    Megatron's own ``fused_qk_topk_naive``."""
    from dsa_precision import (
        indexer_scores,
        indexer_scores_varlen,
        indexer_select,
        indexer_select_varlen,
    )

    if d.get("stock"):
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            fused_qk_topk_naive,
        )

        q, k, w = (d[f].to(device).transpose(0, 1) for f in ("q", "k", "weights"))
        total = q.shape[0]
        rows = torch.arange(total, device=device)
        if cu is None:
            starts = torch.zeros_like(rows)
        else:
            cud = cu.to(device)
            starts = cud[torch.searchsorted(cud[1:], rows, right=True)]
        scores, picks = fused_qk_topk_naive(
            q, k, w, topk, varlen_starts=starts, varlen_ends=rows + 1, use_relu=True
        )
        picks = torch.where(picks >= 0, picks - starts[None, :, None], -1)
        picks = torch.nn.functional.pad(picks, (0, topk - picks.shape[-1]), value=-1)
        if cu is not None:
            scores = scores[0]
        return scores, picks.reshape(-1, topk).to(torch.int32)
    ops = to_operands(d, device)
    if cu is None:
        scores = indexer_scores(ops)
        picks = indexer_select(ops, topk=topk)
        return scores, picks.reshape(-1, topk)
    cud = cu.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    kw = dict(cu_seqlens_q=cud, cu_seqlens_k=cud, max_seqlen_q=longest, max_seqlen_k=longest)
    return indexer_scores_varlen(ops, **kw), indexer_select_varlen(ops, topk=topk, **kw)


def score_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite entries of ``b`` (``a`` finite at the same places)."""
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    diff = (a.double() - b.double())[finite].abs().max()
    return float(diff / b.double()[finite].abs().max().clamp_min(1e-30))


def same_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of rows with the same set of keys (order and ``-1`` padding ignored)."""
    from dsa_precision import topk_agreement

    return float(topk_agreement(a.long(), b.long()).rows_identical)


def compare_layer(args, layer_ref: dict, parts: list[dict], cu, batch: int) -> dict:
    """One layer of one (layout, config) run against the reference."""
    from dsa_precision import topk_agreement

    device = args.device
    total = cu[-1].item() if cu is not None else args.seq
    ops, tp_agree = assemble_ops(parts, batch, int(total))
    ref_scores, ref_sel = scores_and_picks(layer_ref["ops"], cu, args.topk, device)
    ref_scores = ref_scores.clone()  # a kernel's output buffer: keep it from the next call
    scores, sel = scores_and_picks(ops, cu, args.topk, device)
    stock = bool(ops.get("stock"))
    if stock:  # Megatron's own selection of the gathered operands, vs the reference's
        picks, ref_picks = sel, ref_sel
        split = float("nan")
    else:
        picks, picks_agree = assemble_picks(parts)
        tp_agree &= picks_agree
        ref_picks, _ = assemble_picks([layer_ref])
        picks, ref_picks = picks.to(device), ref_picks.to(device)
        split = same_rows(picks, sel)
    agreement = topk_agreement(picks.long(), ref_picks.long()).as_dict()
    return dict(
        rows_identical=agreement["rows_identical"],
        member_agreement=agreement["member_agreement"],
        rows=agreement["rows"],
        split_identical=split,
        operands_identical=bits_equal(ops, layer_ref["ops"]),
        tp_ranks_agree=tp_agree,
        score_rel=score_rel(scores, ref_scores),
    )


# ------------------------------------------------------------------------------------- runs


def run_config(args, layout: Layout, name: str, data: list[Batch], weights: dict | None):
    """Capture, then ``--steps`` training steps, on this rank: its picks and operands of the
    first micro-batch, the global losses and gradient norms, its scoring-call counts."""
    from dsa_precision import reset_scoring_calls, scoring_calls

    model = build_model(args, layout, name, weights, args.seq)
    full = None
    if weights is None:  # the reference model's initial parameters: the weights of every run
        full = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    layers = capture(args, layout, name, model, shard(args, layout, data[0]))
    trainer = Trainer(model, layout, args.lr)
    reset_scoring_calls()
    losses, norms = [], []
    for batch in data[: args.steps]:
        loss, norm = trainer.step(shard(args, layout, batch))
        losses.append(loss)
        norms.append(norm)
    calls = dict(
        fp8=scoring_calls("fp8"),
        bf16=scoring_calls("bf16"),
        fp8_cudnn=scoring_calls("fp8", "cudnn"),
        total=scoring_calls(),
    )
    del trainer, model
    return dict(layers=layers, losses=losses, grad_norms=norms, calls=calls), full


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def parity(args, world: Dist) -> dict:
    layouts = [LAYOUTS[n] for n in args.layouts]
    if world.world == 1:
        layouts = [lay for lay in layouts if lay.tp == lay.cp == 1]
    elif world.world != 2:
        raise SystemExit("parallel_parity runs on 1 or 2 ranks (torchrun --nproc-per-node 1|2)")
    # The references first (every layout compares with one).
    needed = {lay.reference for lay in layouts}
    layouts = [LAYOUTS[n] for n in ("ref", "ref-thd") if n in needed] + [
        lay for lay in layouts if lay.name not in ("ref", "ref-thd")
    ]
    data = {packed: batches(args, args.seq, packed, max(args.steps, 1)) for packed in (False, True)}
    weights = None
    references: dict[tuple[str, str], dict] = {}
    results = []
    for layout in layouts:
        use_layout(args, layout)
        for name in args.configs:
            t0 = time.perf_counter()
            mine, full = run_config(args, layout, name, data[layout.packed], weights)
            weights = weights if weights is not None else full
            if args.device == "cuda":
                torch.cuda.empty_cache()
            parts = world.gather(mine)
            elapsed = time.perf_counter() - t0
            if world.rank != 0:
                continue
            cu = data[layout.packed][0].cu_seqlens
            row = dict(
                layout=layout.name,
                config=name,
                tp=layout.tp,
                cp=layout.cp,
                packed=layout.packed,
                seconds=elapsed,
            )
            row["losses"], row["grad_norms"] = mine["losses"], mine["grad_norms"]
            row["calls_per_rank"] = [p["calls"] for p in parts]
            row["finite"] = all(math.isfinite(v) for v in row["losses"] + row["grad_norms"])
            if layout.tp == layout.cp == 1:
                references[(layout.name, name)] = mine
                # Every rank ran the same single-GPU model: they must agree.
                row["ranks_reproduce"] = all(
                    p["losses"] == mine["losses"] and p["grad_norms"] == mine["grad_norms"]
                    for p in parts
                )
            ref = references.get((layout.reference, name))
            if ref is not None and layout.name != layout.reference:
                batch = 1 if layout.packed else args.batch
                row["layers"] = {}
                for n in sorted(ref["layers"]):
                    mine_n = [p["layers"][n] for p in parts]
                    row["layers"][n] = compare_layer(args, ref["layers"][n], mine_n, cu, batch)
                row["loss_rel"] = rel(row["losses"][-1], ref["losses"][-1])
                row["grad_norm_rel"] = rel(row["grad_norms"][-1], ref["grad_norms"][-1])
                row["loss_rel_first"] = rel(row["losses"][0], ref["losses"][0])
                row["grad_norm_rel_first"] = rel(row["grad_norms"][0], ref["grad_norms"][0])
                row["loss_rel_max"] = max(
                    rel(a, b) for a, b in zip(row["losses"], ref["losses"], strict=True)
                )
            results.append(row)
            print_row(row, flush=True)
    return dict(rows=results, checks=checks(results) if world.rank == 0 else {})


def checks(rows: list[dict]) -> dict:
    """The launcher's verdicts (see the module docstring)."""
    out = dict(
        split_everywhere=True,
        fp8_identical_where_operands_identical=True,
        fp8_calls_every_rank=True,
        finite=True,
        references_reproduced=True,
    )
    for r in rows:
        out["finite"] &= r["finite"]
        out["references_reproduced"] &= r.get("ranks_reproduce", True)
        if r["config"] in FP8_CONFIGS:
            out["fp8_calls_every_rank"] &= all(
                c["fp8"] > 0 and c["bf16"] == 0 for c in r["calls_per_rank"]
            )
        for layer in r.get("layers", {}).values():
            if r["config"] != "stock":
                out["split_everywhere"] &= layer["split_identical"] == 1.0
            if r["config"] in FP8_CONFIGS and layer["operands_identical"]:
                out["fp8_identical_where_operands_identical"] &= layer["rows_identical"] == 1.0
    out["ok"] = all(out.values())
    return out


HEADER = (
    f"{'layout':<9}{'config':<14}{'L':>2}{'rows ident':>11}{'member':>10}{'split':>7}"
    f"{'ops':>5}{'score rel':>10}{'loss rel':>10}{'gnorm rel':>10}{'fp8 calls/rank':>16}"
)


def print_row(row: dict, flush: bool = False) -> None:
    calls = "/".join(str(c["fp8"]) for c in row["calls_per_rank"])
    if "layers" not in row:
        losses = row["losses"]
        extra = f"  reproduced on every rank: {row.get('ranks_reproduce')}"
        print(
            f"{row['layout']:<9}{row['config']:<14} reference: loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}, grad norm {row['grad_norms'][-1]:.4f}, fp8 calls {calls}"
            f"{extra}",
            flush=flush,
        )
        return
    for i, (n, layer) in enumerate(sorted(row["layers"].items())):
        split = "-" if math.isnan(layer["split_identical"]) else f"{layer['split_identical']:.0%}"
        tail = f"{row['loss_rel']:>10.2e}{row['grad_norm_rel']:>10.2e}{calls:>16}" if i == 0 else ""
        print(
            f"{row['layout'] if i == 0 else '':<9}{row['config'] if i == 0 else '':<14}{n:>2}"
            f"{layer['rows_identical']:>11.2%}{layer['member_agreement']:>10.4%}{split:>7}"
            f"{'=' if layer['operands_identical'] else 'diff':>5}{layer['score_rel']:>10.1e}"
            f"{tail}",
            flush=flush,
        )


# ------------------------------------------------------------------------------- throughput


def indexer_ms(args, model, lb: LocalBatch) -> float:
    """The indexer's top-k of every layer, timed alone (median of 5) on the step's inputs."""
    captured = []

    def hook(mod, a, kw):
        captured.append((mod, *(_arg(a, kw, n) for n in ("query", "x", "qr"))))

    handles = [c.register_forward_pre_hook(hook, with_kwargs=True) for c in cores(model)]
    with torch.no_grad():
        run_model(model, lb, labels=False)
    for h in handles:
        h.remove()
    psp = lb.packed_seq_params

    def run():
        with torch.no_grad():
            for core, query, x, qr in captured:
                if getattr(core, "owns_topk", lambda: False)():
                    core.compute_topk(query, x, qr, psp)
                else:  # Megatron's BF16 scoring and top-k of the same operands
                    q, k, w = core.indexer.forward_before_topk(x, qr, psp)
                    if layer_cp(core) > 1:
                        from megatron.core.tensor_parallel.mappings import (
                            gather_from_sequence_parallel_region,
                        )

                        k = gather_from_sequence_parallel_region(k, group=core.pg_collection.cp)
                    from megatron.core.transformer.experimental_attention_variant import dsa

                    dsa.fused_qk_topk_naive(q, k, w, core.index_topk, use_relu=True)

    times = []
    for _ in range(6):
        dist.barrier()
        sync(args)
        t0 = time.perf_counter()
        run()
        sync(args)
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[1:])
    return times[len(times) // 2]


def layer_cp(core) -> int:
    cp = core.pg_collection.cp
    return cp.size() if cp is not None else 1


def throughput(args, world: Dist) -> dict:
    cp = min(world.world, 2)
    layout = Layout(f"cp{cp}-bshd", 1, cp, False)
    use_layout(args, layout)
    rows = []
    for seq in args.throughput_seqs:
        data = batches(args, seq, False, args.throughput_steps + 2)
        for name in args.configs:
            entry = dict(config=name, seq=seq, cp=cp)
            model = trainer = None
            try:
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                model = build_model(args, layout, name, None, seq)
                trainer = Trainer(model, layout, args.lr)
                times = []
                for i, batch in enumerate(data):
                    lb = shard(args, layout, batch)
                    dist.barrier()
                    sync(args)
                    t0 = time.perf_counter()
                    trainer.step(lb)
                    sync(args)
                    if i >= 2:
                        times.append((time.perf_counter() - t0) * 1e3)
                step = sorted(times)[len(times) // 2]
                peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
                index = indexer_ms(args, model, shard(args, layout, data[0]))
                entry |= dict(
                    step_ms=step,
                    indexer_ms=index,
                    indexer_share=index / step,
                    peak_gib=peak,
                    oom=False,
                )
            except torch.OutOfMemoryError:  # both ranks run the same shapes: both run out
                entry |= dict(oom=True)
            del trainer, model
            entry = dict(entry, per_rank=world.gather(entry))
            rows.append(entry)
            if world.rank == 0:
                print_throughput(entry, flush=True)
    return dict(throughput=rows)


def print_throughput(e: dict, flush: bool = False) -> None:
    if any(r.get("oom") for r in e["per_rank"]):
        print(f"{e['config']:<14}{e['seq']:>7}{'OOM':>10}", flush=flush)
        return
    ranks = e["per_rank"]
    step = max(r["step_ms"] for r in ranks)
    index = max(r["indexer_ms"] for r in ranks)
    peaks = "/".join(f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-" for r in ranks)
    print(
        f"{e['config']:<14}{e['seq']:>7}{step:>10.1f}{index:>12.2f}{index / step:>8.1%}{peaks:>16}",
        flush=flush,
    )


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse(argv)
    world = Dist(args.device)
    if args.device == "cpu":
        _cpu_shims()
    import dsa_precision.megatron  # noqa: F401  (checks the megatron-core surface)

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
        results = throughput(args, world)
        ok = True
    else:
        if world.rank == 0:
            print(
                f"parallel parity: {world.world} x {args.device}, S={args.seq}, top-k "
                f"{args.topk}, engine {args.engine}, {args.steps} training steps, "
                f"DSA_PRECISION_STRICT={strict}",
                flush=True,
            )
            print(HEADER, flush=True)
        results = parity(args, world)
        ok = results["checks"].get("ok", True) if world.rank == 0 else True
        if world.rank == 0:
            print("checks:", json.dumps(results["checks"]), flush=True)
    if world.rank == 0 and args.json:
        results["args"] = {k: v for k, v in vars(args).items()}
        results["world_size"] = world.world
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
