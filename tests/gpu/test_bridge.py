"""Megatron-Bridge 0.6.2: a Hugging Face GLM-5 checkpoint through ``AutoBridge`` into the drop-ins
and back (``dsa_precision.megatron.bridge``).

The checkpoint is written by the test (transformers' ``GlmMoeDsaConfig``: 2 layers, the first
dense, 4 routed experts, 32 indexer heads of dim 128, random weights). Megatron-Bridge imports
``transformer_engine.pytorch`` unconditionally (``megatron/bridge/peft/lora_layers.py``), so these
tests run where Transformer Engine is installed: the GPU suite on the H200 (``-m gpu``); on a
machine without TE they skip, saying so. On a GPU the model is built from Transformer Engine's
spec, as real training builds it.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch


def _bridge_unavailable() -> str | None:
    if importlib.util.find_spec("megatron.bridge") is None:
        return "Megatron-Bridge is not installed (README, 'With Megatron-Bridge')"
    try:
        import megatron.bridge  # noqa: F401
    except ImportError as exc:
        return f"Megatron-Bridge does not import here ({exc}); it needs Transformer Engine"
    return None


_REASON = _bridge_unavailable()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="Transformer Engine's spec needs CUDA"
    ),
]

SEQ, VOCAB = 256, 512
PRECISION = dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")


@pytest.fixture(scope="module")
def glm5_checkpoint(tmp_path_factory):
    """A tiny GLM-5 (``glm_moe_dsa``) Hugging Face checkpoint and its tensors."""
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=64, head_dim=64,
        v_head_dim=64, index_n_heads=32, index_head_dim=128, index_topk=64,
        max_position_embeddings=1024, rms_norm_eps=1e-5,
        indexer_rope_interleave=True,  # GLM-5's config.json field, read by the Bridge
        dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("glm5")
    model.save_pretrained(path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return path, tensors


@pytest.fixture(scope="module")
def parallel(megatron_parallel_gpu):
    return megatron_parallel_gpu


def _single_device(provider) -> None:
    """The GLM-5 bridge's settings that need DeepEP / HybridEP or several GPUs, set for one."""
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_shared_expert_overlap = False
    provider.moe_permute_fusion = False
    provider.gradient_accumulation_fusion = False  # no DDP here: gradients land in .grad
    provider.seq_length = SEQ
    provider.dsa_indexer_loss_coeff = 0.0
    provider.dsa_indexer_use_sparse_loss = False


def _build(path, fields: dict | None, *, rope_type: str = "rope", seed: int = 1):
    """``(bridge, [model])`` from the checkpoint; ``fields`` None: the Bridge's stock provider."""
    from megatron.bridge import AutoBridge
    from megatron.core import tensor_parallel

    from dsa_precision.megatron.bridge import dsa_precision_provider

    bridge = AutoBridge.from_hf_pretrained(path)
    provider = bridge.to_megatron_provider(load_weights=True)
    _single_device(provider)
    provider.rope_type = rope_type
    if fields is not None:
        provider = dsa_precision_provider(provider, **fields)
    provider.finalize()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    return bridge, model


def _tokens(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, SEQ), generator=g).cuda()


def _forward(model, tokens, *, picks=None):
    import dsa_precision.megatron as dsap

    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    ctx = dsap.engine_topk(picks, seq_len=tokens.shape[1]) if picks else contextlib.nullcontext()
    with ctx:
        return model(tokens, pos, None)


def _loss_and_grads(model, tokens, **kw):
    logits = _forward(model, tokens, **kw)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()
    )
    model.zero_grad()
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _exported(bridge, model) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().cpu()
        for name, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)
    }


def _dsa_modules(model):
    from dsa_precision.megatron import PrecisionDSAIndexer, PrecisionDSAttention

    attention = [m for m in model.modules() if isinstance(m, PrecisionDSAttention)]
    indexers = [m for m in model.modules() if isinstance(m, PrecisionDSAIndexer)]
    return attention, indexers


def test_the_drop_ins_build_from_transformer_engines_spec(glm5_checkpoint, parallel):
    _, (model,) = _build(glm5_checkpoint[0], PRECISION)
    attention, indexers = _dsa_modules(model)
    assert len(attention) == len(indexers) == 2
    linear = type(indexers[0].linear_wq_b).__module__
    assert linear.startswith("megatron.core.extensions.transformer_engine"), linear


def test_the_checkpoint_goes_in_and_comes_out_tensor_for_tensor(glm5_checkpoint, parallel):
    path, tensors = glm5_checkpoint
    bridge, (model,) = _build(path, PRECISION)
    out = _exported(bridge, model)
    assert sorted(out) == sorted(tensors)
    differ = [n for n in tensors if not torch.equal(out[n].to(tensors[n].dtype), tensors[n])]
    assert differ == []


def test_switches_off_is_the_bridges_stock_model(glm5_checkpoint, parallel):
    path, _ = glm5_checkpoint
    tokens = _tokens()
    _, (stock,) = _build(path, None, rope_type="yarn")
    _, (ours,) = _build(path, {}, rope_type="yarn")
    assert len(_dsa_modules(ours)[0]) == 2 and not _dsa_modules(stock)[0]
    stock_loss, stock_grads = _loss_and_grads(stock, tokens)
    ours_loss, ours_grads = _loss_and_grads(ours, tokens)
    assert torch.equal(stock_loss, ours_loss)
    assert sorted(stock_grads) == sorted(ours_grads)
    assert [n for n in stock_grads if not torch.equal(stock_grads[n], ours_grads[n])] == []


def test_a_step_with_rope_fp32_and_fp8_and_its_replay(glm5_checkpoint, parallel):
    """Compute (``rope_fp32+fp8``) records its picks; the same weights with
    ``dsa_indexer_topk_source='replay'`` handed those picks give the same loss and gradients, bit
    for bit; one SGD step moves the weights and the export holds the moved ones."""
    import dsa_precision.megatron as dsap

    path, tensors = glm5_checkpoint
    tokens = _tokens(1)
    bridge, (model,) = _build(path, PRECISION)
    _, (replay,) = _build(path, {**PRECISION, "dsa_indexer_topk_source": "replay"})
    with dsap.record_topk() as recorder:
        loss, grads = _loss_and_grads(model, tokens)
    picks = dict(recorder.picks.indices)
    assert sorted(picks) == [1, 2] and torch.isfinite(loss)
    replay_loss, replay_grads = _loss_and_grads(replay, tokens, picks=picks)
    assert torch.equal(loss, replay_loss)
    assert [n for n in grads if not torch.equal(grads[n], replay_grads[n])] == []
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    moved = _exported(bridge, model)
    changed = [n for n in tensors if not torch.equal(moved[n].to(tensors[n].dtype), tensors[n])]
    assert "model.layers.0.self_attn.q_a_proj.weight" in changed
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in changed
    # With the indexer loss at 0 no gradient reaches the indexer (its top-k is discrete).
    assert not any(".indexer." in n for n in changed)


def test_the_provider_refuses_what_it_cannot_honour(glm5_checkpoint, parallel):
    from megatron.bridge import AutoBridge

    from dsa_precision.megatron.bridge import DSAPrecisionMLAModelProvider, dsa_precision_provider

    provider = AutoBridge.from_hf_pretrained(glm5_checkpoint[0]).to_megatron_provider()
    _single_device(provider)
    provider.dsa_indexer_loss_coeff = 0.001  # the bridge's, for the last check
    with pytest.raises(TypeError, match="hidden_size"):
        dsa_precision_provider(provider, hidden_size=8)
    # The GLM-5 bridge's RoPE: YaRN with factor 1 for a plain-RoPE checkpoint.
    assert (provider.rope_type, provider.rotary_scaling_factor) == ("yarn", 1.0)
    with pytest.raises(ValueError, match=r"provider\.rope_type = 'rope'"):
        dsa_precision_provider(provider, **PRECISION).finalize()
    provider.rope_type = "rope"
    ours = dsa_precision_provider(provider, **PRECISION)
    assert isinstance(ours, DSAPrecisionMLAModelProvider) and provider.transformer_layer_spec
    assert ours._pre_wrap_hooks == provider._pre_wrap_hooks  # the Bridge's weight loading
    # The bridge's indexer loss (0.001) cannot be trained with FP8 scoring: finalize() says so.
    with pytest.raises(ValueError, match=r"dsa_indexer_loss_coeff=0\.001"):
        ours.finalize()
