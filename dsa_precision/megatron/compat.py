"""The megatron-core surface the integration relies on, checked once, at import.

The drop-in modules subclass ``DSAIndexer`` and ``DSAttention`` and call Megatron's public layout
and masking helpers; nothing of megatron-core is replaced or reassigned. What they rely on is
listed here (classes, methods with their parameters, instance attributes, config fields and
module functions), and :func:`check_megatron_core` raises one ``ImportError`` naming the installed
megatron-core version and everything that changed. Tested: megatron-core 0.19.2.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

__all__ = ["TESTED_MEGATRON_CORE", "check_megatron_core", "megatron_core_version"]

TESTED_MEGATRON_CORE = "0.19.2"

# (module, name) -> expected parameters (None: must exist and be callable)
_FUNCTIONS: dict[tuple[str, str], tuple[str, ...] | None] = {
    ("dsa_layout", "get_packed_qk_cu_seqlens"): ("packed_seq_params",),
    ("dsa_layout", "build_zigzag_cp_local_positions"): ("seq_len", "cp_size", "cp_rank", "device"),
    ("dsa_layout", "build_zigzag_allgather_cp_key_reorder"): ("sq", "cp_size", "device"),
    ("dsa_layout", "build_packed_allgather_cp_query_positions_and_key_reorder"): None,
    ("dsa_layout", "build_packed_allgather_cp_local_positions"): None,
    ("dsa", "fused_qk_topk_naive"): None,
    ("dsa", "is_dsa_skip_topk_layer"): ("layer_number", "skip_topk_offset", "topk_freq"),
}
# class -> method -> expected leading parameters (after self)
_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    "DSAIndexer": {
        "__init__": ("config", "submodules", "pg_collection"),
        "forward_before_topk": ("x", "qr", "packed_seq_params"),
        "forward_with_scores": ("x", "qr", "mask", "packed_seq_params"),
        "_apply_rope": ("x", "rotary_pos_emb", "mscale", "cu_seqlens"),
    },
    "DSAttention": {
        "__init__": ("config", "submodules", "layer_number", "attn_mask_type", "attention_type"),
        "forward": (
            "query", "key", "value", "attention_mask", "x", "qr", "position_ids",
            "attn_mask_type", "attention_bias", "packed_seq_params", "up_v_weight",
        ),
        "_get_index_share_topk_holder": ("packed_seq_params", "attention_mask"),
        "_get_index_share_topk_length_holder": ("packed_seq_params", "attention_mask"),
    },
}  # fmt: skip
# Instance attributes DSAttention.forward reads to decide whether a layer computes its top-k or
# reads it from the index-share holder (the route the owned top-k takes).
_DSATTENTION_STATE = ("skip_topk", "index_share", "source_layer", "layer_number", "pg_collection")
_INDEXER_STATE = (
    "linear_wq_b", "linear_wk", "k_norm", "linear_weights_proj", "rotary_pos_emb",
    "index_n_heads", "index_head_dim", "qk_pos_emb_head_dim", "pg_collection",
)  # fmt: skip
_CONFIG_FIELDS = (
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_rotate_activation", "dsa_indexer_k_norm_fp32", "dsa_indexer_rope_interleaved",
    "dsa_indexer_scoring_relu", "dsa_indexer_topk_freq", "dsa_kernel_backend",
    "experimental_attention_variant", "qk_pos_emb_head_dim", "rope_type", "apply_rope_fusion",
    "sequence_parallel", "context_parallel_size",
)  # fmt: skip


def megatron_core_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def _surface_problems() -> list[str]:
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_layout
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    modules = {"dsa": dsa, "dsa_layout": dsa_layout}
    problems = []
    for (module, name), params in _FUNCTIONS.items():
        fn = getattr(modules[module], name, None)
        if not callable(fn):
            problems.append(f"{module}.{name} is missing")
        elif params is not None and _params(fn)[: len(params)] != params:
            problems.append(f"{module}.{name}{_params(fn)} no longer takes {params}")
    for cls_name, methods in _METHODS.items():
        cls = getattr(dsa, cls_name, None)
        if cls is None:
            problems.append(f"dsa.{cls_name} is missing")
            continue
        for method, params in methods.items():
            fn = getattr(cls, method, None)
            if fn is None:
                problems.append(f"{cls_name}.{method} is missing")
            elif _params(fn)[: len(params)] != params:
                problems.append(f"{cls_name}.{method}{_params(fn)} no longer takes {params}")
    for cls_name, attrs in (("DSAttention", _DSATTENTION_STATE), ("DSAIndexer", _INDEXER_STATE)):
        cls = getattr(dsa, cls_name, None)
        if cls is None:
            continue  # reported above
        source = inspect.getsource(cls.__init__)
        problems += [
            f"{cls_name} no longer sets self.{a}" for a in attrs if f"self.{a} =" not in source
        ]
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    problems += [f"TransformerConfig has no field {f}" for f in _CONFIG_FIELDS if f not in fields]
    return problems


def check_megatron_core() -> None:
    """Raise ``ImportError`` naming the megatron-core version and every missing or changed piece
    of the surface the integration relies on."""
    try:
        problems = _surface_problems()
    except ImportError as exc:
        raise ImportError(
            f"dsa_precision.megatron needs megatron-core's DSA modules ({exc}); pip install "
            f"'megatron-core=={TESTED_MEGATRON_CORE}' (or dsa-precision[megatron])."
        ) from exc
    if problems:
        raise ImportError(
            f"dsa_precision.megatron was built against megatron-core {TESTED_MEGATRON_CORE}; the "
            f"installed megatron-core {megatron_core_version()} differs where the drop-in modules "
            "rely on it:\n  - " + "\n  - ".join(problems) + "\nInstall megatron-core=="
            f"{TESTED_MEGATRON_CORE} or a dsa-precision release that supports this version."
        )
