"""Parallel parity runs: a toy DSA GPT model under Megatron's TP, SP and CP on 1 or 2 ranks.

The machinery of ``examples/parallel_parity.py`` (see its docstring for what runs and what is
measured), importable apart so that ``tests/examples/test_parallel_parity.py`` tests it; the verdicts are
``parity_checks``'.
Every layout initialises Megatron's ``parallel_state`` (``destroy_model_parallel`` then
``initialize_model_parallel``), builds the model of a configuration with the reference model's
weights (their TP slices), shards the same micro-batches the way Megatron's data pipeline does,
captures each layer's picks and indexer operands, trains a few steps with Megatron's gradient
reductions (no DDP wrapper) and gathers everything on rank 0.

The model comes from the caller (:class:`ToyModel`, on ``args.model``). On the CPU run
everything inside :func:`dsa_precision.testing.megatron.megatron_on_cpu`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from parity_checks import checks, compare_layer, rel

from dsa_precision.testing.megatron import local_sp_backend

__all__ = [
    "LAYOUTS",
    "Batch",
    "Dist",
    "Layout",
    "LocalBatch",
    "ToyModel",
    "Trainer",
    "batches",
    "build_model",
    "parity",
    "print_row",
    "shard",
    "throughput",
]


@dataclasses.dataclass(frozen=True)
class ToyModel:
    """The model under test. ``config(args, **fields)``: its ``DSAPrecisionTransformerConfig``
    (``args``: ``tiny``, ``device``, ``topk``, ``engine``); ``stock_spec(spec)``: a drop-in
    layer spec with Megatron's own DSA modules; ``configs``: configuration name -> precision
    fields (``"stock"``: Megatron's modules)."""

    config: Callable[..., object]
    stock_spec: Callable[[object], object]
    configs: Mapping[str, dict]


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
    return args.model.config(
        toy_args,
        use_cpu_initialization=True,  # the full weights from the seed, then the TP slices
        dsa_indexer_topk=args.topk,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.tp > 1,
        cp_comm_type="allgather" if layout.cp > 1 else None,
        **args.model.configs[name],
    )


def vocab_size(args) -> int:
    return 512 if args.tiny else 4096


def build_model(args, layout: Layout, name: str, weights: dict | None, seq: int):
    """GPTModel of ``layout`` with the drop-ins (``stock``: Megatron's modules), loaded with
    ``weights`` (the reference model's parameters; their TP slices)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    import dsa_precision.megatron as dsap

    config = model_config(args, layout, name)
    spec = dsap.get_gpt_dsa_precision_block_spec(config, backend=local_sp_backend())
    if name == "stock":
        spec = args.model.stock_spec(spec)
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


def call_arg(a: tuple, kw: dict, name: str):
    """Argument ``name`` of a DSAttention forward call, by keyword or position."""
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
        inputs[mod.layer_number] = (call_arg(a, kw, "x"), call_arg(a, kw, "qr"))

    handles = [c.register_forward_pre_hook(hook, with_kwargs=True) for c in cores(model)]
    with torch.no_grad(), dsap.record_topk() as recorder:
        run_model(model, lb, labels=False)
    for h in handles:
        h.remove()
    recorded = recorder.picks
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
        if n in recorded.indices:
            picks = recorded.indices[n]
            tokens = recorded.tokens
            if tokens is None:  # every token, in order
                tokens = torch.arange(picks.shape[0], device=picks.device)
            entry["tokens"] = tokens.cpu()
            entry["picks"] = picks.cpu()
        out[n] = entry
    return out


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
                    row["layers"][n] = compare_layer(
                        ref["layers"][n],
                        mine_n,
                        cu,
                        batch=batch,
                        seq=args.seq,
                        topk=args.topk,
                        device=args.device,
                    )
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
        captured.append((mod, *(call_arg(a, kw, n) for n in ("query", "x", "qr"))))

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
