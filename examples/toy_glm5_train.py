"""Train a toy GLM-5-like DSA model with megatron-core under the four dsa-precision configurations.

2 decoder layers, hidden 1024, MLA with kv_lora_rank 512 (absorbed DSA attention), DSA indexer
32 heads x 128, a mixture of experts in every layer (Megatron's ``MoELayer``: 8 routed experts,
top-2 softmax routing, one shared expert, the allgather token dispatcher, EP = 1; ``--mlp dense``
for the dense MLP of the earlier measurements), random weights, TP = PP = 1, Megatron's own
PyTorch indexer and sparse attention
(``dsa_kernel_backend="none"``) or, ``--kernel-backend cudnn``, its fused kernels (cuDNN's BF16
indexer and FlashMLA's sparse attention, which must be installed: ``tools/flashmla.sh``; the FP8
configurations then score with the package and attend with FlashMLA), or ``--kernel-backend
tilelang``, its TileLang kernels (the lightning indexer and SparseMLA; tilelang 0.1.15 installed,
``bash tools/gpu_session.sh tilelang``; the FP8 configurations attend with SparseMLA on the
package's picks). ``bash tools/gpu_session.sh toy-backends`` runs the three at one S. The mock
data is a copy task (a random segment repeated), so the loss has somewhere to go. For every
configuration (baseline, rope_fp32, fp8, rope_fp32+fp8 -- the switches alone, its top-k from
CUDA graphs where ``dsa_indexer_cuda_graph``'s default "auto" takes them -- rope_fp32+fp8+eager
(``dsa_indexer_cuda_graph=False``), on CUDA rope_fp32+fp8+graph (``True``), and ``replay``:
rope_fp32+fp8's picks handed in, captured untimed before each step, so the step runs no indexer,
the bound of any) it trains
``--steps`` steps from the same initial
weights and data and reports, side by side: the losses, the median step time, the indexer's time
per step (its top-k of both layers, measured alone on the step's inputs) and its share, and the
scoring calls that ran in FP8 (and on the cuDNN kernel). The configurations train interleaved
(step i of each in turn), so drift of the host or the clocks falls on all of them alike, and a
profile of a few steps gives each one's GPU kernel time per step beside its wall time. It then
checks that on identical inputs FP8 scoring selects a different top-k than BF16, that a
top-k-sharing variant trains, and that the
default configuration trains bit-identically to stock Megatron modules.

``--packed N`` trains on packed (THD) micro-batches of N uneven sequences instead.

GPU (see docs/megatron.md):  python examples/toy_glm5_train.py --out $OUT/toy.json
                             python examples/toy_glm5_train.py --seq 8192 --topk 2048 --steps 10
CPU smoke test:              python examples/toy_glm5_train.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import statistics
import time
import unittest.mock

import flag_checks as fc
import torch

CONFIGS = {
    "baseline": dict(),
    "rope_fp32": dict(dsa_indexer_rope_fp32=True),
    "fp8": dict(dsa_indexer_scoring_precision="fp8"),
    # The two switches and nothing else: the owned top-k from CUDA graphs where
    # dsa_indexer_cuda_graph's default "auto" takes them (CUDA, up to AUTO_GRAPH_MAX_ROWS rows).
    "rope_fp32+fp8": dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8"),
    # The same, always eager.
    "rope_fp32+fp8+eager": dict(
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_cuda_graph=False,
    ),
    # The same, always from CUDA graphs (CUDA only).
    "rope_fp32+fp8+graph": dict(
        dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8", dsa_indexer_cuda_graph=True
    ),
    # The bound of any indexer: rope_fp32+fp8's picks handed in (dsa_indexer_topk_source=
    # "replay", captured before each step, untimed), so the step runs no indexer at all.
    "replay": dict(
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_topk_source="replay",
    ),
    # rope_fp32+fp8 computing its own picks and taking the engine's for the rows the engine
    # sends (dsa_indexer_topk_source="replay_ties"): every row's digest of the engine model's
    # picks and the picks of --tie-share of the rows (an engine sends its boundary-tied rows;
    # the toy's rarely tie, so a share is sent to time the merge at a realistic payload).
    "rope_fp32+fp8+ties": dict(
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_topk_source="replay_ties",
    ),
}
GRAPHED = {name for name, fields in CONFIGS.items() if fields.get("dsa_indexer_cuda_graph")}
REPLAYED = {
    name
    for name, fields in CONFIGS.items()
    if fields.get("dsa_indexer_topk_source") in ("replay", "replay_ties")
}


# Model options other scripts' argument namespaces may lack (tools/, replay_verify.py, the parity
# runs): model_config reads them from here when absent.
MODEL_DEFAULTS = dict(attention_heads=16, kernel_backend="none", mlp="moe", bridge=False)
MLPS = ("moe", "dense")

# --packed N: the THD packing of the toy's (1, T) batches, by their shape: position ids and
# Megatron's PackedSeqParams (set once by _run; call_model reads it).
PACKINGS: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}


def packing_weights(n: int) -> tuple[int, ...]:
    """The relative lengths of ``--packed n``'s sequences: 4 : 1 : 3 : 2, repeated."""
    return tuple((4, 1, 3, 2)[i % 4] for i in range(n))


def set_packing(total: int, n: int, device: str) -> list[int]:
    """Register the THD packing of ``n`` sequences for batches of shape ``(1, total)``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsa_precision.cli.bench_config import thd_lengths

    # n uneven sequences in proportion 4 : 1 : 3 : 2 (repeated), as the benchmarks pack them
    lens = thd_lengths(total, packing_weights(n))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n_) for n_ in lens]).view(1, -1).to(device)
    cu = cu.to(device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))  # fmt: skip
    PACKINGS[(1, total)] = (pos, psp)
    return lens


def call_model(model, tokens: torch.Tensor, **kwargs):
    """``model`` on ``tokens``: BSHD positions, or the registered THD packing of their shape."""
    packing = PACKINGS.get(tuple(tokens.shape))
    if packing is None:
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).expand(b, s)
        return model(tokens, pos, None, **kwargs)
    pos, psp = packing
    return model(tokens, pos, None, packed_seq_params=psp, **kwargs)


def packed_params(tokens: torch.Tensor):
    """The registered ``PackedSeqParams`` of ``tokens``' shape, or ``None`` (BSHD)."""
    packing = PACKINGS.get(tuple(tokens.shape))
    return None if packing is None else packing[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--share-steps", type=int, default=3, help="steps of the top-k-sharing variant")
    p.add_argument(
        "--stock-steps", type=int, default=3, help="steps of the default-vs-stock check (0: skip)"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument(
        "--engine", default="vllm", help="dsa_indexer_engine of the FP8 runs (default vllm)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--packed",
        type=int,
        default=0,
        help="N > 0: each batch is one packed (THD) micro-batch of N sequences of uneven lengths "
        "(4 : 1 : 3 : 2) summing to --seq, Megatron's PackedSeqParams (needs --batch 1; the "
        "replay configuration is left out)",
    )
    p.add_argument(
        "--tie-share",
        type=float,
        default=0.02,
        help="rope_fp32+fp8+ties: the share of each sequence's rows whose engine picks are sent "
        "(default 0.02, the boundary-tied share measured at S >= 32768 with vLLM's kernels)",
    )
    p.add_argument(
        "--attention-heads",
        type=int,
        default=MODEL_DEFAULTS["attention_heads"],
        help="attention heads (Megatron's unfused sparse attention holds B x heads x S x S "
        "float32 scores and their softmax per layer: at S = 32768 on one H200, 2 fit, 4 do not)",
    )
    p.add_argument(
        "--kernel-backend",
        choices=("none", "cudnn", "tilelang"),
        default=MODEL_DEFAULTS["kernel_backend"],
        help="Megatron's dsa_kernel_backend (cudnn: its fused indexer and FlashMLA's sparse "
        "attention, no S x S scores; needs flash_mla importable; tilelang: its TileLang "
        "indexer and SparseMLA; needs tilelang importable)",
    )
    p.add_argument(
        "--mlp",
        choices=MLPS,
        default=MODEL_DEFAULTS["mlp"],
        help="moe (default, the seed's model): Megatron's MoELayer, 8 routed experts (tiny 4), "
        "top-2, one shared expert; dense: one MLP of ffn_hidden_size",
    )
    p.add_argument(
        "--bridge",
        action="store_true",
        help="build the model through Megatron-Bridge from the toy's Hugging Face GLM-5 config "
        "(AutoBridge's GLM-5 provider, its MoE and TE's spec; examples/bridge_glm5.py); needs "
        "megatron-bridge and Transformer Engine",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--configs", default=None, help="comma-separated (default: all; on the CPU no graphs)"
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=3,
        help="steps profiled per configuration for its GPU kernel time (0: skip; CUDA only)",
    )
    p.add_argument(
        "--host-steps",
        type=int,
        default=10,
        help="forwards and steps per configuration for the pkg host and in-step times (0: skip)",
    )
    p.add_argument(
        "--top-kernels",
        type=int,
        default=0,
        help="print each configuration's N kernels with the most device time in its profile",
    )
    p.add_argument(
        "--manual-gc",
        type=int,
        default=None,
        metavar="INTERVAL",
        help="Python's garbage collector off during training, a collection every INTERVAL steps "
        "between timed steps (0: none), as Megatron's --manual-gc / --manual-gc-interval and "
        "Megatron-Bridge's recipes (manual_gc=True, interval 100) train; default: automatic",
    )
    p.add_argument("--tiny", action="store_true", help="small model and sequence (smoke test)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    check(p, args)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that cannot run refused with one line (exit status 2), before anything is built;
    ``--tiny``'s sequence and the default ``--configs`` filled in."""
    if args.kernel_backend != "none" and args.stock_steps:
        p.error(
            f"--stock-steps {args.stock_steps} compares the default fields with stock Megatron "
            f"bit for bit after updates, which Megatron's fused backward (--kernel-backend "
            f"{args.kernel_backend}: atomic adds) does not reproduce run to run; pass "
            f"--stock-steps 0 with it"
        )
    if args.steps < 2:
        p.error(f"--steps {args.steps}: give a count >= 2 (the run checks that the loss decreased)")
    fc.check_counts(p, args, dict(
        share_steps=0, stock_steps=0, seq=1, topk=1, batch=1, packed=0, attention_heads=1,
        profile_steps=0, host_steps=0, top_kernels=0, manual_gc=0,
    ))  # fmt: skip
    fc.check_lr(p, args.lr)
    if not 0 <= args.tie_share <= 1:
        p.error(f"--tie-share {args.tie_share}: give a share of rows in [0, 1]")
    fc.check_engine(p, args.engine)
    args.device = fc.check_device(p, args.device)
    fc.check_output(p, "out", args.out)
    if args.tiny and args.seq == 2048:
        args.seq = 256
    if args.configs is None:
        names = [n for n in CONFIGS if args.device != "cpu" or n not in GRAPHED]
        names = [n for n in names if not args.packed or n not in REPLAYED]
        args.configs = ",".join(names)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            p.error(f"--configs: unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        if name in GRAPHED and args.device == "cpu":
            p.error(f"--configs: {name} replays CUDA graphs; leave it out on the CPU")
    if args.kernel_backend != "none":
        if args.device == "cpu":
            p.error(f"--kernel-backend {args.kernel_backend} runs Megatron's fused CUDA kernels; "
                    f"pass --kernel-backend none with --device cpu")  # fmt: skip
        try:  # Megatron's own check of the fused kernels' packages (megatron-core >= 0.16)
            from megatron.core.utils import _validate_dsa_kernel_backend_dependencies
        except ImportError:
            pass
        else:
            try:
                _validate_dsa_kernel_backend_dependencies(args.kernel_backend)
            except ValueError as exc:
                p.error(f"--kernel-backend {args.kernel_backend}: {exc}")
    if args.bridge and (missing := fc.missing_modules("megatron.bridge", "transformer_engine")):
        p.error(f"--bridge builds the model with Megatron-Bridge and Transformer Engine; "
                f"{' and '.join(missing)} cannot be imported here")  # fmt: skip
    if args.packed:
        if args.batch != 1 or set(args.configs.split(",")) & REPLAYED or args.stock_steps:
            p.error(
                f"--packed {args.packed}: pass --batch 1, --stock-steps 0 and no replay "
                f"configuration (got --batch {args.batch}, --stock-steps {args.stock_steps}, "
                f"--configs {args.configs})"
            )
        from dsa_precision.cli.bench_config import thd_lengths

        try:
            thd_lengths(args.seq, packing_weights(args.packed))
        except ValueError:
            p.error(f"--packed {args.packed}: {args.seq} tokens (--seq) leave an empty sequence "
                    f"among {args.packed} in proportion 4:1:3:2; pass fewer sequences or a "
                    f"larger --seq")  # fmt: skip


def moe_fields(tiny: bool) -> dict:
    """The mixture of experts of the seed's model, in every layer: Megatron's ``MoELayer``
    (``num_moe_experts`` makes the layer spec's MLP one), routed experts of
    ``moe_ffn_hidden_size`` plus one shared expert, so that the two routed and the shared expert
    a token runs hold as many FFN units as the dense MLP (``ffn_hidden_size``). Top-2 softmax
    routing, no load-balancing loss (the toy's loss is the LM loss alone), no token dropping;
    the allgather dispatcher runs with EP = 1 on one GPU and on the CPU (the alltoall one opens a
    CUDA stream when built). Each token's output sums exactly two routed experts, an order-free
    float sum, so the MoE adds nothing run-to-run variable on a GPU either."""
    return dict(
        num_moe_experts=4 if tiny else 8,
        moe_router_topk=2,
        moe_ffn_hidden_size=128 if tiny else 704,
        moe_shared_expert_intermediate_size=256 if tiny else 1408,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )


def model_config(args, **overrides):
    """The toy's config for ``args`` (``tiny``, ``device``, ``topk``, ``engine``; the options of
    :data:`MODEL_DEFAULTS` where given, ``mlp`` among them: ``"moe"``, the seed's model, unless
    told ``"dense"``), with ``overrides`` of any field."""
    import dsa_precision.megatron as dsap

    opts = {**MODEL_DEFAULTS, **vars(args)}
    if opts["bridge"]:
        return bridge_config(args, kernel_backend=opts["kernel_backend"], **overrides)
    if opts["mlp"] not in MLPS:
        raise ValueError(f"mlp={opts['mlp']!r}: the toy's MLP is one of {MLPS}.")
    tiny = args.tiny
    fields = dict(
        num_layers=2,
        hidden_size=256 if tiny else 1024,
        ffn_hidden_size=512 if tiny else 2816,
        num_attention_heads=4 if tiny else opts["attention_heads"],
        q_lora_rank=128 if tiny else 512,
        kv_lora_rank=64 if tiny else 512,
        qk_head_dim=64 if tiny else 128,
        qk_pos_emb_head_dim=64,
        v_head_dim=64 if tiny else 128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,  # DeepSeek-V3.2 / GLM-5's; the indexer k_norm eps vLLM hard-codes
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=args.device == "cpu",
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rope_type="rope",
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=32,
        dsa_indexer_head_dim=128,
        dsa_indexer_topk=32 if tiny else args.topk,
        dsa_indexer_loss_coeff=0.0,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_engine=args.engine,
        dsa_kernel_backend=opts["kernel_backend"],
        **(moe_fields(tiny) if opts["mlp"] == "moe" else {}),
    )
    fields.update(overrides)
    return dsap.DSAPrecisionTransformerConfig(**fields)


def bridge_config(args, *, kernel_backend: str, **overrides):
    """The toy's model as Megatron-Bridge builds it: ``AutoBridge.from_hf_config`` of the toy's
    GLM-5 config (``bridge_glm5.toy_hf_config``), one GPU's settings, the Megatron ``overrides``
    set on the provider and the dsa-precision ones through ``dsa_precision_provider``; finalized."""
    from bridge_glm5 import one_gpu, toy_hf_config
    from megatron.bridge import AutoBridge

    from dsa_precision.megatron.bridge import dsa_precision_provider
    from dsa_precision.megatron.config import PRECISION_FIELDS

    provider = AutoBridge.from_hf_config(
        toy_hf_config(args.seq, args.topk, args.tiny)
    ).to_megatron_provider(load_weights=False)
    one_gpu(provider, args.seq)
    provider.dsa_kernel_backend = kernel_backend
    precision = {k: v for k, v in overrides.items() if k in PRECISION_FIELDS}
    for name, value in overrides.items():
        if name not in precision:
            setattr(provider, name, value)
    provider = dsa_precision_provider(provider, **{"dsa_indexer_engine": args.engine, **precision})
    provider.finalize()
    return provider


def _bridge_model(args, provider, stock: bool):
    """The Bridge provider's model (``stock``: the provider's own layer spec, Megatron's DSA
    modules: the Bridge's stock model), BF16 parameters as the toy's."""
    import dataclasses

    from megatron.bridge.models.mla_provider import MLAModelProvider

    if stock:
        names = [f.name for f in dataclasses.fields(MLAModelProvider) if f.init]
        provider = MLAModelProvider(**{name: getattr(provider, name) for name in names})
        provider.transformer_layer_spec = provider.transformer_layer_spec.spec  # the Bridge's own
        provider.finalize()
    (model,) = provider.provide_distributed_model(
        wrap_with_ddp=False,
        mixed_precision_wrapper=None,
        use_cpu_initialization=args.device == "cpu",
    )
    return model.to(args.device).bfloat16(), provider.vocab_size


def build_model(args, config, *, stock: bool = False):
    """GPT model with the precision DSA modules (or, ``stock``, Megatron's own), seeded."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    import dsa_precision.megatron as dsap

    torch.manual_seed(args.seed)
    if args.device != "cpu":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    if {**MODEL_DEFAULTS, **vars(args)}["bridge"]:
        return _bridge_model(args, config, stock)
    spec = dsap.get_gpt_dsa_precision_block_spec(config)
    if stock:
        spec = _unswap(spec)
    vocab = 512 if args.tiny else 4096
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    # BF16 parameters throughout (norms included), as Megatron's Float16Module leaves them.
    return model.to(args.device).bfloat16(), vocab


def _unswap(spec):
    """The same spec with Megatron's DSAttention / DSAIndexer (the stock modules)."""
    import dataclasses

    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    import dsa_precision.megatron as dsap

    back = {dsap.PrecisionDSAttention: DSAttention, dsap.PrecisionDSAIndexer: DSAIndexer}

    def walk(node):
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(
                node, module=back.get(node.module, node.module), submodules=walk(node.submodules)
            )
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(
                node, **{f.name: walk(getattr(node, f.name)) for f in dataclasses.fields(node)}
            )
        if isinstance(node, list | tuple):
            return type(node)(walk(n) for n in node)
        return back.get(node, node) if isinstance(node, type) else node

    return walk(spec)


def copy_task(args, vocab: int, steps: int):
    """Random segments over a 256-token sub-vocabulary, repeated to the sequence length: the
    first copy teaches the unigram statistics, the repeats reward attending to earlier keys."""
    g = torch.Generator().manual_seed(args.seed + 1)
    seg = 64 if args.tiny else 256
    sub_vocab = min(vocab, 256)
    batches = []
    for _ in range(steps):
        motif = torch.randint(0, sub_vocab, (args.batch, seg), generator=g)
        tokens = motif.repeat(1, args.seq // seg + 1)[:, : args.seq + 1]
        batches.append((tokens[:, :-1].to(args.device), tokens[:, 1:].to(args.device)))
    return batches


class Trainer:
    """AdamW on FP32 master copies of the BF16 parameters."""

    def __init__(self, model, lr: float):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def step(self, tokens, labels) -> float:
        loss = self.forward(tokens, labels)
        self.backward(loss)
        self.update()
        return loss.item()

    def forward(self, tokens, labels) -> torch.Tensor:
        return call_model(self.model, tokens, labels=labels).float().mean()

    def backward(self, loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        loss.backward()

    def update(self) -> None:
        """The optimizer step on the FP32 masters, copied back into the BF16 parameters."""
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)


def timed(fn, device):
    if device == "cpu":
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end)


# DSAttention.forward(query, key, value, attention_mask, x, qr, ...): positions of the inputs.
_POSITION = {"query": 0, "x": 4, "qr": 5}


def call_arg(args: tuple, kwargs: dict, name: str):
    """Argument ``name`` of a DSAttention forward call, by keyword or position."""
    return kwargs[name] if name in kwargs else args[_POSITION[name]]


def indexer_ms(args, model, tokens) -> tuple[float | None, float | None]:
    """The indexer's top-k of every layer, timed alone (median of 5) on the step's inputs:
    ``(ms of all layers, host ms per layer)``; the host time is until the calls return, the
    device idle before them (the package's owned top-k, or Megatron's own indexer; ``None``
    for Megatron's fused kernels, which do not run it alone)."""
    captured = []
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    if model.config.dsa_kernel_backend != "none" and not all(core.owns_topk() for core in cores):
        # Megatron's fused kernels score, select and attend in one call: its indexer cannot be
        # timed alone (DSAIndexer.forward is the PyTorch path, S x heads x S float32 scores).
        return None, None

    def hook(mod, a, kw):
        captured.append((mod, *(call_arg(a, kw, n) for n in ("query", "x", "qr"))))

    handles = [core.register_forward_pre_hook(hook, with_kwargs=True) for core in cores]
    with torch.no_grad():
        call_model(model, tokens)
    for h in handles:
        h.remove()

    def run():
        with torch.no_grad():
            for core, query, x, qr in captured:
                psp = packed_params(tokens)
                if core.owns_topk():
                    core.compute_topk(query, x, qr, psp)
                elif core.indexer is not None:  # Megatron's own scoring and top-k
                    core.indexer(x, qr, packed_seq_params=psp)

    times = [timed(run, args.device)[1] for _ in range(6)]
    hosts = []
    for _ in range(6):  # the host part alone: until the calls return, the device idle before
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        hosts.append(time.perf_counter() - t0)
    times, hosts = sorted(times[1:]), sorted(hosts[1:])
    return times[len(times) // 2], hosts[len(hosts) // 2] * 1e3 / len(captured)


ENGINE = CONFIGS["rope_fp32+fp8"]


def handed_in(engine, model, tokens, tie_share: float | None = None):
    """For a replaying configuration (``engine`` is its picks' model), a context that hands
    ``engine``'s picks of ``tokens`` on ``model``'s weights at this call to the forwards inside it;
    otherwise a no-op. The picks are captured when this is called, outside the timed step. With
    ``tie_share`` (``replay_ties``): every row's digest and the picks of that share of each
    sequence's rows (every ``round(1 / tie_share)``-th row) instead of every row's picks."""
    if engine is None:
        return contextlib.nullcontext()
    import dsa_precision.megatron as dsap

    picks, seq = engine_picks(engine, model, tokens), tokens.shape[1]
    if tie_share is None:
        return dsap.engine_topk(picks, seq_len=seq)
    return dsap.engine_topk(tie_rows(picks, [seq] * tokens.shape[0], tie_share, seq_len=seq))


def tie_share(args, name: str) -> float | None:
    """``--tie-share`` for a ``replay_ties`` configuration, else ``None``."""
    ties = CONFIGS[name].get("dsa_indexer_topk_source") == "replay_ties"
    return args.tie_share if ties else None


def tie_rows(
    picks: dict[int, torch.Tensor],
    lengths: list[int],
    share: float,
    seq_len: int | None = None,
):
    """``picks`` (layer -> ``(T, k)``, the sequences of ``lengths`` one after the other) as the
    tie replay's payload: per sequence, every row's digest and the picks of every
    ``round(1 / share)``-th row (none for ``share`` 0); ``seq_len`` for a BSHD micro-batch."""
    from dsa_precision.capture import TieRows, digest_rows, pack_tie_rows

    frames, start = [], 0
    for n_rows in lengths:
        stride = round(1 / share) if share > 0 else n_rows + 1
        frame = {}
        for n, idx in picks.items():
            rows = idx[start : start + n_rows]
            sent = torch.arange(stride - 1, n_rows, stride, device=rows.device)
            frame[n] = TieRows(digest_rows(rows), sent, rows[sent].to(torch.int32))
        frames.append(frame)
        start += n_rows
    return pack_tie_rows(frames, lengths, seq_len=seq_len)


def engine_picks(engine, model, tokens) -> dict[int, torch.Tensor]:
    """Every layer's picks of a no-grad forward of ``engine`` (a model built with the engine's
    fields: the precision fields of a built model are frozen) on ``model``'s current weights, as
    engine indices ``(batch * S, k)``, tokens batch-major."""
    import dsa_precision.megatron as dsap

    engine.load_state_dict(model.state_dict())
    with torch.no_grad(), dsap.record_topk() as recorder:
        call_model(engine, tokens)
    return dict(recorder.picks.indices)


def gpu_busy_ms(trainer, batch, steps: int, top: int = 0) -> tuple[float, list]:
    """GPU kernel time of one step (median-free mean over ``steps`` profiled steps): what the step
    costs the device, whatever the host's Python overhead around it; and the ``top`` kernels
    with the most of it, ``[(name, ms per step, launches per step)]``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.step(*batch)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time / 1e3 / steps
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    table = [(name, ms, count // steps) for name, (ms, count) in ranked]
    return sum(e.device_time for e in kernels) / 1e3 / steps, table


def package_host_ms(trainer, batch, steps: int, forwards: int, by_function=None) -> float:
    """The package's own host time per DSA layer forward, in ms: the time on the host in
    ``dsa_precision`` frames (``examples/host_time.py``: its Python, checks and kernel
    launches; Megatron's frames behind the seam not counted) over ``steps`` forwards of the
    training step (autograd on, no backward) of ``forwards`` DSA layer forwards each, monitored
    with ``sys.monitoring`` (one callback per package or Megatron frame, left out of the time).
    ``by_function``, if given, gains each package function's own ms of it per layer forward."""
    from host_time import package_host_seconds

    tokens, labels = batch
    split: dict[str, float] = {}
    total = 0.0
    for _ in range(steps):
        _, seconds = package_host_seconds(
            lambda: call_model(trainer.model, tokens, labels=labels), by_function=split
        )
        total += seconds
    scale = 1e3 / (steps * forwards)
    if by_function is not None:
        for name, seconds in split.items():
            by_function[name] = by_function.get(name, 0.0) + seconds * scale
    return total * scale


def topk_host_in_step_ms(trainer, batch, steps: int) -> float | None:
    """Host ms per call of the layers' owned top-k (``compute_topk``) inside ``steps`` training
    steps, untraced (a clock around each call; the device busy with the step, unlike the
    ``indexer_ms`` timing). ``None`` for a configuration whose layers own no top-k computation."""
    cores = [layer.self_attention.core_attention for layer in trainer.model.decoder.layers]
    cores = [c for c in cores if c.owns_topk() and c.topk_source != "replay"]
    if not cores:
        return None
    spent = []

    def timed_topk(fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent.append(time.perf_counter() - t0)
            return out

        return call

    for core in cores:  # an instance attribute of the package's own modules, removed below
        core.compute_topk = timed_topk(core.compute_topk)
    try:
        for _ in range(steps):
            trainer.step(*batch)
    finally:
        for core in cores:
            del core.compute_topk
    return statistics.median(spent) * 1e3 if spent else None


def attention_host_in_step_ms(trainer, batch, steps: int) -> float:
    """Host ms per call of the DSA core attention's forward (every layer: the indexer, the
    top-k and Megatron's sparse attention) inside ``steps`` training steps, untraced (a clock
    between a forward pre-hook and a forward hook), for every configuration alike."""
    cores = [layer.self_attention.core_attention for layer in trainer.model.decoder.layers]
    spent, started = [], []

    def pre(*_):
        started.append(time.perf_counter())

    def post(*_):
        spent.append(time.perf_counter() - started.pop())

    handles = [c.register_forward_pre_hook(pre) for c in cores]
    handles += [c.register_forward_hook(post) for c in cores]
    try:
        for _ in range(steps):
            trainer.step(*batch)
    finally:
        for h in handles:
            h.remove()
    return statistics.median(spent) * 1e3


@contextlib.contextmanager
def manual_gc(interval: int | None):
    """Megatron's ``--manual-gc``: Python's collector off inside, one collection on entry, and
    ``collect(step)`` collects when ``step`` is a multiple of ``interval`` (called between timed
    steps). ``interval=None``: the automatic collector, ``collect`` does nothing."""
    if interval is None:
        yield lambda step: None
        return

    def collect(step: int) -> None:
        if interval and step % interval == 0:
            gc.collect()

    gc.disable()
    gc.collect()
    try:
        yield collect
    finally:
        gc.enable()


def train(args, names: list[str]) -> list[dict]:
    """Train every configuration from the same weights and data, steps interleaved (step i of
    each configuration in turn), so that drift of the host or the clocks spreads evenly."""
    from dsa_precision import reset_scoring_calls, scoring_calls

    runs = []
    for name in names:
        config = model_config(args, **CONFIGS[name])
        model, vocab = build_model(args, config)
        # A replaying configuration's picks come from a model of rope_fp32+fp8's fields.
        engine = build_model(args, model_config(args, **ENGINE))[0] if name in REPLAYED else None
        runs.append(
            dict(name=name, model=model, trainer=Trainer(model, args.lr), vocab=vocab,
                 engine=engine, tie_share=tie_share(args, name), losses=[], times=[],
                 calls=dict(fp8=0, fp8_cudnn=0, total=0))
        )  # fmt: skip
    data = copy_task(args, runs[0]["vocab"], args.steps)
    with manual_gc(args.manual_gc) as collect:
        for i, (tokens, labels) in enumerate(data, 1):
            for run in runs:
                # captured here, untimed
                picks = handed_in(run["engine"], run["model"], tokens, run["tie_share"])
                collect(i)
                if args.device != "cpu":  # every step starts on an idle device (not behind the
                    torch.cuda.synchronize()  # capture's forward, which would hide host time)
                reset_scoring_calls()
                step = functools.partial(run["trainer"].step, tokens, labels)
                with picks:
                    loss, ms = timed(step, args.device)
                run["losses"].append(loss)
                run["times"].append(ms)
                for key, count in (
                    ("fp8", scoring_calls("fp8")),
                    ("fp8_cudnn", scoring_calls("fp8", "cudnn")),
                    ("total", scoring_calls()),
                ):
                    run["calls"][key] += count
    results = []
    # Every configuration's host times before any profile runs (torch.profiler's CUDA activity
    # tracing, CUPTI, can leave later launches slower).
    for run in runs:
        model, engine, share = run["model"], run["engine"], run["tie_share"]
        # A replaying configuration's indexer is not timed alone (replay runs none).
        run["index_ms"] = run["topk_host_ms"] = None
        if engine is None:
            run["index_ms"], run["topk_host_ms"] = indexer_ms(args, model, data[0][0])
        run["host_ms"] = run["in_step_ms"] = run["attention_in_step_ms"] = None
        if args.host_steps:
            with handed_in(engine, model, data[-1][0], share):
                layers = len(model.decoder.layers)
                trainer, batch = run["trainer"], data[-1]
                run["host_ms"] = package_host_ms(trainer, batch, args.host_steps, layers)
                run["in_step_ms"] = topk_host_in_step_ms(trainer, batch, args.host_steps)
                run["attention_in_step_ms"] = attention_host_in_step_ms(
                    trainer, batch, args.host_steps
                )
    for run in runs:
        name, model, losses, engine = run["name"], run["model"], run["losses"], run["engine"]
        share = run["tie_share"]
        index_ms, topk_host_ms = run["index_ms"], run["topk_host_ms"]
        host_ms, in_step_ms = run["host_ms"], run["in_step_ms"]
        attention_ms = run["attention_in_step_ms"]
        busy, kernels = None, []
        if args.device != "cpu" and args.profile_steps:
            with handed_in(engine, model, data[-1][0], share):
                busy, kernels = gpu_busy_ms(
                    run["trainer"], data[-1], args.profile_steps, args.top_kernels
                )
        del run["model"], run["trainer"], run["engine"], model
        share_losses = []
        if engine is None and args.share_steps:  # index sharing: layer 2 reuses layer 1's
            # top-k (Megatron's rule)
            share_model, _ = build_model(
                args, model_config(args, dsa_indexer_topk_freq=2, **CONFIGS[name])
            )
            share_trainer = Trainer(share_model, args.lr)
            share_losses = [
                share_trainer.step(t, y) for t, y in copy_task(args, run["vocab"], args.share_steps)
            ]
            del share_model, share_trainer
        del engine
        finite = all(math.isfinite(x) for x in losses + share_losses)
        steady = run["times"][3:] or run["times"]
        step_ms = sorted(steady)[len(steady) // 2]
        results.append(
            dict(
                name=name,
                losses=losses,
                first_loss=losses[0],
                last_loss=losses[-1],
                loss_decreased=bool(losses[-1] < losses[0]),
                finite=finite,
                step_ms_median=step_ms,
                gpu_busy_ms=busy,
                top_kernels=kernels,
                host_outside_gpu_ms=None if busy is None else step_ms - busy,
                package_host_ms_per_layer_forward=host_ms,
                topk_host_ms_per_layer=topk_host_ms,
                topk_host_ms_in_step=in_step_ms,
                attention_host_ms_in_step=attention_ms,
                indexer_ms=index_ms,
                indexer_share=None if index_ms is None else index_ms / step_ms,
                scoring_calls=run["calls"],
                index_share_losses=share_losses,
                steps=len(losses),
            )
        )
    return results


def topk_on_identical_inputs(args) -> dict:
    """Layer-1 top-k of every configuration on the same weights and batch."""
    from dsa_precision import IndexerPrecisionConfig, indexer_select, topk_agreement

    picks = {}
    names = [n for n in args.configs.split(",") if n not in REPLAYED]
    for name in names:
        config = model_config(args, **CONFIGS[name])
        model, vocab = build_model(args, config)
        core = model.decoder.layers[0].self_attention.core_attention
        tokens, _ = copy_task(args, vocab, 1)[0]
        captured = {}

        def hook(_mod, a, kw, captured=captured):
            captured.update({n: call_arg(a, kw, n) for n in ("query", "x", "qr")})

        handle = core.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            model(
                tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None
            )
            if core.owns_topk():
                picks[name] = core.compute_topk(
                    captured["query"], captured["x"], captured["qr"], None
                )
            else:  # BF16 scoring of what the indexer hands Megatron, by the package
                q, k, w = core.indexer.forward_before_topk(captured["x"], captured["qr"])
                picks[name] = indexer_select(
                    q.transpose(0, 1),
                    k.transpose(0, 1),
                    w.transpose(0, 1),
                    topk=config.dsa_indexer_topk,
                    config=IndexerPrecisionConfig(scoring_precision="bf16"),
                )
        handle.remove()
        del model
    out = {}
    for name in names:
        if name == "baseline" or "baseline" not in picks:
            continue
        out[f"{name}_vs_baseline"] = topk_agreement(picks[name], picks["baseline"]).as_dict()
    return out


def stock_equivalence(args, steps: int = 3) -> dict:
    """Default configuration vs stock Megatron modules, PyTorch DSA backend, same everything."""
    overrides = dict(dsa_indexer_rotate_activation=False)
    losses = {}
    grads = {}
    for stock in (False, True):
        config = model_config(args, **overrides)
        model, vocab = build_model(args, config, stock=stock)
        trainer = Trainer(model, args.lr)
        run = []
        for tokens, labels in copy_task(args, vocab, steps):
            run.append(trainer.step(tokens, labels))
        losses[stock] = run
        grads[stock] = [p.grad.detach().clone() for p in trainer.params if p.grad is not None]
        del model, trainer
    same_grads = len(grads[False]) == len(grads[True]) and all(
        torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True)
    )
    return dict(
        losses_ours=losses[False],
        losses_stock=losses[True],
        bit_identical_losses=losses[False] == losses[True],
        bit_identical_grads=bool(same_grads),
    )


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def main() -> int:
    args = parse()
    if args.device != "cpu":
        return _run(args)
    # Megatron's RotaryEmbedding places its buffers on torch.cuda.current_device(): on the CPU,
    # for this run only.
    with unittest.mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The run of the flags :func:`parse` checked (and filled in)."""
    if args.packed:
        args.packed_lengths = set_packing(args.seq, args.packed, args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)

    results = {"mlp": args.mlp, "packed_lengths": getattr(args, "packed_lengths", None),
               "manual_gc": args.manual_gc,
               "runs": train(args, args.configs.split(","))}  # fmt: skip
    by_name = {r["name"]: r for r in results["runs"]}
    # Megatron's fused kernels are not deterministic in the backward (cuDNN's SM90 sparse
    # attention backward atomic-adds into dKV), so after the first update two runs of one
    # configuration already differ: there only the first step's loss (the forward from the same
    # weights) can be compared bit for bit.
    compared = slice(None) if args.kernel_backend == "none" else slice(0, 1)
    results["losses_compared"] = "all" if args.kernel_backend == "none" else "first"
    for other, key in (("rope_fp32+fp8+graph", "graph"), ("rope_fp32+fp8+eager", "eager"),
                       ("replay", "replay"), ("rope_fp32+fp8+ties", "ties")):  # fmt: skip
        if {"rope_fp32+fp8", other} <= set(by_name):
            results[f"{key}_losses_identical"] = (
                by_name["rope_fp32+fp8"]["losses"][compared] == by_name[other]["losses"][compared]
            )
    # (BSHD only: its BF16 side scores what the indexer hands Megatron as one sequence.)
    results["topk_identical_inputs"] = {} if args.packed else topk_on_identical_inputs(args)
    if args.stock_steps:
        results["stock_equivalence"] = stock_equivalence(args, args.stock_steps)

    base = next((r for r in results["runs"] if r["name"] == "baseline"), None)
    collector = "automatic" if args.manual_gc is None else f"manual (every {args.manual_gc} steps)"
    layout = f"packed THD {args.packed_lengths}" if args.packed else f"BSHD batch {args.batch}"
    print(f"S={args.seq} ({layout}) top-k={args.topk if not args.tiny else 32} {args.device}, "
          f"engine {args.engine}, dsa_kernel_backend {args.kernel_backend}, MLP {args.mlp}, "
          f"Python GC {collector}; "
          f"median step of "
          f"{args.steps} (first 3 skipped), configurations interleaved step by step; GPU ms: "
          f"kernel time of a step (profiled); wall-GPU: the step's time outside its GPU time; "
          f"pkg host: the package's own host time per layer "
          f"per forward (host time in dsa_precision frames, sys.monitoring; target "
          f"<= 0.3 ms); top-k host: host ms per layer of the top-k alone, untraced, the device "
          f"idle (the owned top-k, or Megatron's indexer); in step: the owned top-k's host ms "
          f"per call inside training steps, untraced; attn in step: the same for the whole DSA "
          f"core attention forward (indexer, top-k, Megatron's sparse attention)")  # fmt: skip
    print(f"{'config':<21}{'loss[0]':>9}{'loss[-1]':>10}{'ms/step':>9}{'x base':>8}{'GPU ms':>8}"
          f"{'x base':>8}{'wall-GPU':>9}{'pkg host':>9}{'top-k host':>11}{'in step':>8}"
          f"{'attn in step':>13}{'indexer ms':>11}{'share':>7}{'fp8 calls':>10}"
          f"{'on cuDNN':>9}")  # fmt: skip
    for r in results["runs"]:
        ratio = base["step_ms_median"] / r["step_ms_median"] if base else float("nan")
        busy = r["gpu_busy_ms"]
        base_busy = base["gpu_busy_ms"] if base else None
        gpu_ratio = base_busy / busy if busy and base_busy else float("nan")
        outside = r["host_outside_gpu_ms"]
        host = r["package_host_ms_per_layer_forward"]
        c = r["scoring_calls"]
        print(f"{r['name']:<21}{r['first_loss']:>9.3f}{r['last_loss']:>10.3f}"
              f"{r['step_ms_median']:>9.1f}{ratio:>8.2f}"
              f"{_or_nan(busy):>8.1f}{gpu_ratio:>8.2f}{_or_nan(outside):>9.2f}{_or_nan(host):>9.3f}"
              f"{_or_nan(r['topk_host_ms_per_layer']):>11.3f}"
              f"{_or_nan(r['topk_host_ms_in_step']):>8.3f}"
              f"{_or_nan(r['attention_host_ms_in_step']):>13.3f}{_or_nan(r['indexer_ms']):>11.2f}"
              f"{_or_nan(r['indexer_share']):>7.1%}{c['fp8']:>10}{c['fp8_cudnn']:>9}")  # fmt: skip
    for r in results["runs"]:
        if r["top_kernels"]:
            print(f"{r['name']}: kernels with the most device time (ms per step, launches)")
        for name, ms, count in r["top_kernels"]:
            print(f"  {ms:9.2f} x{count:<4} {name[:100]}")
    for key, a in results["topk_identical_inputs"].items():
        print(f"top-k {key}: member agreement {a['member_agreement']:.4%}, rows identical "
              f"{a['rows_identical']:.2%}")  # fmt: skip
    which = "" if results["losses_compared"] == "all" else " (first step's: fused backward)"
    if "graph_losses_identical" in results:
        print(f"rope_fp32+fp8 (default) vs always from CUDA graphs: losses identical{which} "
              f"{results['graph_losses_identical']}")  # fmt: skip
    if "eager_losses_identical" in results:
        print(f"rope_fp32+fp8 (default) vs always eager: losses identical{which} "
              f"{results['eager_losses_identical']}")  # fmt: skip
    if "replay_losses_identical" in results:
        print(f"rope_fp32+fp8 with its picks handed in (replay) vs computed: losses "
              f"identical{which} {results['replay_losses_identical']}")  # fmt: skip
    if "ties_losses_identical" in results:
        print(f"rope_fp32+fp8 with {args.tie_share:.0%} of rows' picks handed in (replay_ties) vs "
              f"computed: losses identical{which} {results['ties_losses_identical']}")  # fmt: skip
    s = results.get("stock_equivalence")
    if s is not None:
        print(f"default vs stock Megatron: losses identical {s['bit_identical_losses']}, "
              f"grads identical {s['bit_identical_grads']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r["finite"] and r["loss_decreased"] for r in results["runs"])
    ok &= s is None or (s["bit_identical_losses"] and s["bit_identical_grads"])
    ok &= results.get("graph_losses_identical", True)
    ok &= results.get("replay_losses_identical", True)
    ok &= results.get("ties_losses_identical", True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
