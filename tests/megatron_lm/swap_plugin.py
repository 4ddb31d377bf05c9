"""pytest plugin: Megatron-LM's own DSA tests with the dsa-precision drop-ins swapped in.

Loaded with ``-p swap_plugin`` after ``-p cpu_plugin`` (see ``run.py``). It never assigns to an
attribute of a ``megatron`` module: it rebinds names *inside Megatron-LM's test modules* (every
module under ``<Megatron-LM>/tests``: test files, their helpers such as
``dsa_native_parity_utils``, conftests), through :mod:`_rebind`, which

* runs each such module with an ``__import__`` that answers the replacements below to its
  ``from X import name`` statements, at module level and inside test functions, and
* afterwards rebinds its globals: a global that is one of the originals below becomes the
  replacement; a global that is a module holding one of them (``import ...dsa as dsa_module``,
  ``from ...experimental_attention_variant import dsa``) becomes a read-through proxy of that
  module whose attributes are the real ones except the replaced names (``dsa_module.DSAIndexer``
  is ``PrecisionDSAIndexer``; ``monkeypatch.setattr(dsa_module, "x", ...)`` still patches the
  real module, as in the stock run).

What is rebound (the originals are matched by identity, wherever a test imports them from):

============================================================  ===================================
original (megatron.core ...)                                  test modules see
============================================================  ===================================
``transformer.experimental_attention_variant.dsa.DSAIndexer``  ``PrecisionDSAIndexer``
``transformer.experimental_attention_variant.dsa.DSAttention`` ``PrecisionDSAttention``
``transformer.transformer_config.MLATransformerConfig``        ``DSAPrecisionTransformerConfig``
                                                               (also via ``megatron.core.transformer``;
                                                               its four fields keep their defaults
                                                               unless ``$DSA_SWAP_FIELDS`` names
                                                               a set: ``rope_fp32``, with the
                                                               profile ``vllm-exact``)
``models.gpt.experimental_attention_variant_module_specs.``    wrapper: ``with_dsa_precision(
``get_dsa_module_spec_for_backend``,                           original(...))`` when the result
``get_experimental_attention_variant_module_spec``,            contains ``DSAttention`` or
``get_transformer_layer_with_experimental_attention_variant_   ``DSAIndexer``, else the result
spec``, ``get_transformer_block_with_experimental_attention_   itself (a spec without DSA, or a
variant_spec``; ``post_training.modelopt.hybrid.model_specs.   mock a test patched in, is returned
get_hybrid_stack_modelopt_spec`` (= ``get_mamba_stack_...``)   unchanged)
``models.hybrid.hybrid_layer_specs.hybrid_stack_spec``         one ``with_dsa_precision`` copy
(= ``mamba_stack_spec``), ``hybrid_inference_stack_spec``      each (a wrapped builder returning
(= ``mamba_inference_stack_spec``)                             the constant returns that copy)
============================================================  ===================================

Where ``cpu_plugin`` already replaced a builder (the default-backend wrapper it applies without
Transformer Engine), the swap wraps that replacement, so the test sees
``with_dsa_precision(cpu_wrapper(original)(...))`` -- the same adaptation as in the stock run, then
the swap. ``DSAttentionSubmodules``, ``DSAIndexerSubmodules``, ``TransformerConfig``, loss helpers and
every other name are untouched. Module-path strings (``mock.patch("megatron.core...dsa.x")``)
address the real modules, as in the stock run.

A probe ``PrecisionDSAttention`` (a top-k-sharing layer, which builds no indexer and needs no
process group) is built once; the outcome is printed in the pytest header and written to
``$DSA_SWAP_REPORT`` (JSON) with the list of rebindings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import traceback
from types import SimpleNamespace
from typing import Any

import _rebind
from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav_specs
from megatron.core.models.hybrid import hybrid_layer_specs
from megatron.core.post_training.modelopt.hybrid import model_specs as modelopt_hybrid_specs
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig

import dsa_precision.megatron as dsap

_SPEC_BUILDERS = (
    (eav_specs, "get_dsa_module_spec_for_backend"),
    (eav_specs, "get_experimental_attention_variant_module_spec"),
    (eav_specs, "get_transformer_layer_with_experimental_attention_variant_spec"),
    (eav_specs, "get_transformer_block_with_experimental_attention_variant_spec"),
    (modelopt_hybrid_specs, "get_hybrid_stack_modelopt_spec"),
)
_SPEC_CONSTANTS = (
    (hybrid_layer_specs, "hybrid_stack_spec"),
    (hybrid_layer_specs, "hybrid_inference_stack_spec"),
)
_DSA_CLASSES = (DSAttention, DSAIndexer)
_CONSTANT_COPIES: dict[int, tuple[Any, Any]] = {}
REPORT: dict[str, Any] = {}

# ``$DSA_SWAP_FIELDS``: comma-separated dsa-precision field sets switched on in every config the
# tests build; empty: the four fields keep their defaults. ``rope_fp32`` pins the engine profile
# "vllm-exact", whose FP32 path follows the model's Hadamard and key LayerNorm epsilon: Megatron's
# tests build models with dsa_indexer_rotate_activation=True and layernorm_epsilon=1e-5, which the
# engine-path profiles (vllm, sglang-fused, lmdeploy) refuse with rope_fp32, by design (their
# engines never rotate, or hard-code eps 1e-6), whichever profile is the package's default.
_FIELD_SWITCHES: dict[str, dict[str, Any]] = {
    "rope_fp32": {"dsa_indexer_rope_fp32": True, "dsa_indexer_engine": "vllm-exact"},
}


def _config_class() -> type:
    names = [n for n in os.environ.get("DSA_SWAP_FIELDS", "").split(",") if n]
    unknown = sorted(set(names) - set(_FIELD_SWITCHES))
    if unknown:
        raise ValueError(f"DSA_SWAP_FIELDS: unknown {unknown}; use {sorted(_FIELD_SWITCHES)}")
    defaults = {k: v for n in names for k, v in _FIELD_SWITCHES[n].items()}
    REPORT["fields"] = defaults
    if not names:
        return dsap.DSAPrecisionTransformerConfig
    cls = type(
        "DSAPrecisionTransformerConfig",
        (dsap.DSAPrecisionTransformerConfig,),
        {"__annotations__": {k: type(v) for k, v in defaults.items()}, **defaults},
    )
    return dataclasses.dataclass(cls)


def _mentions_dsa(node: Any, _seen: set[int] | None = None) -> bool:
    """Whether a spec tree names ``DSAttention`` or ``DSAIndexer`` (what ``with_dsa_precision``
    would change)."""
    seen = _seen if _seen is not None else set()
    if id(node) in seen:
        return False
    seen.add(id(node))
    if isinstance(node, type):
        return node in _DSA_CLASSES
    if isinstance(node, ModuleSpec):
        return _mentions_dsa(node.module, seen) or _mentions_dsa(node.submodules, seen)
    if dataclasses.is_dataclass(node):
        return any(_mentions_dsa(getattr(node, f.name), seen) for f in dataclasses.fields(node))
    if isinstance(node, list | tuple):
        return any(_mentions_dsa(item, seen) for item in node)
    if isinstance(node, dict):
        return any(_mentions_dsa(value, seen) for value in node.values())
    return False


def _swapped(result: Any) -> Any:
    copy = _CONSTANT_COPIES.get(id(result))
    if copy is not None and copy[0] is result:
        return copy[1]
    return dsap.with_dsa_precision(result) if _mentions_dsa(result) else result


def _wrap_builder(original):
    @functools.wraps(original)
    def builder(*args, **kwargs):
        return _swapped(original(*args, **kwargs))

    builder.__dsa_precision_swap__ = True
    return builder


def _probe_attention() -> tuple[bool, str]:
    """Build a ``PrecisionDSAttention`` that shares top-k (no indexer, no process group)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAttentionSubmodules,
    )

    config = dsap.DSAPrecisionTransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=False,
        use_cpu_initialization=True,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=4,
        dsa_indexer_head_dim=32,
        dsa_indexer_topk=8,
        dsa_indexer_topk_freq=2,
    )
    try:
        dsap.PrecisionDSAttention(
            config,
            DSAttentionSubmodules(indexer=None),
            layer_number=2,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            pg_collection=SimpleNamespace(),
        )
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, "built"


def _probe() -> dict[str, Any]:
    try:
        builds, detail = _probe_attention()
    except Exception:
        return {"builds": False, "probe": traceback.format_exc(limit=1).strip()}
    return {"builds": builds, "probe": detail}


def _register() -> None:
    _rebind.register(DSAIndexer, dsap.PrecisionDSAIndexer)
    _rebind.register(DSAttention, dsap.PrecisionDSAttention)
    _rebind.register(MLATransformerConfig, _config_class())
    for module, name in _SPEC_CONSTANTS:
        constant = getattr(module, name)
        copy = dsap.with_dsa_precision(constant)
        _CONSTANT_COPIES[id(constant)] = (constant, copy)
        _rebind.register(constant, copy)
    for module, name in _SPEC_BUILDERS:
        original = getattr(module, name)
        # cpu_plugin may already have replaced the builder (default backend without TE): wrap
        # what the test modules see now, so both adaptations apply.
        _rebind.register(original, _wrap_builder(_rebind.resolve(original)))


REPORT["probe"] = _probe()
_register()
_rebind.activate(
    os.path.join(os.path.abspath(os.environ.get("MEGATRON_LM_ROOT", os.getcwd())), "tests")
)


def pytest_report_header(config) -> list[str]:
    info = REPORT["probe"]
    return [
        "swap_plugin: DSAIndexer, DSAttention, MLATransformerConfig, DSA spec builders/constants "
        "rebound in Megatron-LM's test modules",
        f"swap_plugin: probe PrecisionDSAttention builds={info['builds']} ({info['probe']})",
        f"swap_plugin: dsa-precision fields switched on: {REPORT['fields'] or 'none'}",
    ]


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("DSA_SWAP_REPORT")
    if not path:
        return
    REPORT["dsa_precision"] = os.path.dirname(dsap.__file__)
    REPORT["rebound"] = _rebind.rebound()
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(REPORT, fh, indent=1, default=str)
