"""Megatron configuration: the dsa-precision ``TransformerConfig`` fields and their flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

from .. import _cudnn
from ..config import IndexerPrecisionConfig
from ..engines import DEFAULT_ENGINE, ENGINE_PROFILES
from .replay import TOPK_SOURCES

__all__ = ["DSAPrecisionTransformerConfig", "add_dsa_precision_args", "config_from_args"]


@dataclass
class DSAPrecisionTransformerConfig(MLATransformerConfig):
    """``MLATransformerConfig`` with the dsa-precision fields; the defaults are Megatron's
    behaviour, byte for byte. Every other field, ``dsa_kernel_backend`` and its FlashMLA
    requirement included, is validated by Megatron as usual."""

    ####################
    # dsa-precision
    ####################
    dsa_indexer_rope_fp32: bool = False
    """Keep the DSA indexer's key LayerNorm -> RoPE (and query RoPE, Hadamard) in FP32 after the
    projections, following the inference engine's rules (dsa_indexer_engine), so q and k reach
    scoring as the engine builds them. Default False: Megatron's BF16 path, bit for bit."""

    dsa_indexer_scoring_precision: Literal["bf16", "fp8"] = "bf16"
    """Operand precision of the DSA indexer scoring. "fp8": E4M3 operands with one FP32 descale
    per 128-vector and FP32 head weights, as the inference engine scores (dsa_indexer_engine);
    the top-k is computed by dsa-precision's kernels (cuDNN's SM90 FP8 indexer), the sparse
    attention stays Megatron's. Needs dsa_indexer_loss_coeff 0, dsa_indexer_scoring_relu, 32 or
    64 indexer heads of dim 128, and on a GPU an SM90 device with nvidia-cudnn-frontend.
    Default "bf16"."""

    dsa_indexer_engine: str = DEFAULT_ENGINE.name
    """The inference engine profile whose numerics the two fields above reproduce (a name of
    dsa_precision.ENGINE_PROFILES). The default keeps dsa-precision's original contract."""

    dsa_indexer_topk_source: Literal["compute", "replay", "verify"] = "compute"
    """Where each DSA layer's top-k comes from: "compute" (as configured), "replay" (the keys the
    inference engine picked for this micro-batch, handed in with
    dsa_precision.megatron.engine_topk; the indexer does not score; needs zero indexer loss) or
    "verify" (compute as configured and compare with the engine's picks; metrics from
    dsa_precision.megatron.topk_metrics). Default "compute"."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dsa_indexer_precision  # noqa: B018 - validates the fields and their combination

    @property
    def dsa_indexer_precision(self) -> IndexerPrecisionConfig:
        """The dsa-precision fields as the core's frozen :class:`IndexerPrecisionConfig`,
        validated against the model (one ``ValueError`` naming every field to fix)."""
        return _validate_precision(self)


def _validate_precision(config: DSAPrecisionTransformerConfig) -> IndexerPrecisionConfig:
    """One ``ValueError`` naming every field that keeps the requested precision from running."""
    try:
        precision = IndexerPrecisionConfig.from_megatron_config(config)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"dsa_indexer_{exc}") from None
    problems = []
    source = config.dsa_indexer_topk_source
    if source not in TOPK_SOURCES:
        raise ValueError(
            f"dsa_indexer_topk_source={source!r} is not a top-k source; use one of {TOPK_SOURCES}."
        )
    if source == "replay" and config.dsa_indexer_loss_coeff not in (None, 0, 0.0):
        problems.append(
            f"dsa_indexer_loss_coeff={config.dsa_indexer_loss_coeff!r}: dsa_indexer_topk_source="
            "'replay' skips the indexer's scoring, so there are no scores to train; set it to 0"
        )
    if precision == IndexerPrecisionConfig(engine=precision.engine) and not problems:
        return precision  # Megatron's behaviour: nothing of ours runs
    if config.experimental_attention_variant != "dsa":
        problems.append(
            f"experimental_attention_variant={config.experimental_attention_variant!r}: the "
            "dsa-precision fields act on DSA; set experimental_attention_variant='dsa'"
        )
    if precision.fp8:
        if not config.dsa_indexer_scoring_relu:
            problems.append(
                "dsa_indexer_scoring_relu=False: the FP8 indexer kernels apply ReLU per head; "
                "set dsa_indexer_scoring_relu=True"
            )
        if torch.cuda.is_available() and not _cudnn.dsa_available():
            problems.append(
                f"dsa_indexer_scoring_precision='fp8' on this GPU: {_cudnn.dsa_unavailable_reason()}"
            )
    try:
        precision.validate_for_model(
            indexer_loss_coeff=config.dsa_indexer_loss_coeff,
            n_heads=config.dsa_indexer_n_heads,
            head_dim=config.dsa_indexer_head_dim,
            rotate_activation=config.dsa_indexer_rotate_activation,
            rope_interleaved=config.dsa_indexer_rope_interleaved,
        )
    except ValueError as exc:
        problems.extend(
            line.removeprefix("  - ") for line in str(exc).splitlines()[1:] if line.strip()
        )
    if problems:
        raise ValueError(
            f"dsa-precision fields ({precision.short_str()}, dsa_indexer_engine="
            f"{precision.engine.name!r}) cannot be honoured:\n  - " + "\n  - ".join(problems)
        )
    return precision


def add_dsa_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron's ``parse_args``: the dsa-precision flags."""
    group = parser.add_argument_group(title="dsa-precision")
    group.add_argument(
        "--dsa-indexer-rope-fp32",
        action="store_true",
        help="Keep the DSA indexer key LayerNorm -> RoPE (and query RoPE) in FP32.",
    )
    group.add_argument(
        "--dsa-indexer-scoring-precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="Operand precision of the DSA indexer scoring matmul (default bf16).",
    )
    group.add_argument(
        "--dsa-indexer-topk-source",
        choices=TOPK_SOURCES,
        default="compute",
        help="Where each DSA layer's top-k comes from: computed, replayed from the inference "
        "engine, or computed and verified against it (default compute).",
    )
    group.add_argument(
        "--dsa-indexer-engine",
        choices=sorted(ENGINE_PROFILES),
        default=DEFAULT_ENGINE.name,
        help="Inference engine profile the indexer numerics reproduce "
        f"(default {DEFAULT_ENGINE.name}).",
    )
    return parser


def config_from_args(args: argparse.Namespace, **overrides: Any) -> DSAPrecisionTransformerConfig:
    """The ``TransformerConfig`` Megatron's training entry builds from ``args``, as a
    :class:`DSAPrecisionTransformerConfig` carrying the dsa-precision flags.

    ``core_transformer_config_from_args`` replaces any ``config_class`` by
    ``MLATransformerConfig`` when ``--multi-latent-attention`` is set, so this builds that config
    first and re-validates its fields in the subclass.
    """
    from megatron.training.argument_utils import core_transformer_config_from_args

    base = core_transformer_config_from_args(args)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(
        dsa_indexer_rope_fp32=getattr(args, "dsa_indexer_rope_fp32", False),
        dsa_indexer_scoring_precision=getattr(args, "dsa_indexer_scoring_precision", "bf16"),
        dsa_indexer_engine=getattr(args, "dsa_indexer_engine", DEFAULT_ENGINE.name),
        dsa_indexer_topk_source=getattr(args, "dsa_indexer_topk_source", "compute"),
    )
    fields.update(overrides)
    return DSAPrecisionTransformerConfig(**fields)
