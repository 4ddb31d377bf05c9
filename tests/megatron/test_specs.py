"""The spec swap: Megatron's DSA modules replaced by the drop-ins and nothing else, and switched-on fields refused where no DSA layer would read them."""

import dataclasses

import pytest

import dsa_precision.megatron as dsap

from ..support.megatron import (
    make_config,
)


def test_spec_swap_replaces_only_the_dsa_modules():
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention

    config = make_config()
    upstream = get_dsa_module_spec_for_backend(config, dsap.LocalDSASpecProvider())
    swapped = dsap.get_dsa_precision_module_spec(config, dsap.LocalDSASpecProvider())
    core = swapped.submodules.core_attention
    assert core.module is dsap.PrecisionDSAttention
    assert core.submodules.indexer.module is dsap.PrecisionDSAIndexer
    assert upstream.submodules.core_attention.module is DSAttention  # input untouched

    def count(spec, cls) -> int:
        if isinstance(spec, type):
            return int(spec is cls)
        if dataclasses.is_dataclass(spec):
            return sum(count(getattr(spec, f.name), cls) for f in dataclasses.fields(spec))
        if isinstance(spec, list | tuple):
            return sum(count(s, cls) for s in spec)
        return 0

    hybrid = dsap.with_dsa_precision(hybrid_stack_spec)
    assert count(hybrid_stack_spec, DSAttention) > 0 and count(hybrid, DSAttention) == 0
    assert count(hybrid, dsap.PrecisionDSAttention) == count(hybrid_stack_spec, DSAttention)
    assert count(hybrid, dsap.PrecisionDSAIndexer) == count(hybrid_stack_spec, DSAIndexer)


_SWITCHED_ON = {
    "dsa_indexer_rope_fp32=True": dict(dsa_indexer_rope_fp32=True),
    "dsa_indexer_scoring_precision='fp8'": dict(dsa_indexer_scoring_precision="fp8"),
    "dsa_indexer_topk_source='verify'": dict(dsa_indexer_topk_source="verify"),
    "dsa_indexer_topk_source='replay'": dict(dsa_indexer_topk_source="replay"),
}


@pytest.mark.parametrize("field", list(_SWITCHED_ON))
def test_block_spec_without_dsa_layers_refuses_a_switched_on_field(field):
    """Megatron's block builder makes no DSA layer unless experimental_attention_variant='dsa':
    a switched-on field would act on nothing, and the spec builder says so."""
    config = make_config(num_layers=2, experimental_attention_variant=None, **_SWITCHED_ON[field])
    with pytest.raises(
        ValueError,
        match=rf"get_gpt_dsa_precision_block_spec: {field} acts on DSA layers.*"
        r"experimental_attention_variant=None\); set experimental_attention_variant='dsa'",
    ):
        dsap.get_gpt_dsa_precision_block_spec(config)


def test_swap_of_a_spec_without_dsa_refuses_a_switched_on_field():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    plain = get_gpt_layer_local_spec()
    rope = make_config(dsa_indexer_rope_fp32=True)
    with pytest.raises(ValueError, match=r"with_dsa_precision: dsa_indexer_rope_fp32=True acts"):
        dsap.with_dsa_precision(plain, rope)
    # Default fields, or no config: nothing to refuse; a spec with DSA modules: swapped.
    kept = dsap.with_dsa_precision(plain, make_config())
    assert kept.submodules.self_attention.module is plain.submodules.self_attention.module
    dsa = eav_module_spec(make_config())
    swapped = dsap.with_dsa_precision(dsa, rope).submodules.core_attention
    assert swapped.module is dsap.PrecisionDSAttention


def eav_module_spec(config):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    return get_dsa_module_spec_for_backend(config, dsap.LocalDSASpecProvider())


def test_gpt_block_spec_without_te():
    block = dsap.get_gpt_dsa_precision_block_spec(make_config(num_layers=2))
    assert len(block.layer_specs) == 2
    attn = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert attn.module is dsap.PrecisionDSAttention
