"""The megatron-core surface the integration relies on: listed once here, checked against the
installed release.

Every Megatron name the package uses is below -- what it imports, the module functions it calls
(with the positional count and keywords of each call), the methods it overrides or calls through
``super()`` (with their leading parameters), the instance attributes it reads on a built layer,
the attributes of the objects Megatron hands it and the config fields it reads. Nothing of
megatron-core is replaced or reassigned. :func:`_check_megatron_core` (run when
``dsa_precision.megatron`` is imported) checks the classes, functions, signatures and fields;
:func:`_check_built` checks the instance attributes on each layer as it is built (they exist only
on a constructed object). Either raises one ``ImportError`` naming the installed megatron-core
version, the tested one and everything that changed. ``tests/megatron/test_compat.py`` pins this
list against the package's source (its imports, calls and attribute reads), so a name used and
not listed, or listed and no longer used, fails the suite. Tested: megatron-core 0.19.2.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

__all__ = ["TESTED_MEGATRON_BRIDGE", "TESTED_MEGATRON_CORE"]

TESTED_MEGATRON_CORE = "0.19.2"
TESTED_MEGATRON_BRIDGE = "0.6.2"

_EAV = "megatron.core.transformer.experimental_attention_variant"
_SPECS = "megatron.core.models.gpt.experimental_attention_variant_module_specs"
_DSA = f"{_EAV}.dsa"
_LAYOUT = f"{_EAV}.dsa_layout"

# Every Megatron name the package imports or reaches through an imported module, by its dotted
# path, with the calls made to it: (positional arguments, keywords) per call shape; () for a
# name that is only referenced (a class subclassed or annotated, a flag read).
_Call = tuple[int, tuple[str, ...]]
_CALLS: dict[str, tuple[_Call, ...]] = {
    # constructed by a packed forward's CUDA graph (graphs.graph_packing's buckets)
    "megatron.core.packed_seq_params.PackedSeqParams": (
        (0, ("cu_seqlens_kv", "cu_seqlens_q", "max_seqlen_kv", "max_seqlen_q", "qkv_format")),
    ),
    "megatron.core.tensor_parallel.mappings.gather_from_sequence_parallel_region": (
        (1, ("group",)),
    ),
    f"{_DSA}.DSAIndexer": (),
    f"{_DSA}.DSAttention": (),
    _LAYOUT: (),
    f"{_LAYOUT}.ensure_sbhd": ((2, ()),),
    f"{_LAYOUT}.get_packed_qk_cu_seqlens": ((1, ()),),
    f"{_LAYOUT}.build_packed_allgather_cp_local_positions": (
        (4, ("output_size",)),
        (4, ("cu_seqlens_cover_output", "output_size")),
    ),
    f"{_LAYOUT}.build_zigzag_cp_local_positions": ((4, ()),),
    f"{_LAYOUT}.build_zigzag_allgather_cp_key_reorder": ((0, ("cp_size", "device", "sq")),),
    f"{_LAYOUT}.build_packed_allgather_cp_query_positions_and_key_reorder": (
        (
            0,
            (
                "cp_rank",
                "cp_size",
                "cu_seqlens_kv",
                "cu_seqlens_q",
                "device",
                "global_output_size",
                "key_cu_seqlens_cover_output",
                "key_local_output_size",
                "local_output_size",
                "query_cu_seqlens_cover_output",
            ),
        ),
    ),
    "megatron.core.transformer.transformer_config.MLATransformerConfig": (),
    "megatron.training.argument_utils.core_transformer_config_from_args": ((1, ()),),
    "megatron.core.models.backends.BackendSpecProvider": (),
    "megatron.core.models.backends.LocalSpecProvider": (),
    "megatron.core.models.backends.LocalSpecProvider.layer_norm": ((0, ("for_qk", "rms_norm")),),
    _SPECS: (),
    f"{_SPECS}.HAVE_TE": (),
    f"{_SPECS}.TESpecProvider": ((0, ()),),
    f"{_SPECS}.get_dsa_module_spec_for_backend": ((1, ("backend",)),),
    f"{_SPECS}.get_transformer_block_with_experimental_attention_variant_spec": (
        (1, ("pp_rank", "vp_stage")),
    ),
    f"{_SPECS}.get_transformer_layer_with_experimental_attention_variant_spec": (
        (1, ("backend",)),
    ),
    "megatron.core.transformer.spec_utils.ModuleSpec": (),
    "megatron.core.transformer.transformer_block.TransformerBlockSubmodules": (
        (0, ("layer_norm", "layer_specs")),
    ),
    "megatron.core.transformer.transformer_block.get_num_layers_to_build": (
        (1, ("pp_rank", "vp_stage")),
    ),
    "megatron.core.transformer.transformer_layer.get_transformer_layer_offset": (
        (1, ("pp_rank", "vp_stage")),
    ),
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear": (),
    f"{_EAV}.absorbed_mla.AbsorbedMLASelfAttentionSubmodules": (),
    "megatron.core.post_training.modelopt.layers.Linear": (),
    # The CPU redirect of dsa_precision.testing.megatron.
    "megatron.core.tensor_parallel.random": (),
    "megatron.core.tensor_parallel.random.initialize_rng_tracker": (
        (0, ("force_reset",)),
        (0, ("force_reset", "inference_rng_tracker")),
    ),
    "megatron.core.transformer.torch_norm.WrappedTorchNorm": (),
    # dsa_kernel_backend="tilelang" beside the drop-ins (kernel_backend.py).
    f"{_EAV}.dsa_kernels": (),
    f"{_EAV}.dsa_kernels.use_fused_dsa_kernels": ((1, ()),),
    "megatron.core.utils._validate_dsa_kernel_backend_dependencies": ((1, ()),),
    # `bench --megatron` (cli/bench_megatron.py): Megatron's own indexer on each backend.
    "megatron.core.utils": (),
    "megatron.core.utils._missing_tilelang_dsa_kernel_dependencies": ((0, ()),),
    "megatron.core.transformer.enums.AttnBackend": (),
    "megatron.core.transformer.enums.AttnBackend.auto": (),
    _DSA: (),
    f"{_DSA}.fused_qk_topk_naive": ((4, ("use_relu", "varlen_ends", "varlen_starts")),),
    f"{_EAV}.dsa_kernels.run_fused_qk_topk": ((7, ("block_size",)),),
    f"{_EAV}.dsa_masking": (),
    f"{_EAV}.dsa_masking.build_fused_indexer_varlen_bounds": (
        (0, ("device", "key_positions", "mask", "skv", "sq", "varlen_ends", "varlen_starts")),
    ),
}  # fmt: skip
# Names that exist only when a flag of their module is set (Transformer Engine installed).
_PRESENT_IF = {f"{_SPECS}.TESpecProvider": f"{_SPECS}.HAVE_TE"}
# Imported inside a function, checked only where the module is installed (megatron.training is
# not part of every megatron-core install; config_from_args needs it).
_OPTIONAL_MODULES = ("megatron.training",)

# Megatron classes subclassed: method -> leading parameters (after self) the package relies on,
# for each method it overrides (Megatron calls it) or calls through super().
_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    f"{_DSA}.DSAIndexer": {
        "__init__": ("config", "submodules"),
        "forward_before_topk": ("x", "qr", "packed_seq_params"),
        "forward_with_scores": ("x", "qr", "mask", "packed_seq_params"),
        "_apply_rope": ("x", "rotary_pos_emb", "mscale", "cu_seqlens"),
    },
    f"{_DSA}.DSAttention": {
        "__init__": ("config", "submodules", "layer_number"),
        "forward": (
            "query", "key", "value", "attention_mask", "x", "qr", "position_ids",
            "attn_mask_type", "attention_bias", "packed_seq_params", "up_v_weight",
        ),
        "_get_index_share_topk_holder": ("packed_seq_params", "attention_mask"),
        "_get_index_share_topk_length_holder": ("packed_seq_params", "attention_mask"),
    },
    "megatron.core.transformer.transformer_config.MLATransformerConfig": {"__post_init__": ()},
}  # fmt: skip
# (LocalDSASpecProvider adds ``linear()``, which Megatron's DSA spec builder calls on the backend
# with no argument; LocalSpecProvider has none to override.)

# Instance attributes of a built module the package reads (Megatron's __init__ sets them; the
# seam presents skip_topk / index_share / source_layer per call, see attention.py).
_INSTANCE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "DSAttention": (
        "config", "indexer", "index_share", "index_topk", "layer_number", "pg_collection",
        "skip_topk", "source_layer",
    ),
    "DSAIndexer": (
        "config", "index_head_dim", "index_n_heads", "index_topk", "k_norm",
        "linear_weights_proj", "linear_wk", "linear_wq_b", "pg_collection",
        "qk_pos_emb_head_dim", "rotary_pos_emb",
    ),
}  # fmt: skip
# Attributes of those instance attributes, with their call shapes (() for a value).
# Checked on the built layer (the attribute's class depends on the config).
_ATTRIBUTES_OF: dict[tuple[str, str], dict[str, tuple[_Call, ...]]] = {
    ("DSAIndexer", "rotary_pos_emb"): {"get_rotary_seq_len": ((5, ()),)},
    ("DSAIndexer", "linear_weights_proj"): {"weight": ()},  # its float32 product (FP32 weights)
}
# Fields of the dataclasses Megatron hands the layers: PackedSeqParams, and ProcessGroupCollection
# (``pg_collection``; its groups' size() and rank() are torch.distributed's).
_PACKED_SEQ_FIELDS = ("max_seqlen_kv", "max_seqlen_q", "qkv_format")
_PROCESS_GROUP_FIELDS = ("cp", "tp")
# TransformerConfig fields read (besides the package's own four).
_CONFIG_FIELDS = (
    "apply_rope_fusion", "dsa_indexer_head_dim", "dsa_indexer_k_norm_epsilon",
    "dsa_indexer_k_norm_fp32", "dsa_indexer_loss_coeff", "dsa_indexer_n_heads",
    "dsa_indexer_rope_interleaved", "dsa_indexer_topk_freq",
    "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "experimental_attention_variant",
    "layernorm_epsilon", "normalization", "params_dtype", "qk_pos_emb_head_dim", "rope_type",
    "sequence_parallel",
    # dsa_kernel_backend="tilelang": what Megatron's TileLang sparse attention runs.
    "attention_backend", "dsa_indexer_topk", "dsa_kernel_backend", "kv_lora_rank",
    "num_attention_heads", "tensor_model_parallel_size",
    # The indexer's RoPE (its RotaryEmbedding / YarnRotaryEmbedding), for the engine's tables.
    "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
)  # fmt: skip


# Megatron-Bridge (``dsa_precision.megatron.bridge`` only; checked when that module is imported,
# since importing megatron.bridge loads every model bridge it has).
_BRIDGE_CALLS: dict[str, tuple[_Call, ...]] = {
    "megatron.bridge.models.mla_provider.MLAModelProvider": (),
}
_BRIDGE_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    "megatron.bridge.models.mla_provider.MLAModelProvider": {"finalize": ()},
}
# Fields of the Bridge's provider the package reads or sets (besides Megatron's CONFIG_FIELDS).
_BRIDGE_PROVIDER_FIELDS = ("transformer_layer_spec",)


def _megatron_core_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def _resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def _call_problems(name: str, obj: Any, calls: tuple[_Call, ...]) -> list[str]:
    problems = []
    for npos, keywords in calls:
        if not callable(obj):
            return [f"{name} is no longer callable"]
        # A method reached through its class (``Class.method``) also takes self.
        unbound = inspect.isfunction(obj) and "." in obj.__qualname__
        try:
            inspect.signature(obj).bind(*range(npos + unbound), **dict.fromkeys(keywords))
        except TypeError as exc:
            shown = ", ".join([f"<{npos} positional>"] + [f"{k}=" for k in keywords])
            problems.append(f"{name}{inspect.signature(obj)} no longer takes ({shown}): {exc}")
        except ValueError:  # no signature (a builtin): nothing to check
            pass
    return problems


def _method_problems(path: str, cls: Any, methods: dict[str, tuple[str, ...]]) -> list[str]:
    """The ``methods`` of class ``cls`` (at ``path``) that are gone or no longer take their
    leading parameters."""
    short = path.rsplit(".", 1)[1]
    problems = []
    for method, params in methods.items():
        fn = getattr(cls, method, None)
        if fn is None:
            problems.append(f"{short}.{method} is missing")
        elif _params(fn)[: len(params)] != params:
            problems.append(f"{short}.{method}{_params(fn)} no longer takes {params}")
    return problems


def _surface_problems() -> list[str]:
    problems = []
    for path, calls in _CALLS.items():
        if path in _PRESENT_IF and not _resolve(_PRESENT_IF[path]):
            continue
        try:
            obj = _resolve(path)
        except ModuleNotFoundError:
            if path.startswith(_OPTIONAL_MODULES):
                continue
            problems.append(f"{path} is missing (its module does not import)")
            continue
        except AttributeError:
            problems.append(f"{path} is missing")
            continue
        problems += _call_problems(path, obj, calls)
    for path, methods in _METHODS.items():
        try:
            cls = _resolve(path)
        except (ModuleNotFoundError, AttributeError):
            continue  # reported above
        problems += _method_problems(path, cls, methods)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    for cls, names in (
        (PackedSeqParams, _PACKED_SEQ_FIELDS),
        (ProcessGroupCollection, _PROCESS_GROUP_FIELDS),
        (MLATransformerConfig, _CONFIG_FIELDS),
    ):
        fields = {f.name for f in dataclasses.fields(cls)}
        problems += [f"{cls.__name__} has no field {f}" for f in names if f not in fields]
    return problems


def _raise(problems: list[str]) -> None:
    raise ImportError(
        f"dsa_precision.megatron was built against megatron-core {TESTED_MEGATRON_CORE}; the "
        f"installed megatron-core {_megatron_core_version()} differs where the drop-in modules "
        "rely on it:\n  - " + "\n  - ".join(problems) + "\nInstall megatron-core=="
        f"{TESTED_MEGATRON_CORE} or a dsa-precision release that supports this version."
    )


def _check_megatron_core() -> None:
    """Raise ``ImportError`` naming the megatron-core version and every missing or changed piece
    of the surface the integration relies on (classes, functions, signatures, fields)."""
    try:
        problems = _surface_problems()
    except ImportError as exc:
        raise ImportError(
            f"dsa_precision.megatron needs megatron-core's DSA modules ({exc}); pip install "
            f"'megatron-core=={TESTED_MEGATRON_CORE}' (or dsa-precision[megatron])."
        ) from exc
    if problems:
        _raise(problems)


def _megatron_bridge_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-bridge")
    except PackageNotFoundError:
        return "unknown"


def _bridge_problems() -> list[str]:
    importlib.import_module("megatron.bridge")  # its own ImportError, not "a name is missing"
    problems = []
    for path, calls in _BRIDGE_CALLS.items():
        try:
            obj = _resolve(path)
        except AttributeError:
            problems.append(f"{path} is missing")
            continue
        problems += _call_problems(path, obj, calls)
        problems += _method_problems(path, obj, _BRIDGE_METHODS.get(path, {}))
        if dataclasses.is_dataclass(obj):
            fields = {f.name for f in dataclasses.fields(obj)}
            short = path.rsplit(".", 1)[1]
            problems += [
                f"{short} has no field {f}" for f in _BRIDGE_PROVIDER_FIELDS if f not in fields
            ]
    return problems


def _check_megatron_bridge() -> None:
    """Raise ``ImportError`` naming the Megatron-Bridge version and every missing or changed name
    the Bridge integration relies on, or what to install when Bridge does not import."""
    try:
        problems = _bridge_problems()
    except ImportError as exc:
        raise ImportError(
            f"dsa_precision.megatron.bridge needs Megatron-Bridge {TESTED_MEGATRON_BRIDGE}, which "
            f"does not import here ({exc}); see the README, 'With Megatron-Bridge' (it needs "
            "Transformer Engine: megatron/bridge/peft/lora_layers.py imports "
            "transformer_engine.pytorch)."
        ) from exc
    if problems:
        raise ImportError(
            f"dsa_precision.megatron.bridge was built against Megatron-Bridge "
            f"{TESTED_MEGATRON_BRIDGE}; the installed {_megatron_bridge_version()} differs where "
            "it relies on it:\n  - " + "\n  - ".join(problems) + "\nInstall megatron-bridge=="
            f"{TESTED_MEGATRON_BRIDGE}."
        )


def _check_built(module: Any, megatron_class: str) -> None:
    """Raise ``ImportError`` (version and changes) if a just-built ``module`` (a subclass of
    Megatron's ``megatron_class``) lacks an instance attribute the package reads."""
    problems = []
    for name in _INSTANCE_ATTRIBUTES[megatron_class]:
        if name not in module.__dict__ and not hasattr(module, name):
            problems.append(f"{megatron_class}.__init__ no longer sets self.{name}")
            continue
        value = getattr(module, name)
        for attr, calls in _ATTRIBUTES_OF.get((megatron_class, name), {}).items():
            where = f"{megatron_class}.{name}.{attr}"
            if not hasattr(value, attr):
                problems.append(f"{where} is missing ({type(value).__name__})")
            else:
                problems += _call_problems(where, getattr(value, attr), calls)
    if problems:
        _raise(problems)
