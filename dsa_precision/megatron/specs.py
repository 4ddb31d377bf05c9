"""Module specs: Megatron's DSA specs with the precision modules swapped in.

:func:`with_dsa_precision` walks any spec tree (GPT layer or block specs, hybrid stack specs)
and returns a copy in which ``DSAttention`` and ``DSAIndexer`` are replaced by
:class:`PrecisionDSAttention` and :class:`PrecisionDSAIndexer`; the input spec is not modified.

The rule "the dsa-precision fields act on DSA" is checked here, where a model's layers are chosen,
not in the config: a DSA module built directly acts on the fields whatever
``experimental_attention_variant`` says (Megatron's own tests build them with ``None``), while a
spec with no DSA module would leave a switched-on field with nothing to act on, and raises.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav_specs
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .attention import PrecisionDSAttention
from .config import _layer_decisions
from .indexer import PrecisionDSAIndexer

__all__ = [
    "LocalDSASpecProvider",
    "get_dsa_precision_module_spec",
    "get_gpt_dsa_precision_block_spec",
    "with_dsa_precision",
]

_SWAPS = {DSAttention: PrecisionDSAttention, DSAIndexer: PrecisionDSAIndexer}


def _swap(node: Any) -> Any:
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(
            node, module=_SWAPS.get(node.module, node.module), submodules=_swap(node.submodules)
        )
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: _swap(getattr(node, f.name)) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    if isinstance(node, list | tuple):
        return type(node)(_swap(item) for item in node)
    if isinstance(node, dict):
        return {key: _swap(value) for key, value in node.items()}
    if isinstance(node, type):
        return _SWAPS.get(node, node)
    return node


def _local_mla(node: Any) -> Any:
    """Without Transformer Engine, AbsorbedMLASelfAttention takes its down projections as
    ``ColumnParallelLinear`` (it knows modelopt's ``Linear`` only next to TE)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttentionSubmodules,
    )

    if isinstance(node, AbsorbedMLASelfAttentionSubmodules):
        return dataclasses.replace(
            node, linear_q_down_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear
        )
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, submodules=_local_mla(node.submodules))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(
            node, **{f.name: _local_mla(getattr(node, f.name)) for f in dataclasses.fields(node)}
        )
    if isinstance(node, list | tuple):
        return type(node)(_local_mla(item) for item in node)
    return node


def _has_dsa(node: Any) -> bool:
    """Whether a spec tree names a DSA module (stock or precision)."""
    if isinstance(node, ModuleSpec):
        return _has_dsa(node.module) or _has_dsa(node.submodules)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return any(_has_dsa(getattr(node, f.name)) for f in dataclasses.fields(node))
    if isinstance(node, list | tuple):
        return any(_has_dsa(item) for item in node)
    if isinstance(node, dict):
        return any(_has_dsa(value) for value in node.values())
    return isinstance(node, type) and (node in _SWAPS or node in _SWAPS.values())


def _switched_on(config: Any) -> list[str]:
    """The dsa-precision fields of ``config`` that change Megatron's behaviour, as ``name=value``."""
    precision, source = _layer_decisions(config)
    fields = []
    if precision.rope_fp32:
        fields.append("dsa_indexer_rope_fp32=True")
    if precision.fp8:
        fields.append("dsa_indexer_scoring_precision='fp8'")
    if source != "compute":
        fields.append(f"dsa_indexer_topk_source={source!r}")
    return fields


def _refuse_idle_fields(config: Any, where: str, *, has_dsa: bool) -> None:
    """Raise ``ValueError`` when ``config`` switches a dsa-precision field on and the spec being
    built has no DSA module for it to act on (host-only)."""
    fields = _switched_on(config)
    if not fields or has_dsa:
        return
    variant = config.experimental_attention_variant
    raise ValueError(
        f"{where}: {', '.join(fields)} acts on DSA layers, and the spec has none "
        f"(experimental_attention_variant={variant!r}); set experimental_attention_variant='dsa' "
        "to build DSA layers, or leave the dsa-precision fields at their defaults."
    )


def with_dsa_precision(spec: Any, config: Any = None) -> Any:
    """A copy of ``spec`` (``ModuleSpec``, submodules dataclass or list of them) with the DSA
    modules replaced by the precision modules.

    With ``config``, a spec that has no DSA module while ``config`` switches a dsa-precision
    field on raises ``ValueError`` naming the field and ``experimental_attention_variant``: the
    field would act on nothing."""
    if config is not None:
        _refuse_idle_fields(config, "with_dsa_precision", has_dsa=_has_dsa(spec))
    return _swap(copy.copy(spec))


class LocalDSASpecProvider(LocalSpecProvider):
    """``LocalSpecProvider`` plus the plain ``linear()`` the DSA spec needs (no Transformer
    Engine): modelopt's local ``Linear`` for the indexer projections; the spec helpers give the
    MLA down projections ``ColumnParallelLinear``, the class AbsorbedMLASelfAttention accepts
    without TE."""

    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear


def _default_backend() -> BackendSpecProvider:
    """Transformer Engine's spec provider when TE is installed, else :class:`LocalDSASpecProvider`."""
    if eav_specs.HAVE_TE:
        return eav_specs.TESpecProvider()
    return LocalDSASpecProvider()


def get_dsa_precision_module_spec(
    config: Any, backend: BackendSpecProvider | None = None
) -> ModuleSpec:
    """``get_dsa_module_spec_for_backend`` with the precision modules (self-attention spec)."""
    backend = backend or _default_backend()
    spec = eav_specs.get_dsa_module_spec_for_backend(config, backend=backend)
    if isinstance(backend, LocalDSASpecProvider):
        spec = _local_mla(spec)
    return with_dsa_precision(spec)


def get_gpt_dsa_precision_block_spec(
    config: Any,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    backend: BackendSpecProvider | None = None,
) -> TransformerBlockSubmodules:
    """GPT decoder block spec with DSA layers (the experimental-attention-variant block) and the
    precision modules, for the TE backend or, without TE, :class:`LocalDSASpecProvider`.

    Megatron's builder makes DSA layers only with ``experimental_attention_variant='dsa'``; with
    another value and a dsa-precision field switched on this raises ``ValueError`` (the field
    would act on nothing)."""
    _refuse_idle_fields(
        config,
        "get_gpt_dsa_precision_block_spec",
        has_dsa=config.experimental_attention_variant == "dsa",
    )
    if backend is None and eav_specs.HAVE_TE:
        return with_dsa_precision(
            eav_specs.get_transformer_block_with_experimental_attention_variant_spec(
                config, vp_stage=vp_stage, pp_rank=pp_rank
            )
        )
    backend = backend or _default_backend()
    layers = eav_specs.get_transformer_layer_with_experimental_attention_variant_spec(
        config, backend=backend
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    block = TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + count],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
    )
    if isinstance(backend, LocalDSASpecProvider):
        block = _local_mla(block)
    return with_dsa_precision(block)
