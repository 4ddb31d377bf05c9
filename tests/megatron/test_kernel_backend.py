"""``dsa_kernel_backend="tilelang"`` beside the drop-ins: what the config refuses, and why.

tilelang is absent here and there is no CUDA device, so megatron-core's own dependency check
refuses it; the layout rules are checked field by field, and pinned against the source of
megatron-core's TileLang hook (``ops.tilelang_dsa.fused_sparse_mla_absorbed``), which declines
the layouts they name. The GPU side (TileLang's SparseMLA on the owned picks) is
``tests/gpu/test_tilelang.py``.
"""

import inspect

import pytest
import torch

from dsa_precision.megatron import kernel_backend

from ..support.megatron import make_config

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks megatron-core's CUDA refusal of tilelang"
)

FP8 = dict(dsa_indexer_scoring_precision="fp8")
# A layout TileLang's SparseMLA runs: the absorbed 512 + 64 lanes, 16 heads, top-k 64k.
TILELANG_LAYOUT = dict(
    experimental_attention_variant=None,  # Megatron's own check of the backend needs "dsa"
    dsa_kernel_backend="tilelang",
    kv_lora_rank=512,
    qk_pos_emb_head_dim=64,
    num_attention_heads=16,
    dsa_indexer_topk=256,
)


def _problems(exc: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(exc.value).splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize(
    "fields",
    [FP8, dict(dsa_indexer_topk_source="replay"), dict(dsa_indexer_rope_fp32=True)],
    ids=["fp8", "replay", "rope_fp32"],
)
def test_tilelang_without_cuda_is_refused_by_megatrons_own_check(fields):
    with pytest.raises(ValueError) as exc:
        make_config(**TILELANG_LAYOUT, **fields)
    (problem,) = _problems(exc)
    assert problem.startswith("dsa_kernel_backend='tilelang': dsa_kernel_backend=tilelang ")
    assert "requires a CUDA device" in problem and "dsa_kernel_backend='none'" in problem


def test_default_fields_leave_tilelang_to_megatron():
    """Nothing of the package runs: the config is Megatron's, its backend choice untouched."""
    config = make_config(**TILELANG_LAYOUT)
    assert config.dsa_kernel_backend == "tilelang" and not config.dsa_indexer_precision.fp8


def test_every_layout_tilelang_declines_is_named_at_once():
    from megatron.core.transformer.enums import AttnBackend

    with pytest.raises(ValueError) as exc:
        make_config(
            **{
                **TILELANG_LAYOUT,
                "kv_lora_rank": 256,
                "num_attention_heads": 48,
                "dsa_indexer_topk": 100,
                "attention_backend": AttnBackend.unfused,
            },
            **FP8,
        )
    problems = _problems(exc)
    named = [p.split("=", 1)[0] for p in problems]
    assert named == [
        "dsa_kernel_backend",
        "attention_backend",
        "kv_lora_rank",
        "num_attention_heads",
        "dsa_indexer_topk",
    ], problems
    assert "kv_lora_rank=256:" in problems[2] and "use 512" in problems[2]
    assert "num_attention_heads=48 (48 per tensor-parallel rank" in problems[3]
    assert "dsa_indexer_topk=100:" in problems[4] and "multiple of 64" in problems[4]
    assert all("dsa_kernel_backend='none'" in p for p in problems)


def test_the_layout_rules_read_the_config():
    """:func:`_tilelang_problems` on a config built with the backend off, then asked about it."""
    import dataclasses
    import types

    config = make_config(**{**TILELANG_LAYOUT, "dsa_kernel_backend": "none"}, **FP8)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    asked = types.SimpleNamespace(**{**fields, "dsa_kernel_backend": "tilelang"})
    (only,) = kernel_backend._tilelang_problems(asked)  # the layout runs; CUDA is what is missing
    assert only.startswith("dsa_kernel_backend='tilelang'")
    asked.qk_pos_emb_head_dim, asked.params_dtype = 32, torch.float32
    problems = kernel_backend._tilelang_problems(asked)
    assert [p.split("=", 1)[0] for p in problems[1:]] == ["qk_pos_emb_head_dim", "params_dtype"]


def test_switching_tilelang_on_after_validation_is_refused_and_undone():
    config = make_config(**{**TILELANG_LAYOUT, "dsa_kernel_backend": "none"}, **FP8)
    with pytest.raises(ValueError, match=r"dsa_kernel_backend='tilelang' rejected \(kept 'none'\)"):
        config.dsa_kernel_backend = "tilelang"
    assert config.dsa_kernel_backend == "none"


def test_head_rule_is_megatrons():
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    for heads in range(1, 300):
        megatron = tilelang_dsa._is_supported_sparse_mla_head_count(max(heads, 16), kv_group=1)
        assert kernel_backend._sparse_mla_heads_supported(heads) == megatron, heads


def test_layout_rules_are_the_ones_megatrons_hook_declines():
    """The source of megatron-core 0.19.2's TileLang hook holds each rule the config applies."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    source = inspect.getsource(tilelang_dsa.fused_sparse_mla_absorbed)
    lanes = kernel_backend._SPARSE_MLA_LATENT + kernel_backend._SPARSE_MLA_ROPE
    for rule in (
        "if not _all_bfloat16(query, key):",
        f"if query.size(-1) != {lanes} or v_channels != {kernel_backend._SPARSE_MLA_LATENT}:",
        f"kernel_heads = max(query_heads, {kernel_backend._SPARSE_MLA_MIN_HEADS})",
        f"if topk_indices.size(-1) % {kernel_backend._SPARSE_MLA_TOPK_BLOCK} != 0:",
    ):
        assert rule in source, rule
    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    assert "AttnBackend.unfused" in inspect.getsource(dsa_kernels.use_fused_dsa_kernels)


def test_picks_narrower_than_the_top_k_are_padded_with_minus_one():
    query = torch.zeros(3, 1, 16, 576, dtype=torch.bfloat16)
    picks = torch.tensor([[[0, -1], [0, 1], [1, 2]]], dtype=torch.int32)
    padded = kernel_backend._tilelang_picks(picks, 64, query, layer_number=1)
    assert padded.shape == (1, 3, 64) and padded.dtype == torch.int32
    assert torch.equal(padded[..., :2], picks) and bool((padded[..., 2:] == -1).all())
    full = torch.zeros(1, 3, 64, dtype=torch.int32)
    assert kernel_backend._tilelang_picks(full, 64, query, layer_number=1) is full


def test_a_query_tilelang_declines_raises_naming_the_layer():
    query = torch.zeros(3, 1, 16, 576, dtype=torch.float32)
    picks = torch.zeros(1, 3, 64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"DSA layer 2: dsa_kernel_backend='tilelang' .*float32"):
        kernel_backend._tilelang_picks(picks, 64, query, layer_number=2)
