"""Precision configuration of the DSA lightning indexer, and the constants every layer shares.

One frozen dataclass carries the two opt-in switches and the inference engine whose numerics FP8
scoring reproduces. Single-field rules are checked at construction; the rules that depend on the
model (indexer loss, head count and width, GPU architecture) are checked once, by
:meth:`IndexerPrecisionConfig.validate_for_model`, which the Megatron integration calls before the
model is built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .checks import _check_bool, _check_positive_int
from .engines import DEFAULT_ENGINE, EngineProfile, _engine_profile

__all__ = ["IndexerPrecisionConfig", "ScoringPrecision"]

# One FP8 descale per this many contiguous values: the indexer's head dim, and DeepGEMM's
# per-token cast granularity on Hopper.
_QUANT_BLOCK = 128
# The SM90 FP8 indexer kernels (cuDNN's, DeepGEMM's) pack 32 or 64 query heads of width 128
# against one key head.
_FP8_N_HEADS = (32, 64)
_FP8_HEAD_DIM = _QUANT_BLOCK
_FP8_MIN_COMPUTE_CAPABILITY = (9, 0)
# Scoring backends: cuDNN's SM90 indexer kernel, DeepGEMM's MQA logits (the inference
# engines' kernel; FP8 only; "auto"'s first choice where installed), the exact torch reference.
_SCORING_BACKENDS = ("auto", "cudnn", "deepgemm", "torch")
_TOPK_BACKENDS = ("auto", "cudnn", "torch")


def _fp8_indexer_loss_error(field_name: str, value: object) -> str:
    """The one message for "FP8 scoring has no indexer loss" (scores carry no gradient)."""
    return (
        f"{field_name}={value!r}: the indexer KL loss needs differentiable BF16 scores; FP8 scores "
        "have no gradient. Set it to 0 or use scoring_precision='bf16'"
    )


class ScoringPrecision(enum.StrEnum):
    """Operand precision of the indexer scoring matmul ``q @ k^T``."""

    # BF16 operands (FP32 carriers are rounded to BF16 first), FP32 accumulation: Megatron's default.
    BF16 = "bf16"
    # E4M3 operands with one FP32 descale per 128-vector (the engine profile decides its format),
    # FP32 accumulation: what vLLM / SGLang score with at inference.
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
            rotation) in FP32 after the BF16 projections, following the engine profile's rules,
            so q and k reach scoring as the engine builds them. Costs FP32 activations for q and k
            (2x their BF16 bytes); buys the inference engine's preprocessing numerics.
        scoring_precision: ``"bf16"`` scores BF16 operands (Megatron's default); ``"fp8"``
            quantizes q and k to E4M3 with one FP32 descale per 128-vector as the engine does,
            and scores in FP8. ``"fp8"`` needs no indexer loss, 32 or 64 indexer heads of width
            128 and an SM90 GPU for its kernels (see :meth:`validate_for_model`).
        engine: the inference engine profile (a name of :data:`dsa_precision.ENGINE_PROFILES`
            or an :class:`~dsa_precision.EngineProfile`) whose preprocessing (with
            ``rope_fp32``), quantization and head-weight folding (with ``"fp8"``) training
            reproduces. Default ``"vllm"``, vLLM's default compiled run on Hopper (``"vllm-exact"``
            is the literal all-FP32 contract of earlier releases).
        scoring_backend: the kernel whose logits the scoring returns (:data:`_SCORING_BACKENDS`):
            ``"auto"`` (default) the fastest exact one that serves the call (DeepGEMM's MQA
            logits for FP8 where installed, else cuDNN's SM90 kernel, else the torch reference),
            or one pinned: ``"deepgemm"`` (FP8 only; the engines' kernel), ``"cudnn"``,
            ``"torch"``. Their FP8 logits differ in the last bits (docs/numerics.md, section 7),
            so it is part of the precision: prepared operands carry it to every scoring call, and
            the audit (:func:`dsa_precision.scoring_calls`) records the kernel that ran.
    """

    # FP32 preprocessing after the projections (LayerNorm, RoPE, Hadamard); default: BF16 as Megatron.
    rope_fp32: bool = False
    # Scoring operand precision; accepts the enum or its string value, stored as the enum.
    scoring_precision: ScoringPrecision = ScoringPrecision.BF16
    # Engine profile; accepts a registered name or a profile, stored as the profile.
    engine: EngineProfile = field(default=DEFAULT_ENGINE)
    # The scoring kernel (SCORING_BACKENDS); "auto" decides per call.
    scoring_backend: str = "auto"

    if TYPE_CHECKING:  # the constructor takes the string forms too (normalised below)

        def __init__(
            self,
            rope_fp32: bool = False,
            scoring_precision: ScoringPrecision | str = ScoringPrecision.BF16,
            engine: EngineProfile | str = DEFAULT_ENGINE,
            scoring_backend: str = "auto",
        ) -> None: ...

    def __post_init__(self) -> None:
        _check_bool("rope_fp32", self.rope_fp32)
        # Frozen dataclass: normalise the string forms through object.__setattr__.
        object.__setattr__(
            self, "scoring_precision", ScoringPrecision.parse(self.scoring_precision)
        )
        object.__setattr__(self, "engine", _engine_profile(self.engine))
        _check_scoring_backend(self.scoring_backend, self.scoring_precision)

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
        indexer_loss_coeff: float | None,
        n_heads: int,
        head_dim: int,
        rotate_activation: bool = False,
        rope_interleaved: bool = False,
        device: torch.device | str | None = None,
        k_norm_eps: float | None = None,
        k_norm_eps_field: str | None = None,
        params_dtype: torch.dtype | None = None,
        rope_type: str | None = None,
    ) -> None:
        """Check the cross-field rules once, before the model is built.

        Args:
            indexer_loss_coeff: Megatron's ``dsa_indexer_loss_coeff``.
            n_heads: ``dsa_indexer_n_heads``.
            head_dim: ``dsa_indexer_head_dim``.
            rotate_activation: ``dsa_indexer_rotate_activation`` (the model's Hadamard rotation);
                the engine profile must agree with it when its rules are in use.
            rope_interleaved: ``dsa_indexer_rope_interleaved``; an engine profile of a path that
                only serves one RoPE layout must agree with it.
            k_norm_eps: the epsilon of the indexer key LayerNorm (Megatron's
                ``dsa_indexer_k_norm_epsilon``, or ``layernorm_epsilon`` when that is unset);
                with ``rope_fp32`` it must be the engine's own (:attr:`EngineProfile.k_norm_eps`).
                ``None`` skips that check.
            k_norm_eps_field: the Megatron field ``k_norm_eps`` came from (named in the message).
            params_dtype: the dtype of the indexer's projection weights and key LayerNorm
                parameters (Megatron's ``params_dtype``); with either switch it must be the
                engine's (:attr:`EngineProfile.projection_dtype`). ``None`` skips that check.
            rope_type: the model's RoPE type (Megatron's ``rope_type``); with ``rope_fp32`` it
                must be the one the engine profile's cache describes
                (:attr:`EngineProfile.rope_type`). ``None`` skips that check.
            device: the device the model runs on; on a CUDA device its compute capability must be
                9.0 for FP8. ``None`` uses the current CUDA device when CUDA is available and
                skips the check otherwise (CPU-only processes, e.g. config tooling).

        Raises:
            ValueError: one message listing every violated rule, each naming the field, its value
                and the fix (:meth:`model_problems` returns them as a list).
        """
        problems = self.model_problems(
            indexer_loss_coeff=indexer_loss_coeff,
            n_heads=n_heads,
            head_dim=head_dim,
            rotate_activation=rotate_activation,
            rope_interleaved=rope_interleaved,
            device=device,
            k_norm_eps=k_norm_eps,
            k_norm_eps_field=k_norm_eps_field,
            params_dtype=params_dtype,
            rope_type=rope_type,
        )
        if problems:
            raise ValueError(
                f"IndexerPrecisionConfig({self.short_str()}, engine={self.engine.name!r}) cannot "
                "be honoured:\n  - " + "\n  - ".join(problems)
            )

    def model_problems(
        self,
        *,
        indexer_loss_coeff: float | None,
        n_heads: int,
        head_dim: int,
        rotate_activation: bool = False,
        rope_interleaved: bool = False,
        device: torch.device | str | None = None,
        k_norm_eps: float | None = None,
        k_norm_eps_field: str | None = None,
        params_dtype: torch.dtype | None = None,
        rope_type: str | None = None,
    ) -> list[str]:
        """The rules :meth:`validate_for_model` checks (same arguments), as data: one line per
        violated rule, naming the field, its value and the fix; empty when the model can run."""
        problems = []
        for name, value in (("dsa_indexer_n_heads", n_heads), ("dsa_indexer_head_dim", head_dim)):
            try:
                _check_positive_int(name, value)
            except ValueError as exc:
                problems.append(f"{str(exc).removesuffix('.')}: zero heads or width score nothing")
        if self.rope_fp32 or self.fp8:
            problems += self.engine.model_mismatch(
                rotate_activation=rotate_activation,
                rope_interleaved=rope_interleaved,
                k_norm_eps=k_norm_eps if self.rope_fp32 else None,
                k_norm_eps_field=k_norm_eps_field,
                params_dtype=params_dtype,
                rope_type=rope_type if self.rope_fp32 else None,
            )
        if self.fp8:
            if indexer_loss_coeff not in (None, 0, 0.0):
                problems.append(
                    _fp8_indexer_loss_error("dsa_indexer_loss_coeff", indexer_loss_coeff)
                )
            if n_heads not in _FP8_N_HEADS:
                problems.append(
                    f"dsa_indexer_n_heads={n_heads!r}: the FP8 kernels pack {_FP8_N_HEADS[0]} or "
                    f"{_FP8_N_HEADS[1]} heads; use one of {_FP8_N_HEADS} or scoring_precision='bf16'"
                )
            if head_dim != _FP8_HEAD_DIM:
                problems.append(
                    f"dsa_indexer_head_dim={head_dim!r}: FP8 scoring quantizes {_QUANT_BLOCK}-wide "
                    f"vectors; set it to {_FP8_HEAD_DIM} or use scoring_precision='bf16'"
                )
            capability = _device_capability(device)
            if capability is not None and capability[0] != _FP8_MIN_COMPUTE_CAPABILITY[0]:
                major, minor = capability
                problems.append(
                    f"device compute capability {major}.{minor}: the per-128-vector FP8 indexer "
                    "kernels are SM90 (Hopper) only; run on such a GPU or use "
                    "scoring_precision='bf16'"
                )
        return problems

    @classmethod
    def from_megatron_config(cls, config: Any) -> IndexerPrecisionConfig:
        """Build from a config carrying ``dsa_indexer_rope_fp32``,
        ``dsa_indexer_scoring_precision``, ``dsa_indexer_engine`` and
        ``dsa_indexer_scoring_backend`` (missing fields take the defaults)."""
        return cls(
            rope_fp32=getattr(config, "dsa_indexer_rope_fp32", False),
            scoring_precision=getattr(config, "dsa_indexer_scoring_precision", "bf16"),
            engine=getattr(config, "dsa_indexer_engine", DEFAULT_ENGINE.name),
            scoring_backend=getattr(config, "dsa_indexer_scoring_backend", "auto"),
        )


def _check_scoring_backend(backend: object, precision: ScoringPrecision) -> str:
    """``backend`` if it is one of :data:`_SCORING_BACKENDS` that can score ``precision``
    (``"deepgemm"`` scores FP8 only); ``ValueError`` naming the value and the fix otherwise."""
    if not isinstance(backend, str) or backend not in _SCORING_BACKENDS:
        raise ValueError(
            f"scoring_backend={backend!r} is not a scoring backend; use one of {_SCORING_BACKENDS}."
        )
    if backend == "deepgemm" and precision is not ScoringPrecision.FP8:
        raise ValueError(
            "scoring_backend='deepgemm': DeepGEMM's MQA logits score FP8 operands only; set "
            "scoring_precision='fp8' or another backend."
        )
    return backend


def _check_precision_config(value: object, name: str = "config") -> IndexerPrecisionConfig:
    """``value`` if it is an :class:`IndexerPrecisionConfig`: the one precision object every
    entry point that quantizes takes (strings and loose fields raise ``TypeError``)."""
    if not isinstance(value, IndexerPrecisionConfig):
        hint = (
            f"scoring_precision={value!r}" if isinstance(value, str | ScoringPrecision) else "..."
        )
        raise TypeError(
            f"{name} must be an IndexerPrecisionConfig, got {value!r} ({type(value).__name__}); "
            f"pass {name}=IndexerPrecisionConfig({hint}, engine=...)."
        )
    return value


def _device_capability(device: torch.device | str | None) -> tuple[int, int] | None:
    if device is None:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability()
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
