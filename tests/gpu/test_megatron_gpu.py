"""PrecisionDSAttention with the real cuDNN kernels on an SM90 GPU (megatron-core 0.19)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS = 512, 128, 512, 64, 16


@pytest.fixture(scope="module")
def megatron_gpu():
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    import dsa_precision.megatron as dsap

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    dsap.install()
    yield dsap
    dsap.uninstall()


def _attention(dsap, **overrides):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    config = dsap.DSAPrecisionTransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, bf16=True,
        params_dtype=torch.bfloat16, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=128,
        qk_pos_emb_head_dim=ROPE, v_head_dim=128, add_bias_linear=False, apply_rope_fusion=False,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=32, dsa_indexer_head_dim=128,
        dsa_indexer_topk=256, dsa_indexer_loss_coeff=0.0, dsa_indexer_rotate_activation=True,
        rope_type="rope", dsa_kernel_backend="cudnn", **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    spec = dsap.get_dsa_precision_module_spec(config, dsap.LocalDSASpecProvider())
    attn = build_module(
        spec.submodules.core_attention, config=config, layer_number=1,
        attn_mask_type=AttnMaskType.causal, attention_type="self",
    )  # fmt: skip
    return attn.cuda().bfloat16()  # as Megatron's Float16Module leaves the parameters


def _inputs(s=2048, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = KV_LORA + ROPE

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    return (
        r(s, 1, HEADS, d).requires_grad_(),
        r(s, 1, 1, d).requires_grad_(),
        r(s, 1, HIDDEN),
        r(s, 1, Q_LORA),
        r(HEADS, 128, KV_LORA),
    )


def _forward(attn):
    from megatron.core.transformer.enums import AttnMaskType

    def run(query, key, x, qr, up_v):
        return attn(
            query, key, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v
        )

    return run


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("topk_freq", [1, 2], ids=["fused_path", "split_path"])
def test_precision_attention_replays_bit_exact(megatron_gpu, precision, topk_freq):
    from dsa_precision.testing import assert_replays_bit_exact

    attn = _attention(
        megatron_gpu,
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision=precision,
        dsa_indexer_topk_freq=topk_freq,  # 2: top-k sharing, Megatron's split path
    )
    assert_replays_bit_exact(
        _forward(attn), _inputs(), contention=True, what=f"DSAttention {precision}"
    )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"dsa_indexer_rope_fp32": True}, {"dsa_indexer_scoring_precision": "fp8"},
     {"dsa_indexer_rope_fp32": True, "dsa_indexer_scoring_precision": "fp8"}],
    ids=["baseline", "rope_fp32", "fp8", "rope_fp32+fp8"],
)  # fmt: skip
def test_fused_and_split_paths_score_in_the_configured_precision(megatron_gpu, record, overrides):
    from dsa_precision import reset_scoring_calls, scoring_calls

    precision = overrides.get("dsa_indexer_scoring_precision", "bf16")
    for topk_freq, site in ((1, "fused"), (2, "split")):
        attn = _attention(megatron_gpu, dsa_indexer_topk_freq=topk_freq, **overrides)
        reset_scoring_calls()
        out = _forward(attn)(*_inputs())
        out.float().sum().backward()
        total = scoring_calls()
        record("megatron_paths", config=str(overrides), site=site, calls=total,
               in_precision=scoring_calls(precision, site=site))  # fmt: skip
        assert total >= 1 and scoring_calls(precision, site=site) == total
        assert torch.isfinite(out.float()).all()
