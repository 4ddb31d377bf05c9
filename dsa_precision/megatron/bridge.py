"""Megatron-Bridge: a provider from ``AutoBridge`` as a dsa-precision model.

Megatron-Bridge (0.6.2, for megatron-core 0.19) builds a GLM-5 (``glm_moe_dsa``) model from a
Hugging Face checkpoint: ``AutoBridge.from_hf_pretrained(path).to_megatron_provider()`` returns an
``MLAModelProvider`` (a ``TransformerConfig`` that also builds the model) whose
``transformer_layer_spec`` is Megatron's experimental-attention block spec, and the bridge maps the
weights in (a pre-wrap hook on the provider) and out (``save_hf_pretrained``). Usage::

    from megatron.bridge import AutoBridge
    from dsa_precision.megatron.bridge import dsa_precision_provider

    bridge = AutoBridge.from_hf_pretrained("zai-org/GLM-5")
    provider = dsa_precision_provider(
        bridge.to_megatron_provider(),
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine="vllm",
    )
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    ...
    bridge.save_hf_pretrained(model, "out")

:func:`dsa_precision_provider` returns a copy of the provider as a
:class:`DSAPrecisionMLAModelProvider` -- every field, the weight-loading hooks and the model it
builds are the Bridge's -- with the dsa-precision fields set and its layer spec wrapped so that the
DSA modules are the precision ones (:func:`~dsa_precision.megatron.with_dsa_precision`); the
parameter names, and so the Bridge's weight mapping both ways, are Megatron's. With the fields at
their defaults the model is the Bridge's own, byte for byte. Nothing of Bridge is replaced or
reassigned; the names used are listed and checked in :mod:`.compat` (``_BRIDGE_CALLS``).
"""

# ruff: noqa: E402  (the surface check runs before the Bridge names it checks are imported)

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from .compat import _check_megatron_bridge

_check_megatron_bridge()

from megatron.bridge.models.mla_provider import MLAModelProvider
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav_specs

from .config import PRECISION_FIELDS, DSAPrecisionTransformerConfig
from .specs import get_gpt_dsa_precision_block_spec, with_dsa_precision

__all__ = ["DSAPrecisionMLAModelProvider", "PrecisionLayerSpec", "dsa_precision_provider"]


@dataclass
class DSAPrecisionMLAModelProvider(MLAModelProvider, DSAPrecisionTransformerConfig):
    """Megatron-Bridge's ``MLAModelProvider`` with the dsa-precision fields.

    As every Bridge config, it defers Megatron's checks to :meth:`finalize` (the fields may be set
    after construction); :meth:`finalize` then validates and freezes the dsa-precision fields, as
    ``DSAPrecisionTransformerConfig.__post_init__`` does for a plain Megatron config."""

    def finalize(self) -> None:
        """Megatron's ``__post_init__`` as Bridge runs it, then the dsa-precision fields'
        validation (one ``ValueError`` naming every field to fix), with the RoPE rule of
        :func:`dsa_precision_provider`."""
        super().finalize()
        _refuse_yarn_x1(self)
        DSAPrecisionTransformerConfig.validate_dsa_precision(self)


def _refuse_yarn_x1(config: DSAPrecisionTransformerConfig) -> None:
    """``ValueError`` for ``dsa_indexer_rope_fp32`` on YaRN with ``rotary_scaling_factor=1``
    (see :func:`dsa_precision_provider`)."""
    if (
        config.dsa_indexer_rope_fp32
        and config.rope_type == "yarn"
        and config.rotary_scaling_factor == 1.0
    ):
        raise ValueError(
            "dsa_indexer_rope_fp32=True with rope_type='yarn' and rotary_scaling_factor=1.0 "
            "(Megatron-Bridge's GLM-5 provider, for a checkpoint whose RoPE is plain: HF "
            "rope_parameters.rope_type='default'): the engines build plain RoPE tables for it, "
            "and YaRN with factor 1 differs from them by rounding; set provider.rope_type = "
            "'rope' (the checkpoint's RoPE, for the whole model) before finalize()."
        )


class PrecisionLayerSpec:
    """A provider's ``transformer_layer_spec`` with the DSA modules swapped for the precision ones.

    Bridge calls it as it calls any layer spec (``spec(config, vp_stage=...)``). Megatron's
    experimental-attention block spec, what the GLM-5 bridge sets, becomes
    :func:`~dsa_precision.megatron.get_gpt_dsa_precision_block_spec` (the same spec with
    Transformer Engine; without TE the package's local backend, which Megatron's builder lacks);
    any other spec (a ``ModuleSpec`` or a function of the config) is built as the provider would
    and then swapped (:func:`~dsa_precision.megatron.with_dsa_precision`, which refuses a spec
    without DSA layers while a dsa-precision field is switched on)."""

    spec: Any
    backend: BackendSpecProvider | None

    def __init__(self, spec: Any, backend: BackendSpecProvider | None = None) -> None:
        if isinstance(spec, PrecisionLayerSpec):  # a provider converted twice: one wrapper
            backend = backend or spec.backend
            spec = spec.spec
        self.spec = spec
        self.backend = backend

    def __repr__(self) -> str:
        name = getattr(self.spec, "__qualname__", None) or type(self.spec).__name__
        return f"PrecisionLayerSpec({name}, backend={type(self.backend).__name__})"

    def __call__(self, config: Any, vp_stage: int | None = None) -> Any:
        if self.spec is eav_specs.get_transformer_block_with_experimental_attention_variant_spec:
            return get_gpt_dsa_precision_block_spec(config, vp_stage=vp_stage, backend=self.backend)
        if self.backend is not None:
            raise ValueError(
                f"backend={self.backend!r}: a backend applies to Megatron's experimental-"
                f"attention block spec only, and this provider's transformer_layer_spec is "
                f"{self.spec!r}; leave backend=None."
            )
        spec = self.spec
        if callable(spec):
            if "vp_stage" in inspect.signature(spec).parameters:
                spec = spec(config, vp_stage=vp_stage)
            else:
                spec = spec(config)
        return with_dsa_precision(spec, config)


def dsa_precision_provider(
    provider: MLAModelProvider,
    *,
    backend: BackendSpecProvider | None = None,
    **fields: Any,
) -> DSAPrecisionMLAModelProvider:
    """A copy of a Bridge ``provider`` that builds the model with the precision DSA modules.

    Args:
        provider: what ``AutoBridge.to_megatron_provider()`` returned (an ``MLAModelProvider``,
            before ``finalize()``); it is not modified.
        backend: the spec backend (``None``: Transformer Engine's when installed, else the
            package's local one); see :func:`~dsa_precision.megatron.get_gpt_dsa_precision_block_spec`.
        **fields: the dsa-precision fields (``dsa_indexer_rope_fp32``,
            ``dsa_indexer_scoring_precision``, ``dsa_indexer_engine``, ``dsa_indexer_topk_source``,
            ``dsa_indexer_cuda_graph``, ``dsa_indexer_scoring_backend``); the rest stay the
            provider's (set them on the provider, before or after, as usual).

    Returns:
        A :class:`DSAPrecisionMLAModelProvider` with the provider's fields and hooks (the Bridge's
        weight loading among them) and ``transformer_layer_spec`` a :class:`PrecisionLayerSpec`
        of the provider's. Call ``finalize()`` before building, as with any Bridge provider.

    Raises:
        TypeError: ``provider`` is not an ``MLAModelProvider``, or a field is not a dsa-precision
            one.

    The GLM-5 bridge of Megatron-Bridge 0.6.2 leaves ``rope_type`` at ``MLATransformerConfig``'s
    ``"yarn"`` with ``rotary_scaling_factor=1.0`` for a checkpoint whose RoPE is plain
    (``rope_parameters.rope_type="default"``; the engines build plain tables for it). YaRN with
    factor 1 is plain RoPE up to rounding, not bit for bit (one of the 32 inverse frequencies of a
    64-lane RoPE differs in float32), so with ``dsa_indexer_rope_fp32`` the engine's tables would
    not be the ones the engine builds: ``finalize()`` raises ``ValueError`` naming the fix
    (``provider.rope_type = "rope"``, what the checkpoint says) instead of choosing silently,
    whichever order the fields were set in.
    """
    if not isinstance(provider, MLAModelProvider):
        raise TypeError(
            f"provider={type(provider).__name__}: pass the MLAModelProvider that "
            "AutoBridge.to_megatron_provider() returns for an MLA + DSA model (GLM-5)."
        )
    unknown = sorted(set(fields) - set(PRECISION_FIELDS))
    if unknown:
        raise TypeError(
            f"dsa_precision_provider() got {', '.join(unknown)}: only the dsa-precision fields "
            f"{PRECISION_FIELDS} are set here; set any other field on the provider."
        )
    names = {f.name for f in dataclasses.fields(provider) if f.init}
    values = {name: getattr(provider, name) for name in names}
    values.update(fields)
    values["transformer_layer_spec"] = PrecisionLayerSpec(provider.transformer_layer_spec, backend)
    new = DSAPrecisionMLAModelProvider(**values)
    # What is not a field (the Bridge's weight-loading hooks, process groups) comes along as is;
    # a validation of an earlier copy does not (finalize() validates this one).
    for name, value in vars(provider).items():
        if name not in names and not name.startswith("_dsa_indexer_precision"):
            new.__dict__[name] = value
    return new
