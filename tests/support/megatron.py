"""One place that builds megatron-core DSA modules on the CPU (local, non-TE submodules).

Megatron's DSA spec builder needs Transformer Engine, so the indexer is built from a hand-made
``DSAIndexerSubmodules`` (modelopt ``Linear``, ``WrappedTorchNorm``) and the attention from the
package's ``LocalDSASpecProvider``; tests need the ``megatron_parallel`` and ``cpu_rotary``
fixtures (tests/conftest.py).
"""

from __future__ import annotations

import itertools

import torch

HIDDEN, Q_LORA, KV_LORA, ROPE, V_DIM, HEADS = 256, 64, 32, 64, 64, 4

CONFIGS = {
    "baseline": dict(),
    "rope_fp32": dict(dsa_indexer_rope_fp32=True),
    "fp8": dict(dsa_indexer_scoring_precision="fp8"),
    "rope_fp32+fp8": dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8"),
}


def make_config(cls=None, **overrides):
    """A small MLA + DSA config: ``cls`` defaults to :class:`DSAPrecisionTransformerConfig`
    (``MLATransformerConfig`` for stock Megatron)."""
    if cls is None:
        from dsa_precision.megatron import DSAPrecisionTransformerConfig as cls
    fields = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_head_dim=64,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=V_DIM,
        add_bias_linear=False,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=32,
        dsa_indexer_head_dim=128,
        dsa_indexer_topk=8,
        dsa_indexer_loss_coeff=0.0,
        dsa_indexer_rotate_activation=False,
        rope_type="rope",
        layernorm_epsilon=1e-6,  # the indexer k_norm epsilon vLLM and LMDeploy hard-code
    )
    fields.update(overrides)
    return cls(**fields)


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


def make_attention(config, *, stock=False, layer_number=1, seed=1, backend=None):
    """The DSA core attention of ``config`` (the swapped spec, or Megatron's with ``stock``);
    ``backend``: the spec provider (default the package's ``LocalDSASpecProvider``)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from dsa_precision.megatron import LocalDSASpecProvider, get_dsa_precision_module_spec

    build = get_dsa_module_spec_for_backend if stock else get_dsa_precision_module_spec
    spec = build(config, backend=backend or LocalDSASpecProvider()).submodules.core_attention
    torch.manual_seed(seed)
    attn = build_module(
        spec,
        config=config,
        layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=getattr(config, "cp_comm_type", None),
    )
    if attn.indexer is not None:
        with torch.no_grad():
            attn.indexer.k_norm.weight.normal_(1.0, 0.2)
            attn.indexer.k_norm.bias.normal_(0.0, 0.2)
    return attn


def attention_inputs(sq=16, b=2, seed=0, packed=False):
    """``DSAttention.forward`` inputs of the absorbed-MLA layout (packed: THD, batch 1)."""
    g = torch.Generator().manual_seed(seed)
    d = KV_LORA + ROPE
    inputs = dict(
        query=torch.randn(sq, b, HEADS, d, generator=g).to(torch.bfloat16),
        key=torch.randn(sq, b, 1, d, generator=g).to(torch.bfloat16),
        x=torch.randn(sq, b, HIDDEN, generator=g).to(torch.bfloat16),
        qr=torch.randn(sq, b, Q_LORA, generator=g).to(torch.bfloat16),
        up_v_weight=torch.randn(HEADS, V_DIM, KV_LORA, generator=g).to(torch.bfloat16),
    )
    if packed:
        inputs["query"] = inputs["query"].view(sq, HEADS, d)
        inputs["key"] = inputs["key"].view(sq, 1, d)
    inputs["query"].requires_grad_()
    inputs["key"].requires_grad_()
    return inputs


def run_attention(attn, inputs, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    return attn(
        inputs["query"], inputs["key"], None, None, inputs["x"], inputs["qr"],
        attn_mask_type=AttnMaskType.causal, up_v_weight=inputs["up_v_weight"], **kw,
    )  # fmt: skip


def packed_params(cu: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip
