"""Megatron configuration: two ``TransformerConfig`` fields and their command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig

from .. import _cudnn
from ..config import IndexerPrecisionConfig
from ..sparse_attention import _flash_mla_sparse_fwd

__all__ = ["DSAPrecisionTransformerConfig", "add_dsa_precision_args", "config_from_args"]

_LOGGER = logging.getLogger(__name__)


@dataclass
class DSAPrecisionTransformerConfig(MLATransformerConfig):
    """``MLATransformerConfig`` with the two dsa-precision switches.

    ``dsa_kernel_backend="cudnn"`` is validated here rather than by the parent: cuDNN's DSA
    kernels and a CUDA device are required, FlashMLA is optional (without it the sparse attention
    forward is the package's built-in implementation, see ``docs/megatron.md``).
    """

    ####################
    # dsa-precision
    ####################
    dsa_indexer_rope_fp32: bool = False
    """Keep the DSA indexer's key LayerNorm -> RoPE (and query RoPE, Hadamard) in FP32 after the
    projections, so q and k reach scoring with no BF16 round trip (the inference engines'
    preprocessing). Default False: Megatron's BF16 path, bit for bit."""

    dsa_indexer_scoring_precision: Literal["bf16", "fp8"] = "bf16"
    """Operand precision of the DSA indexer scoring matmul. "fp8": E4M3 operands with one UE8M0
    descale per 128-vector and FP32 head weights, as vLLM / SGLang score; needs
    dsa_kernel_backend="cudnn", dsa_indexer_loss_coeff 0, dsa_indexer_scoring_relu, a fused
    attention backend, 32 or 64 indexer heads of dim 128 and an SM90 GPU. Default "bf16"."""

    def __post_init__(self) -> None:
        backend = self.dsa_kernel_backend
        # The parent refuses "cudnn" without FlashMLA; this package runs the cuDNN backend without
        # it (built-in sparse attention forward), so it checks that backend's dependencies itself.
        defer = backend == "cudnn"
        if defer:
            self.dsa_kernel_backend = "none"
        try:
            super().__post_init__()
        finally:
            self.dsa_kernel_backend = backend
        if defer and self.experimental_attention_variant == "dsa":
            _validate_cudnn_backend()
        _validate_precision(self)

    @property
    def dsa_indexer_precision(self) -> IndexerPrecisionConfig:
        """The two switches as the core's frozen :class:`IndexerPrecisionConfig`."""
        return IndexerPrecisionConfig(
            rope_fp32=self.dsa_indexer_rope_fp32,
            scoring_precision=self.dsa_indexer_scoring_precision,
        )


def _validate_cudnn_backend() -> None:
    if not torch.cuda.is_available():
        raise ValueError(
            "dsa_kernel_backend='cudnn' requires a CUDA device, but none is available; set "
            "dsa_kernel_backend='none' to use the PyTorch path."
        )
    if not _cudnn.dsa_available():
        _, reason = _cudnn._import_dsa()
        raise ValueError(f"dsa_kernel_backend='cudnn': {reason}.")
    if _flash_mla_sparse_fwd() is None:
        _LOGGER.info(
            "FlashMLA is not installed: DSA sparse attention uses dsa_precision's built-in "
            "forward (cuDNN SM90 backward when available)."
        )


def _validate_precision(config: DSAPrecisionTransformerConfig) -> IndexerPrecisionConfig:
    """One ``ValueError`` naming every field that keeps the requested precision from running."""
    try:
        precision = IndexerPrecisionConfig(
            rope_fp32=config.dsa_indexer_rope_fp32,
            scoring_precision=config.dsa_indexer_scoring_precision,
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"dsa_indexer_{exc}") from None
    if not precision.fp8:
        return precision
    problems = []
    if config.experimental_attention_variant != "dsa":
        problems.append(
            f"experimental_attention_variant={config.experimental_attention_variant!r}: the "
            "FP8 indexer belongs to DSA; set experimental_attention_variant='dsa'"
        )
    if not config.dsa_indexer_scoring_relu:
        problems.append(
            "dsa_indexer_scoring_relu=False: cuDNN's FP8 indexer kernel applies ReLU per head; "
            "set dsa_indexer_scoring_relu=True"
        )
    if config.attention_backend in (AttnBackend.unfused, "unfused"):
        problems.append(
            f"attention_backend={config.attention_backend}: Megatron then scores with its naive "
            "PyTorch indexer; use a fused attention backend (e.g. AttnBackend.auto)"
        )
    try:
        precision.validate_for_model(
            kernel_backend=config.dsa_kernel_backend,
            indexer_loss_coeff=config.dsa_indexer_loss_coeff,
            n_heads=config.dsa_indexer_n_heads,
            head_dim=config.dsa_indexer_head_dim,
        )
    except ValueError as exc:
        problems.extend(
            line.removeprefix("  - ") for line in str(exc).splitlines()[1:] if line.strip()
        )
    if problems:
        raise ValueError(
            "dsa_indexer_scoring_precision='fp8' cannot be honoured:\n  - "
            + "\n  - ".join(problems)
        )
    return precision


def add_dsa_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron's ``parse_args``: the two dsa-precision flags."""
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
    return parser


def config_from_args(args: argparse.Namespace, **overrides: Any) -> DSAPrecisionTransformerConfig:
    """The ``TransformerConfig`` Megatron's training entry builds from ``args``, as a
    :class:`DSAPrecisionTransformerConfig` carrying the two flags.

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
    )
    fields.update(overrides)
    return DSAPrecisionTransformerConfig(**fields)
