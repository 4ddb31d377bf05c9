"""What the fused preprocess + quantize kernel does to a vector: one frozen object, built once
from the engine profile and the indexer's preprocessing module, passed whole to the kernel.

Importing this module imports no Triton (the decision and the launch are apart).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, TypedDict, get_args

import torch

from ..engines import EngineProfile, Fp8Rule, LayerNormArith, RopeFma

if TYPE_CHECKING:
    from ..preprocess import IndexerPreprocess

__all__ = ["PreprocessRules"]


def _engine_lanes_differ(preprocess: IndexerPreprocess) -> bool:
    """Whether the engines' lane order is not Megatron's: interleaved RoPE pairs and no Hadamard
    rotation (docs/numerics.md, section 7: the engines rotate each adjacent pair in place)."""
    return preprocess.rope_interleaved and not preprocess.rotate_activation


# The bool fields of PreprocessRules, and the dtypes its cos/sin tables may be rounded to.
_FLAGS = ("interleaved", "hadamard", "input_lane_order", "bf16_math", "fma", "ln_out_bf16",
          "hadamard_scale_fp32", "q_out_bf16", "k_out_bf16")  # fmt: skip
_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Common(TypedDict):
    q_quant: Fp8Rule
    k_quant: Fp8Rule
    rope_dim: int
    interleaved: bool
    hadamard: bool
    input_lane_order: bool


@dataclasses.dataclass(frozen=True)
class PreprocessRules:
    """The kernel's arithmetic for one indexer (both launches: queries and keys).

    Attributes:
        q_quant, k_quant: the engine's quantization rule of each tensor.
        rope_dim: width of the RoPE slice; 0 quantizes without RoPE (preprocessed carriers).
        interleaved: Megatron's ``dsa_indexer_rope_interleaved``.
        hadamard: the Hadamard rotation after RoPE.
        input_lane_order: write each value back in the lane its input came from (the engines'
            order of interleaved RoPE pairs) instead of the rotate-half order.
        bf16_math: RoPE in BF16 arithmetic (Megatron's BF16 path); float32 otherwise.
        table_dtype: the dtype the cos/sin tables are rounded to before the kernel reads them.
        fma: the engine's contracted multiply-adds (:attr:`EngineProfile.fma`).
        rope_fma: which RoPE product ``fma`` fuses (:attr:`EngineProfile.rope_fma`).
        layer_norm: the key LayerNorm arithmetic (:attr:`EngineProfile.layernorm`): float64
            once, or float32 operation by operation in Triton's tree or in a CUDA warp's.
        ln_out_bf16: round the key LayerNorm output to BF16.
        hadamard_scale_fp32: the Hadamard sums rounded to float32, scaled by ``fl32(128**-0.5)``.
        q_out_bf16, k_out_bf16: round q / k to BF16 after RoPE and after the Hadamard rotation.
    """

    q_quant: Fp8Rule
    k_quant: Fp8Rule
    rope_dim: int = 0
    interleaved: bool = False
    hadamard: bool = False
    input_lane_order: bool = False
    bf16_math: bool = False
    table_dtype: torch.dtype = torch.float32
    fma: bool = False
    rope_fma: RopeFma = "cos"
    layer_norm: LayerNormArith = "float64"
    ln_out_bf16: bool = False
    hadamard_scale_fp32: bool = False
    q_out_bf16: bool = False
    k_out_bf16: bool = False

    def __post_init__(self) -> None:
        for name in ("q_quant", "k_quant"):
            if not isinstance(getattr(self, name), Fp8Rule):
                raise TypeError(
                    f"PreprocessRules.{name}={getattr(self, name)!r} must be an Fp8Rule (an "
                    "engine profile's q_quant / k_quant)."
                )
        dim = self.rope_dim
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(
                f"PreprocessRules.rope_dim={dim!r} ({type(dim).__name__}) must be an int: the "
                "width of the RoPE slice."
            )
        if dim < 0 or dim % 2:
            raise ValueError(f"rope_dim={dim} must be even and non-negative.")
        object.__setattr__(self, "rope_dim", int(dim))
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"PreprocessRules.{name}={value!r} ({type(value).__name__}) must be a bool; "
                    "pass True or False."
                )
        if self.table_dtype not in _TABLE_DTYPES:
            raise ValueError(
                f"PreprocessRules.table_dtype={self.table_dtype!r} must be one of "
                f"{[str(d) for d in _TABLE_DTYPES]} (the cos/sin tables' dtype)."
            )
        for name, kind in (("rope_fma", RopeFma), ("layer_norm", LayerNormArith)):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"PreprocessRules.{name}={getattr(self, name)!r} is not a rule the kernel "
                    f"knows; use one of {get_args(kind)}."
                )
        if self.input_lane_order and (not self.interleaved or self.hadamard):
            raise ValueError(
                "input_lane_order puts interleaved RoPE pairs back; it needs interleaved=True and "
                "no Hadamard rotation (which mixes the lanes)."
            )

    @property
    def math_dtype(self) -> torch.dtype:
        """The RoPE arithmetic dtype (and the dtype of the tables the kernel reads)."""
        return torch.bfloat16 if self.bf16_math else torch.float32

    @classmethod
    def carriers(cls, engine: EngineProfile) -> PreprocessRules:
        """Quantization only, under ``engine``'s rules (preprocessed FP32/BF16 carriers)."""
        return cls(q_quant=engine.q_quant, k_quant=engine.k_quant)

    @classmethod
    def indexer(
        cls, preprocess: IndexerPreprocess, engine: EngineProfile, projection_dtype: torch.dtype
    ) -> PreprocessRules:
        """The rules of ``preprocess`` from projections of ``projection_dtype``: with
        ``rope_fp32`` the engine's (cos/sin cache dtype, RoPE arithmetic, LayerNorm arithmetic
        and output, q / k rounding, contraction, Hadamard constant); otherwise Megatron's BF16
        path (RoPE in the projection dtype, its outputs rounded to it)."""
        common: _Common = dict(
            q_quant=engine.q_quant,
            k_quant=engine.k_quant,
            rope_dim=preprocess.rope_dim,
            interleaved=preprocess.rope_interleaved,
            hadamard=preprocess.rotate_activation,
            input_lane_order=_engine_lanes_differ(preprocess),
        )
        if preprocess.rope_fp32:
            return cls(
                **common,
                bf16_math=engine.rope_dtype == torch.bfloat16,
                table_dtype=engine.cos_sin_dtype,
                fma=engine.fma,
                rope_fma=engine.rope_fma,
                layer_norm=engine.layernorm,
                ln_out_bf16=engine.k_norm_dtype == torch.bfloat16,
                hadamard_scale_fp32=engine.hadamard_scale == "float32",
                q_out_bf16=engine.q_dtype == torch.bfloat16,
                k_out_bf16=engine.k_dtype == torch.bfloat16,
            )
        bf16 = projection_dtype == torch.bfloat16  # its outputs (the Hadamard's too) stay BF16
        return cls(
            **common,
            bf16_math=bf16,
            table_dtype=projection_dtype,
            q_out_bf16=bf16,
            k_out_bf16=bf16,
        )
