"""PrecisionDSAIndexer: Megatron's parameters and preprocessing fields, and the operands of each configuration."""

import pytest
import torch

from dsa_precision import indexer_select, reset_scoring_calls, scoring_calls

from ..support.megatron import (
    CONFIGS,
    attention_inputs,
    make_attention,
    make_config,
)


def test_indexer_keeps_parameter_names():
    ours, stock = make_attention(make_config()), make_attention(make_config(), stock=True)
    assert list(ours.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_before_topk_per_configuration(name):
    config = make_config(**CONFIGS[name])
    ours = make_attention(config).indexer
    stock = make_attention(make_config(), stock=True).indexer
    stock.load_state_dict(ours.state_dict())
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    with torch.no_grad():
        q, k, w = ours.forward_before_topk(x, qr)
        q0, k0, w0 = stock.forward_before_topk(x, qr)
    precision = config.dsa_indexer_precision
    if not precision.rope_fp32:  # Megatron's own preprocessing, whatever the scoring
        assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(w, w0)
        return
    carrier = torch.float32 if precision.fp8 else torch.bfloat16
    assert q.dtype == k.dtype == carrier
    pre = ours.preprocess()
    qp, _ = ours.linear_wq_b(qr)
    kp, _ = ours.linear_wk(x)
    freqs = ours.rotary_pos_emb(x.size(0))
    q32, k32 = pre(qp.view(*q.shape), kp, freqs)
    assert torch.equal(q, q32.to(carrier)) and torch.equal(k, k32.to(carrier))
    assert not torch.equal(q.to(torch.bfloat16), q0)  # FP32 preprocessing changes the bits
    raw, _ = ours.linear_weights_proj(x)
    if precision.fp8:  # the engine's FP32 order
        assert w.dtype == torch.float32 and torch.equal(w, (raw.float() * 128**-0.5) * 32**-0.5)
    else:
        assert torch.equal(w, w0)


def test_fp32_weights_engine_folds_the_float32_weights_projection():
    """sglang-unfused's weights GEMM outputs FP32: the folded FP8 weights come from the float32
    product of linear_weights_proj, not from its BF16 output."""
    from dsa_precision.prepare import _fold_head_weights

    config = make_config(
        dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine="sglang-unfused", dsa_indexer_rotate_activation=True,
    )  # fmt: skip
    indexer = make_attention(config).indexer
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    ops = indexer.scoring_operands(x, qr)
    engine = config.dsa_indexer_precision.engine
    assert engine.weights_dtype == "fp32"
    w32 = torch.nn.functional.linear(x.float(), indexer.linear_weights_proj.weight.float())
    bf16, _ = indexer.linear_weights_proj(x)
    fold = dict(n_heads=32, head_dim=128)
    want = _fold_head_weights(w32.transpose(0, 1), ops.q_descale, engine.weights_fold, **fold)
    assert torch.equal(ops.weights, want)
    from_bf16 = _fold_head_weights(bf16.transpose(0, 1), ops.q_descale, engine.weights_fold, **fold)
    assert not torch.equal(ops.weights, from_bf16)


def test_indexer_follows_megatrons_preprocessing_fields_per_call():
    """Megatron reads dsa_indexer_rotate_activation per forward (Megatron's own test
    test_dsa_indexer_rotate_activation_follows_config); so does the drop-in, on its one
    preprocessing module, rebuilt only when such a field changed (vllm-exact: the profile that
    serves either rotation setting)."""
    config = make_config(dsa_indexer_rope_fp32=True, dsa_indexer_engine="vllm-exact")
    indexer = make_attention(config).indexer
    built = indexer.preprocess()
    assert indexer.preprocess() is built  # decided once: the forward builds nothing
    x, qr = attention_inputs()["x"], attention_inputs()["qr"]
    with torch.no_grad():
        plain = indexer.forward_before_topk(x, qr)
        config.dsa_indexer_rotate_activation = True
        rotated = indexer.forward_before_topk(x, qr)
    assert indexer.preprocess() is not built and indexer.preprocess().rotate_activation
    assert not torch.equal(plain[0], rotated[0])


def test_fp8_forward_with_scores_is_fp8_whoever_calls_it():
    config = make_config(dsa_indexer_scoring_precision="fp8")
    indexer = make_attention(config).indexer
    inp = attention_inputs()
    mask = torch.triu(torch.full((16, 16), float("-inf")), diagonal=1)
    reset_scoring_calls()
    scores, topk = indexer.forward_with_scores(inp["x"], inp["qr"], mask)
    assert scoring_calls("fp8") == 1 and scoring_calls() == 1
    ops = indexer.scoring_operands(inp["x"], inp["qr"])
    assert torch.equal(topk, indexer_select(ops, topk=8))  # the mask is Megatron's causal one
    assert torch.equal(torch.isinf(scores[0]), torch.isinf(mask))
