"""A GLM-5 model from Megatron-Bridge with the dsa-precision switches, trained a step and exported.

``AutoBridge`` reads a Hugging Face GLM-5 (``glm_moe_dsa``) checkpoint -- or, without ``--hf``,
the config of the seed's toy GLM-5 (2 layers, hidden 1024, 8 routed experts, kv_lora_rank 512, 32
indexer heads, random weights) -- and returns its ``MLAModelProvider``;
``dsa_precision.megatron.bridge.dsa_precision_provider`` adds the switches and the precision
modules; the provider builds the model (Transformer Engine's spec where TE is installed), a few
steps train on random tokens, and ``--save`` writes the model back in Hugging Face format.

    python examples/bridge_glm5.py --rope-fp32 --fp8 --steps 3
    python examples/bridge_glm5.py --hf /path/to/GLM-5 --rope-fp32 --fp8 --save /tmp/out

Megatron-Bridge imports Transformer Engine, so this runs where TE is installed (a GPU machine);
see the README, "With Megatron-Bridge".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def toy_hf_config(seq: int = 2048, topk: int = 256, tiny: bool = False):
    """The seed's toy GLM-5 as a Hugging Face ``GlmMoeDsaConfig`` (``tiny``: a smaller one)."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        architectures=["GlmMoeDsaForCausalLM"],
        vocab_size=512 if tiny else 4096,
        hidden_size=256 if tiny else 1024,
        intermediate_size=512 if tiny else 2816,
        moe_intermediate_size=128 if tiny else 704,
        num_hidden_layers=2,
        first_k_dense_replace=0,  # a mixture of experts in every layer, as the toy
        num_attention_heads=4 if tiny else 16,
        num_key_value_heads=4 if tiny else 16,
        n_routed_experts=4 if tiny else 8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        q_lora_rank=128 if tiny else 512,
        kv_lora_rank=64 if tiny else 512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64 if tiny else 128,
        v_head_dim=64 if tiny else 128,
        head_dim=64,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=32 if tiny else topk,
        max_position_embeddings=max(seq, 1024),
        indexer_rope_interleave=True,  # GLM-5's config.json field, read by the Bridge
        dtype="bfloat16",
    )


def one_gpu(provider, seq: int) -> None:
    """Set the GLM-5 bridge's settings that need DeepEP / HybridEP or several GPUs for one GPU
    (the allgather dispatcher, no shared-expert overlap, no fused permutation), the indexer loss
    to 0 (FP8 scoring and replay train no indexer), gradients into ``.grad`` (no DDP wrapper),
    and ``rope_type="rope"``: a GLM-5 checkpoint's RoPE is plain (the bridge leaves YaRN with
    factor 1, which differs by rounding; see ``dsa_precision_provider``)."""
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_shared_expert_overlap = False
    provider.moe_permute_fusion = False
    provider.gradient_accumulation_fusion = False
    provider.dsa_indexer_loss_coeff = 0.0
    provider.dsa_indexer_use_sparse_loss = False
    provider.rope_type = "rope"
    provider.seq_length = seq


def _check_checkpoint(p: argparse.ArgumentParser, folder: Path) -> None:
    """``folder`` holds a GLM-5 checkpoint's ``config.json`` (``model_type`` glm_moe_dsa)."""
    config = folder / "config.json"
    try:
        fields = json.loads(config.read_text())
    except FileNotFoundError:
        p.error(f"--hf {folder}: no config.json; give a Hugging Face checkpoint's folder")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        p.error(f"--hf {folder}: config.json cannot be read ({' '.join(str(exc).split())[:200]})")
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type != "glm_moe_dsa":
        p.error(f"--hf {folder}: config.json has model_type {model_type!r}; this example reads "
                f"GLM-5 checkpoints ('glm_moe_dsa')")  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--hf",
        default=None,
        help="a Hugging Face GLM-5 checkpoint: its folder or Hub id (default: the toy)",
    )
    p.add_argument("--rope-fp32", action="store_true", help="dsa_indexer_rope_fp32=True")
    p.add_argument("--fp8", action="store_true", help="dsa_indexer_scoring_precision='fp8'")
    p.add_argument("--engine", default="vllm", help="dsa_indexer_engine (default vllm)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save", default=None, help="write the trained model here (Hugging Face)")
    args = p.parse_args(argv)
    # Refused with one line (exit status 2) before anything is imported or built.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import flag_checks as fc

    fc.check_counts(p, args, dict(seq=1, steps=0))
    fc.check_lr(p, args.lr)
    fc.check_engine(p, args.engine)
    if args.hf is not None:
        hf = Path(args.hf)
        if hf.exists() and not hf.is_dir():
            p.error(f"--hf {args.hf}: a file; give a Hugging Face checkpoint's folder")
        local = hf.is_absolute() or args.hf.startswith((".", "~")) or args.hf.count("/") != 1
        if not hf.exists() and local:  # not a folder here, nor a Hub id (org/name)
            p.error(f"--hf {args.hf}: no such folder; give a Hugging Face checkpoint's folder")
        if hf.is_dir():
            _check_checkpoint(p, hf)
    if args.save is not None:
        save = Path(args.save)
        if save.exists() and not save.is_dir():
            p.error(f"--save {args.save}: a file, not a folder")
        if not save.exists() and not save.parent.is_dir():
            p.error(f"--save {args.save}: its parent folder {save.parent} does not exist")
    if not torch.cuda.is_available():
        p.error("no CUDA device here: the example trains on one GPU (NCCL)")
    missing = fc.missing_modules("megatron.bridge", "transformer_engine", "transformers")
    if missing:
        p.error(f"{' and '.join(missing)} cannot be imported here; install Megatron-Bridge and "
                f"Transformer Engine (README, \"With Megatron-Bridge\")")  # fmt: skip
    return args


def main() -> int:
    args = parse()
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state, tensor_parallel

    from dsa_precision.megatron.bridge import dsa_precision_provider

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if args.hf:
        bridge = AutoBridge.from_hf_pretrained(args.hf)
        provider = bridge.to_megatron_provider(load_weights=True)
    else:
        bridge = AutoBridge.from_hf_config(toy_hf_config(args.seq))
        provider = bridge.to_megatron_provider(load_weights=False)
    one_gpu(provider, args.seq)
    provider = dsa_precision_provider(
        provider,
        dsa_indexer_rope_fp32=args.rope_fp32,
        dsa_indexer_scoring_precision="fp8" if args.fp8 else "bf16",
        dsa_indexer_engine=args.engine,
    )
    provider.finalize()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    (model,) = provider.provide_distributed_model(wrap_with_ddp=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    tokens = torch.randint(0, provider.vocab_size, (1, args.seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(args.seq, device="cuda")[None]
    for step in range(args.steps):
        logits = model(inputs, pos, None)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    if args.save:
        bridge.save_hf_pretrained([model], args.save)
        print(f"saved to {args.save}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
