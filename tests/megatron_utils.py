"""Build megatron-core's DSAIndexer on the CPU from local (non-TE) submodules."""

from __future__ import annotations

import torch


def make_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_head_dim=64,
        qk_pos_emb_head_dim=64,
        v_head_dim=64,
        add_bias_linear=False,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=4,
        dsa_indexer_head_dim=128,
        dsa_indexer_topk=8,
        dsa_indexer_rotate_activation=False,
        rope_type="rope",
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def make_indexer(config, indexer_cls=None):
    """A DSAIndexer (or subclass) with random LayerNorm affine parameters."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    submodules = dsa.DSAIndexerSubmodules(
        linear_wq_b=Linear, linear_wk=Linear, k_norm=WrappedTorchNorm, linear_weights_proj=Linear
    )
    indexer = (indexer_cls or dsa.DSAIndexer)(config, submodules)
    with torch.no_grad():
        indexer.k_norm.weight.normal_(1.0, 0.2)
        indexer.k_norm.bias.normal_(0.0, 0.2)
    return indexer
