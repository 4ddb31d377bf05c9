"""Megatron Core integration (megatron-core 0.19.x).

Usage in a training script::

    import dsa_precision.megatron as dsap

    dsap.install()  # once: the named, version-checked seams
    config = dsap.DSAPrecisionTransformerConfig(
        ...,  # the usual MLA + DSA fields
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
    )
    block_spec = dsap.get_gpt_dsa_precision_block_spec(config)

See ``docs/megatron.md``.
"""

# ruff: noqa: I001  (config first: it validates before anything is built)

from .config import DSAPrecisionTransformerConfig, add_dsa_precision_args, config_from_args
from .seams import SUPPORTED_MEGATRON_CORE, install, installed, precision_scope, uninstall
from .modules import PrecisionDSAIndexer, PrecisionDSAttention
from .specs import (
    LocalDSASpecProvider,
    get_dsa_precision_module_spec,
    get_gpt_dsa_precision_block_spec,
    with_dsa_precision,
)

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "DSAPrecisionTransformerConfig",
    "LocalDSASpecProvider",
    "PrecisionDSAIndexer",
    "PrecisionDSAttention",
    "add_dsa_precision_args",
    "config_from_args",
    "get_dsa_precision_module_spec",
    "get_gpt_dsa_precision_block_spec",
    "install",
    "installed",
    "precision_scope",
    "uninstall",
    "with_dsa_precision",
]
