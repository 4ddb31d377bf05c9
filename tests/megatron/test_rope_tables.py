"""rope_fp32 in a Megatron layer reads the engine's own RoPE tables, built from the token
positions by the profile's recipe: the same bits whatever ``use_cpu_initialization`` says and
wherever (and however) Megatron computed its ``inv_freq``; Megatron's own path keeps Megatron's
angles."""

import pytest
import torch

from ..support.megatron import attention_inputs, make_attention, make_config, packed_params

FP8 = dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
YARN = dict(
    rope_type="yarn", rotary_base=10000, rotary_scaling_factor=40,
    original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
    mscale_all_dim=1.0,
)  # fmt: skip
GLM5 = dict(rope_type="rope", rotary_base=1e6, dsa_indexer_rope_interleaved=True)


def _bits(ops) -> torch.Tensor:
    """Every byte of the FP8 operands (q, k, weights, k descales), flat."""
    parts = (ops.q, ops.k, ops.weights, ops.k_descale)
    return torch.cat([t.contiguous().view(torch.uint8).flatten() for t in parts])


def _indexer(cpu_init: bool, **fields):
    return make_attention(make_config(use_cpu_initialization=cpu_init, **fields), seed=1).indexer


def _perturb_inv_freq(rotary) -> None:
    """Megatron's inv_freq changed (a stand-in for one computed elsewhere: another device's pow
    differs in ulps; this differs more, so that BF16 angles see it too), on this instance; its
    per-length angle cache is cleared."""
    for name in ("inv_freq", "inv_freq_extra", "inv_freq_inter"):
        if hasattr(rotary, name):
            setattr(rotary, name, getattr(rotary, name) * (1 + 2**-8))
    type(rotary).forward.cache_clear()


@pytest.mark.parametrize("model", ["glm5-like", "v32-like"])
def test_the_tables_do_not_depend_on_use_cpu_initialization_or_megatrons_inv_freq(model):
    fields = {**FP8, **(GLM5 if model == "glm5-like" else YARN)}
    a, b = _indexer(True, **fields), _indexer(False, **fields)
    b.load_state_dict(a.state_dict())
    inputs = attention_inputs(sq=24, b=2)
    x, qr = inputs["x"], inputs["qr"]
    with torch.no_grad():
        want = _bits(a.scoring_operands(x, qr))
        assert torch.equal(_bits(b.scoring_operands(x, qr)), want)
        q, k, _ = a.forward_before_topk(x, qr)
        angles = b.rope_angles(x, None)[0].clone()
        _perturb_inv_freq(b.rotary_pos_emb)  # Megatron's angles change ...
        assert not torch.equal(b.rope_angles(x, None)[0], angles)
        assert torch.equal(_bits(b.scoring_operands(x, qr)), want)
        q2, k2, _ = b.forward_before_topk(x, qr)  # ... the engine's tables do not
        assert torch.equal(q, q2) and torch.equal(k, k2)


def test_megatrons_own_path_keeps_megatrons_angles():
    """With the switches off (and FP8 alone) the preprocessing is Megatron's, its angles
    included: a changed inv_freq changes the bits, as it changes stock Megatron's."""
    stock = make_attention(make_config(), stock=True, seed=1).indexer
    ours = _indexer(True, dsa_indexer_scoring_precision="fp8")
    ours.load_state_dict(stock.state_dict())
    inputs = attention_inputs(sq=24, b=2)
    x, qr = inputs["x"], inputs["qr"]
    with torch.no_grad():
        before = _bits(ours.scoring_operands(x, qr))
        q0, _, _ = stock.forward_before_topk(x, qr)
        _perturb_inv_freq(ours.rotary_pos_emb)
        _perturb_inv_freq(stock.rotary_pos_emb)
        after = _bits(ours.scoring_operands(x, qr))
        q1, _, _ = stock.forward_before_topk(x, qr)
    assert not torch.equal(q0, q1)  # stock Megatron follows its inv_freq
    assert not torch.equal(before, after)  # so does the BF16 path
    assert ours._rope_tables is None


def test_the_indexer_tables_are_the_engine_recipe_of_the_config():
    """The layer decides the tables from Megatron's RoPE fields (DeepSeek-V3.2's YaRN here), and
    its q / k are the preprocessing with those tables at positions 0 .. s - 1."""
    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.rope import RopeSpec, YarnScaling

    indexer = _indexer(True, **FP8, **YARN)
    spec = indexer._rope_tables.spec
    assert spec == RopeSpec(64, 10000.0, YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0))
    assert indexer._rope_tables.engine is ENGINE_PROFILES["vllm"]
    assert indexer.preprocess().rope_tables is indexer._rope_tables


def test_packed_rows_read_their_position_inside_their_sequence():
    """THD: each packed row's tables are those of its position in its sequence, so a packed
    sequence gets the rows it gets alone."""
    fields = {**FP8, **GLM5}
    indexer = _indexer(True, **fields)
    inputs = attention_inputs(sq=16, b=1, packed=True)
    x, qr = inputs["x"], inputs["qr"]
    cu = [0, 6, 16]
    with torch.no_grad():
        packed = indexer.forward_before_topk(x, qr, packed_params(cu))
        alone = [indexer.forward_before_topk(x[a:b], qr[a:b]) for a, b in ((0, 6), (6, 16))]
    for i in (0, 1):  # q, k
        assert torch.equal(packed[i], torch.cat([part[i] for part in alone]))
