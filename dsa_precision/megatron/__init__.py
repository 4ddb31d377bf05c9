"""Megatron Core integration (megatron-core 0.19): drop-in DSA modules that own their calls.

Usage in a training script::

    import dsa_precision.megatron as dsap

    config = dsap.DSAPrecisionTransformerConfig(
        ...,  # the usual MLA + DSA fields
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine="vllm-eager",
    )
    block_spec = dsap.get_gpt_dsa_precision_block_spec(config)

Nothing of megatron-core is replaced or reassigned: ``PrecisionDSAIndexer`` and
``PrecisionDSAttention`` subclass Megatron's modules and call its public functions; the surface
they rely on is checked at import (:mod:`.compat`). See ``docs/megatron.md``.
"""

# ruff: noqa: I001, E402  (the surface check runs before the modules that rely on it import)

from typing import TYPE_CHECKING, NoReturn

from .compat import TESTED_MEGATRON_BRIDGE, TESTED_MEGATRON_CORE, _check_megatron_core

_check_megatron_core()

from .config import DSAPrecisionTransformerConfig, add_dsa_precision_args, config_from_args
from .indexer import PrecisionDSAIndexer
from .attention import PrecisionDSAttention
from .replay import engine_topk, set_replay_validation
from .record import record_topk
from .monitor import topk_metrics
from .specs import (
    LocalDSASpecProvider,
    get_dsa_precision_module_spec,
    get_gpt_dsa_precision_block_spec,
    with_dsa_precision,
)

__all__ = [
    "TESTED_MEGATRON_BRIDGE",
    "TESTED_MEGATRON_CORE",
    "DSAPrecisionTransformerConfig",
    "LocalDSASpecProvider",
    "PrecisionDSAIndexer",
    "PrecisionDSAttention",
    "add_dsa_precision_args",
    "config_from_args",
    "engine_topk",
    "get_dsa_precision_module_spec",
    "get_gpt_dsa_precision_block_spec",
    "record_topk",
    "set_replay_validation",
    "topk_metrics",
    "with_dsa_precision",
]

# Names of earlier releases, and the one to use now (0.x: no aliases, a pointer).
_RENAMED = {
    "capture_topk": "dsa_precision.megatron.record_topk (its .picks is a TopkPicks)",
    "save_topk": "dsa_precision.capture.save_picks(path, picks)",
    "load_topk": "dsa_precision.capture.load_picks(path)",
    "EngineTopk": "dsa_precision.picks.TopkPicks",
    "CapturedTopk": "dsa_precision.picks.TopkPicks (record_topk's .picks)",
}


# Hidden from the type checker: a name that is gone stays an error there, not Any.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> NoReturn:
        if name in _RENAMED:
            raise AttributeError(f"dsa_precision.megatron.{name} is gone; use {_RENAMED[name]}.")
        raise AttributeError(f"module 'dsa_precision.megatron' has no attribute {name!r}")
