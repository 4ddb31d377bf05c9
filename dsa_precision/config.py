"""Precision configuration of the DSA lightning indexer.

One frozen dataclass carries the two opt-in switches. Single-field rules are checked at
construction; the rules that depend on the model (kernel backend, indexer loss, head count and
width, GPU architecture) are checked once, by :meth:`IndexerPrecisionConfig.validate_for_model`,
which the Megatron integration calls before the model is built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FP8_HEAD_DIM",
    "FP8_N_HEADS",
    "IndexerPrecisionConfig",
    "ScoringPrecision",
]

# The SM90 cuDNN FP8 indexer kernel packs 32 or 64 query heads against one key head of width 128.
FP8_N_HEADS = (32, 64)
FP8_HEAD_DIM = 128
FP8_MIN_COMPUTE_CAPABILITY = (9, 0)


class ScoringPrecision(enum.StrEnum):
    """Operand precision of the indexer scoring matmul ``q @ k^T``."""

    # BF16 operands (FP32 carriers are rounded to BF16 first), FP32 accumulation: Megatron's default.
    BF16 = "bf16"
    # E4M3 operands with one power-of-two (UE8M0) FP32 descale per 128-vector, FP32 accumulation:
    # what vLLM / SGLang score with at inference.
    FP8 = "fp8"

    @classmethod
    def parse(
        cls, value: ScoringPrecision | str, *, name: str = "scoring_precision"
    ) -> ScoringPrecision:
        """Accept the enum or its string value; raise ``ValueError`` naming the allowed values."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(p.value) for p in cls)
        raise ValueError(f"{name}={value!r} is not a scoring precision; use one of {allowed}.")


@dataclass(frozen=True)
class IndexerPrecisionConfig:
    """Numerics of the DSA lightning indexer; both switches default to Megatron's behaviour.

    Args:
        rope_fp32: keep key LayerNorm -> RoPE (and query RoPE, and the optional Hadamard
            rotation) in FP32 after the BF16 projections, so q and k reach scoring as FP32
            with no BF16 round trip. Costs FP32 activations for q and k (2x their BF16 bytes);
            buys the inference engines' preprocessing numerics.
        scoring_precision: ``"bf16"`` scores BF16 operands (Megatron's default); ``"fp8"``
            quantizes q and k to E4M3 with a UE8M0 descale per 128-vector and scores in FP8, as
            the inference indexer does. ``"fp8"`` needs the cuDNN kernel backend, no indexer loss,
            32 or 64 indexer heads of width 128 and an SM90+ GPU (see :meth:`validate_for_model`).
    """

    # FP32 preprocessing after the projections (LayerNorm, RoPE, Hadamard); default: BF16 as Megatron.
    rope_fp32: bool = False
    # Scoring operand precision; accepts the enum or its string value, stored as the enum.
    scoring_precision: ScoringPrecision = ScoringPrecision.BF16

    def __post_init__(self) -> None:
        if not isinstance(self.rope_fp32, bool):
            raise TypeError(
                f"rope_fp32 must be a bool, got {self.rope_fp32!r} "
                f"({type(self.rope_fp32).__name__}); pass True or False."
            )
        # Frozen dataclass: normalise the string form through object.__setattr__.
        object.__setattr__(
            self, "scoring_precision", ScoringPrecision.parse(self.scoring_precision)
        )

    @property
    def fp8(self) -> bool:
        """Whether scoring runs in FP8."""
        return self.scoring_precision is ScoringPrecision.FP8

    def short_str(self) -> str:
        """Compact label for logs and benchmark rows, e.g. ``rope_fp32+fp8``."""
        parts = ["rope_fp32"] if self.rope_fp32 else []
        if self.fp8:
            parts.append("fp8")
        return "+".join(parts) or "baseline"

    def validate_for_model(
        self,
        *,
        kernel_backend: str,
        indexer_loss_coeff: float | None,
        n_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
    ) -> None:
        """Check the cross-field rules once, before the model is built.

        Args:
            kernel_backend: Megatron's ``dsa_kernel_backend`` (``"none"``, ``"tilelang"``,
                ``"cudnn"``).
            indexer_loss_coeff: Megatron's ``dsa_indexer_loss_coeff``.
            n_heads: ``dsa_indexer_n_heads``.
            head_dim: ``dsa_indexer_head_dim``.
            device: the device the model runs on; on a CUDA device its compute capability must be
                at least 9.0 for FP8. ``None`` uses the current CUDA device when CUDA is available
                and skips the check otherwise (CPU-only processes, e.g. config tooling).

        Raises:
            ValueError: one message listing every violated rule, each naming the field, its value
                and the fix.
        """
        if not self.fp8:
            return
        problems = []
        if kernel_backend != "cudnn":
            problems.append(
                f"dsa_kernel_backend={kernel_backend!r}: FP8 scoring runs only in the cuDNN "
                "indexer kernel; set dsa_kernel_backend='cudnn'"
            )
        if indexer_loss_coeff not in (None, 0, 0.0):
            problems.append(
                f"dsa_indexer_loss_coeff={indexer_loss_coeff!r}: the indexer KL loss needs BF16 "
                "scores; set it to 0 (or None) or use scoring_precision='bf16'"
            )
        if n_heads not in FP8_N_HEADS:
            problems.append(
                f"dsa_indexer_n_heads={n_heads!r}: the FP8 kernel packs {FP8_N_HEADS[0]} or "
                f"{FP8_N_HEADS[1]} heads; use one of {FP8_N_HEADS} or scoring_precision='bf16'"
            )
        if head_dim != FP8_HEAD_DIM:
            problems.append(
                f"dsa_indexer_head_dim={head_dim!r}: FP8 scoring quantizes 128-wide vectors; "
                f"set it to {FP8_HEAD_DIM} or use scoring_precision='bf16'"
            )
        capability = _device_capability(device)
        if capability is not None and capability < FP8_MIN_COMPUTE_CAPABILITY:
            major, minor = capability
            problems.append(
                f"device compute capability {major}.{minor}: the FP8 indexer kernel needs SM90+ "
                "(Hopper or newer); run on such a GPU or use scoring_precision='bf16'"
            )
        if problems:
            raise ValueError(
                "scoring_precision='fp8' cannot be honoured:\n  - " + "\n  - ".join(problems)
            )

    @classmethod
    def from_megatron_config(cls, config: Any) -> IndexerPrecisionConfig:
        """Build from a config carrying ``dsa_indexer_rope_fp32`` and
        ``dsa_indexer_scoring_precision`` (missing fields take the defaults)."""
        return cls(
            rope_fp32=getattr(config, "dsa_indexer_rope_fp32", False),
            scoring_precision=getattr(config, "dsa_indexer_scoring_precision", "bf16"),
        )


def _device_capability(device: torch.device | str | None) -> tuple[int, int] | None:
    if device is None:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability()
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
