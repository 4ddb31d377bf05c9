"""The training side of the comparisons: the package's operands of synthetic projections, as the
Megatron integration builds them (Megatron's BF16 preprocessing unless ``rope_fp32``, the
engine's rules for FP8)."""

from __future__ import annotations

import dataclasses

from ..config import IndexerPrecisionConfig
from ..operands import ScoringOperands
from ..prepare import prepare_indexer_operands
from ..preprocess import IndexerPreprocess
from ..preprocess_kernel import Impl
from .synthetic import SyntheticIndexerInputs

__all__ = ["IndexerFields", "training_operands"]


@dataclasses.dataclass(frozen=True)
class IndexerFields:
    """The model's indexer layout fields (both sides): Hadamard rotation and RoPE layout."""

    hadamard: bool = False
    rope_interleaved: bool = False


def training_operands(
    inputs: SyntheticIndexerInputs,
    config: IndexerPrecisionConfig,
    fields: IndexerFields,
    impl: Impl = "auto",
) -> ScoringOperands:
    """The package's operands of ``inputs`` for one configuration; ``impl`` as for
    :func:`~dsa_precision.prepare_indexer_operands`."""
    pre = IndexerPreprocess(
        inputs.head_dim,
        inputs.rope_dim,
        k_norm=inputs.k_norm,
        rope_interleaved=fields.rope_interleaved,
        rotate_activation=fields.hadamard,
        rope_fp32=config.rope_fp32,
        engine=config.engine,
    )
    return prepare_indexer_operands(
        pre, inputs.q, inputs.k, inputs.w, inputs.freqs, config=config, impl=impl
    )
