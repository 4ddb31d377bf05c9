"""Inference-engine profiles: every rule of an engine's FP8 indexer path that changes bits.

An :class:`EngineProfile` is a set of facts about one engine configuration: the dtype of its
cos/sin cache, where it rounds to BF16, whether it rotates q and k with a Hadamard transform, how
it forms the FP8 scales of q and of k, and in which dtype and order it scales the head weights.
Training reproduces a profile's operands with ``rope_fp32=True`` and ``scoring_precision="fp8"``.
Each rule's source (repository, release or commit, file and line) is in ``docs/numerics.md``;
this module imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Literal, TypedDict, get_args

import torch

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINE_PROFILES",
    "EngineProfile",
    "FoldStep",
    "Fp8Rule",
    "HadamardScale",
    "InvFreqDevice",
    "LayerNormArith",
    "RopeFma",
    "RopeType",
    "ScaleApply",
    "ScaleFormat",
    "ScaleRatio",
    "Ue8m0Ceil",
    "WeightsDtype",
    "YarnMscale",
    "vllm_legacy_profile",
]

# One descale per 128-vector: a power of two (UE8M0) or the float32 ratio itself.
ScaleFormat = Literal["ue8m0", "fp32"]
# How r = max(amax, floor) / 448 is formed: "exact" (UE8M0 only: the smallest power of two s
# with amax <= 448 s, decided without rounding), "divide" (float32 a / 448, IEEE) or
# "reciprocal" (float32 a * fp32(1 / 448)).
ScaleRatio = Literal["exact", "divide", "reciprocal"]
# How the UE8M0 power of two is taken from the float32 r: "bits" (the exact ceiling: the exponent
# plus one when any mantissa bit is set) or "log2" (exp2(ceil(log2(r))) with a correctly rounded
# float32 log2: an r a few ulps above 2**n gives 2**n, and the largest element saturates at 448).
Ue8m0Ceil = Literal["bits", "log2"]
# How a value is scaled: divided by its descale (IEEE) or multiplied by the float32 reciprocal.
ScaleApply = Literal["divide", "reciprocal"]
# Head weights: the linear_weights_proj output rounded to BF16 (a BF16 GEMM) or kept in FP32.
WeightsDtype = Literal["bf16", "fp32"]
# How the key LayerNorm (rope_fp32) is evaluated: "float64" (statistics and affine map in float64
# from the exact inputs, one rounding to float32) or "fp32-ops" (float32, operation by operation,
# as the engines' Triton kernels run it: the sums in the reduction tree of Triton's tl.sum over
# one 128-vector on 4 warps, mean = sum / 128, var = sum(d * d) / 128, rstd = rsqrt(var + eps),
# ((x - mean) * rstd) * w + b; docs/numerics.md, "The engines' float32 arithmetic") or
# "fp32-warp" (float32, operation by operation, as SGLang's CUDA kernel runs it: one warp per
# 128-vector, each lane summing its four consecutive elements in order, then a butterfly over the
# 32 lanes; under fma the variance's lane sum is a chain of fused multiply-adds and var / 128 + eps
# one fused multiply-add; docs/numerics.md, section 8.5) or "fp32-warp-up" (the same with the
# butterfly's steps the other way round, lanes 1, 2, 4, 8, 16 apart: FlashInfer 0.7.2's CuTe DSL
# LayerNorm, section 8.6) or "fp32-welford" (Inductor's looped Welford reduction of vLLM
# 0.26-0.28's compiled key LayerNorm) or "fp32-inductor-x1" / "fp32-inductor-x8" (Inductor's
# persistent reduction of it, "fp32-ops" with the sums in the order of its XBLOCK 1 or its
# XBLOCK 8 / 32 configuration; section 8.4).
LayerNormArith = Literal[
    "float64",
    "fp32-ops",
    "fp32-warp",
    "fp32-warp-up",
    "fp32-welford",
    "fp32-inductor-x1",
    "fp32-inductor-x8",
]
# Which product of the float32 RoPE the engine's contraction fuses (fma=True), per half of the
# rotate-half slice, out = x * cos + rot(x) * sin: "cos" (every lane fma(x, cos, fl(rot(x) * sin)):
# Triton's contraction in vLLM's and LMDeploy's kernels) or "cos-sin" (the first half as "cos",
# the second half fma(rot(x), sin, fl(x * cos)): nvcc's contraction of SGLang's complex product,
# real = fma(a, c, -fl(b s)), imag = fma(a, s, fl(b c)) for the pair (a, b)).
RopeFma = Literal["cos", "cos-sin"]
# The constant of the Hadamard rotation: float64 n**-0.5 on the float64 butterfly, or
# fl32(n**-0.5) multiplied in float32 (fast_hadamard_transform's float32 kernel).
HadamardScale = Literal["float64", "float32"]
# One float32 multiplication of the running head weight: by the q descale ("qs"), by
# fp32(D**-0.5) ("Ds"), by fp32(H**-0.5) ("Hs") or by fp32(D**-0.5 * H**-0.5) ("DsHs").
FoldStep = Literal["qs", "Ds", "Hs", "DsHs"]
# Where the engine computes the inverse frequencies of its RoPE tables: on the model's device
# (vLLM and SGLang build the whole cos/sin cache there at load, under ``with torch.device``) or
# on the CPU (LMDeploy builds inv_freq at construction with no device, then moves it); the angles
# and cos/sin are computed on the device either way.
InvFreqDevice = Literal["device", "cpu"]
# The YaRN magnitude scale the engine folds into cos/sin: "ratio" (vLLM, SGLang, Megatron:
# yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)) or "ratio-if-both"
# (LMDeploy: that ratio only when mscale and mscale_all_dim are both non-zero, otherwise
# yarn_get_mscale(factor)).
YarnMscale = Literal["ratio", "ratio-if-both"]
# A model's RoPE type (Megatron's rope_type): plain, or DeepSeek's YaRN.
RopeType = Literal["rope", "yarn"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
    """How an engine quantizes one tensor (q or k) to E4M3, one descale per 128-vector."""

    scale_format: ScaleFormat = "ue8m0"
    amax_floor: float = 1e-4
    scale_ratio: ScaleRatio = "exact"
    ue8m0_ceil: Ue8m0Ceil = "bits"
    scale_apply: ScaleApply = "divide"

    def __post_init__(self) -> None:
        for name, kind in (
            ("scale_format", ScaleFormat),
            ("scale_ratio", ScaleRatio),
            ("ue8m0_ceil", Ue8m0Ceil),
            ("scale_apply", ScaleApply),
        ):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {get_args(kind)}.")
        if self.scale_format == "fp32" and self.scale_ratio == "exact":
            raise ValueError("scale_format='fp32' is the float32 ratio itself; set scale_ratio.")
        floor = self.amax_floor  # check_real's rule (this module imports nothing of the package)
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real):
            raise TypeError(
                f"amax_floor={floor!r} ({type(floor).__name__}) must be a real number; pass a "
                "Python float."
            )
        object.__setattr__(self, "amax_floor", float(floor))  # a NumPy scalar, as a float
        if not (0.0 < self.amax_floor < float("inf")):
            raise ValueError(f"amax_floor={floor!r} must be a positive finite number.")

    @property
    def kwargs(self) -> dict[str, object]:
        """The keyword arguments of :func:`dsa_precision.quantize.quantize_fp8`."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """The bit-changing rules of one inference engine's FP8 indexer path.

    Preprocessing rules apply with ``rope_fp32=True`` (the model's own BF16 path is Megatron's
    otherwise); quantization and head-weight rules apply with ``scoring_precision="fp8"``.
    ``hadamard`` and ``rope_interleaved`` state what the engine's path needs of the model: a
    training model that differs cannot reproduce it (a configuration error).
    """

    name: str
    # One line: engine, version, run mode and which models take this path.
    summary: str
    # dtype of the cos/sin cache RoPE reads (its values are computed in float32 either way).
    cos_sin_dtype: torch.dtype = torch.float32
    # Output dtype of the key LayerNorm (its statistics are float32 or better).
    k_norm_dtype: torch.dtype = torch.float32
    # Arithmetic dtype of RoPE: float32, or BF16 (each product and the sum rounded to BF16).
    rope_dtype: torch.dtype = torch.float32
    # dtype q and k are rounded to after RoPE (and again after the Hadamard rotation).
    q_dtype: torch.dtype = torch.float32
    k_dtype: torch.dtype = torch.float32
    # Whether the engine rotates q and k with the Hadamard transform; None: whenever the model does.
    hadamard: bool | None = None
    # The RoPE layout the engine's path needs (SGLang picks its path by it); None: any.
    rope_interleaved: bool | None = None
    q_quant: Fp8Rule = Fp8Rule()
    k_quant: Fp8Rule = Fp8Rule()
    weights_dtype: WeightsDtype = "bf16"
    # The multiplications that turn the projection output into the scoring weight, in order.
    weights_fold: tuple[FoldStep, ...] = ("Ds", "Hs", "qs")
    # Key LayerNorm arithmetic (rope_fp32).
    layernorm: LayerNormArith = "float64"
    # Whether the engine's compiler contracts its float32 multiply-adds into fused multiply-adds
    # (Triton's default enable_fp_fusion=True): the float32 RoPE x * cos + rot(x) * sin becomes
    # fma(x, cos, fl(rot(x) * sin)); with layernorm="fp32-ops" the affine map becomes
    # fma(fl((x - mean) * rstd), w, b) and the first step of the variance sum fma(d, d, fl(d' d')).
    fma: bool = False
    # Which RoPE product the contraction fuses (fma=True, float32 RoPE): see RopeFma.
    rope_fma: RopeFma = "cos"
    # The key LayerNorm epsilon the engine uses (vLLM and LMDeploy hard-code 1e-6, whatever the
    # checkpoint says); None: the model's. A model whose k_norm has another epsilon cannot
    # reproduce the profile (rope_fp32: a configuration error).
    k_norm_eps: float | None = None
    hadamard_scale: HadamardScale = "float64"
    # RoPE tables (rope_fp32): the engine's recipe, rebuilt from the token positions (the
    # formula, float32 throughout, is the model's: plain RoPE or DeepSeek's YaRN): where inv_freq
    # is computed, and the YaRN magnitude scale.
    inv_freq_device: InvFreqDevice = "device"
    yarn_mscale: YarnMscale = "ratio"
    # The RoPE type of the models this profile's cache describes (vLLM's eager run keeps a
    # float32 cache for YaRN models only: DeepseekScalingRotaryEmbedding's flashinfer path); None:
    # any. A model of the other type cannot reproduce the profile (rope_fp32).
    rope_type: RopeType | None = None
    # dtype of the indexer's projection weights (and the key LayerNorm parameters) the engine
    # serves: BF16 checkpoints, BF16 GEMMs; None: any (a model whose parameters are another dtype
    # cannot reproduce the profile's operands).
    projection_dtype: torch.dtype | None = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("name", "summary"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"EngineProfile.{name} must be a str, got {getattr(self, name)!r}.")
        if self.rope_type is not None and self.rope_type not in get_args(RopeType):
            raise ValueError(
                f"EngineProfile {self.name!r}: rope_type={self.rope_type!r} is not one of "
                f"{get_args(RopeType)} or None."
            )
        for name in ("hadamard", "rope_interleaved"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(
                    f"EngineProfile {self.name!r}: {name}={value!r} ({type(value).__name__}) must "
                    "be True, False or None (a string such as 'false' would read as true)."
                )
        for name in ("q_quant", "k_quant"):
            rule = getattr(self, name)
            if isinstance(rule, Mapping):  # a profile read from JSON
                try:
                    rule = Fp8Rule(**rule)
                except TypeError as exc:
                    raise TypeError(f"EngineProfile {self.name!r}: {name}: {exc}.") from None
                object.__setattr__(self, name, rule)
            elif not isinstance(rule, Fp8Rule):
                raise TypeError(
                    f"EngineProfile {self.name!r}: {name} must be an Fp8Rule (or a mapping of its "
                    f"fields), got {type(rule).__name__}."
                )
        if isinstance(self.weights_fold, list):  # a profile read from JSON
            object.__setattr__(self, "weights_fold", tuple(self.weights_fold))
        if not isinstance(self.weights_fold, tuple) or not all(
            isinstance(step, str) for step in self.weights_fold
        ):
            raise TypeError(
                f"EngineProfile {self.name!r}: weights_fold={self.weights_fold!r} must be a tuple "
                f"of the steps {get_args(FoldStep)}."
            )
        for name in ("cos_sin_dtype", "k_norm_dtype", "rope_dtype", "q_dtype", "k_dtype"):
            if getattr(self, name) not in _FLOAT_DTYPES:
                raise ValueError(
                    f"EngineProfile {self.name!r}: {name}={getattr(self, name)} must be "
                    "torch.float32 or torch.bfloat16."
                )
        if self.projection_dtype is not None and self.projection_dtype not in (
            *_FLOAT_DTYPES,
            torch.float16,
        ):
            raise ValueError(
                f"EngineProfile {self.name!r}: projection_dtype={self.projection_dtype} must be "
                "torch.bfloat16, torch.float16, torch.float32 or None."
            )
        for name, kind in (
            ("layernorm", LayerNormArith),
            ("rope_fma", RopeFma),
            ("hadamard_scale", HadamardScale),
            ("inv_freq_device", InvFreqDevice),
            ("yarn_mscale", YarnMscale),
        ):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"EngineProfile {self.name!r}: {name}={getattr(self, name)!r} is not one of "
                    f"{get_args(kind)}."
                )
        if not isinstance(self.fma, bool):  # checks.check_bool's message (no package imports)
            raise TypeError(
                f"EngineProfile {self.name!r}: fma must be a bool, got {self.fma!r} "
                f"({type(self.fma).__name__}); pass True or False."
            )
        if self.k_norm_eps is not None:
            eps = self.k_norm_eps
            if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
                raise TypeError(
                    f"EngineProfile {self.name!r}: k_norm_eps={eps!r} ({type(eps).__name__}) must "
                    "be a real number or None."
                )
            object.__setattr__(self, "k_norm_eps", float(eps))
            if not 0.0 < self.k_norm_eps < float("inf"):
                raise ValueError(
                    f"EngineProfile {self.name!r}: k_norm_eps={eps!r} must be a positive finite "
                    "number or None."
                )
        if self.weights_dtype not in get_args(WeightsDtype):
            raise ValueError(
                f"EngineProfile {self.name!r}: weights_dtype={self.weights_dtype!r} is not one of "
                f"{get_args(WeightsDtype)}."
            )
        steps = list(self.weights_fold)
        constants = sorted(s for s in steps if s != "qs")
        if (
            steps.count("qs") != 1
            or constants not in (["Ds", "Hs"], ["DsHs"])
            or not all(s in get_args(FoldStep) for s in steps)
        ):
            raise ValueError(
                f"EngineProfile {self.name!r}: weights_fold={self.weights_fold!r} must multiply "
                "by 'qs' once and by 'Ds' and 'Hs' (or their product 'DsHs') once each."
            )

    def model_mismatch(
        self,
        *,
        rotate_activation: bool,
        rope_interleaved: bool,
        k_norm_eps: float | None = None,
        k_norm_eps_field: str | None = None,
        params_dtype: torch.dtype | None = None,
        rope_type: str | None = None,
    ) -> list[str]:
        """What keeps a model with these fields from reproducing this profile (empty: nothing).

        ``k_norm_eps``: the epsilon of the model's key LayerNorm, ``k_norm_eps_field`` the
        Megatron field it came from (``dsa_indexer_k_norm_epsilon``, or ``layernorm_epsilon``
        when that is unset); ``params_dtype``: the dtype of the indexer's projection weights and
        key LayerNorm parameters (Megatron's ``params_dtype``); ``rope_type``: the model's RoPE
        type (``"rope"`` or ``"yarn"``). ``None`` skips a check.
        """
        problems = []
        if k_norm_eps is not None and (
            msg := self.k_norm_eps_mismatch(k_norm_eps, field=k_norm_eps_field)
        ):
            problems.append(msg)
        if (
            params_dtype is not None
            and self.projection_dtype is not None
            and params_dtype != self.projection_dtype
        ):
            problems.append(
                f"params_dtype={params_dtype}: dsa_indexer_engine={self.name!r} serves "
                f"{self.projection_dtype} checkpoints (its indexer projections are "
                f"{self.projection_dtype} GEMMs, the key LayerNorm parameters the checkpoint's), "
                f"so the operands start from other values; set params_dtype={self.projection_dtype}"
            )
        if rope_type is not None and self.rope_type is not None and rope_type != self.rope_type:
            problems.append(
                f"dsa_indexer_engine={self.name!r} is the engine's path for rope_type="
                f"{self.rope_type!r} models (its cos/sin cache is that path's), but the model has "
                f"rope_type={rope_type!r}; pick the profile of the engine path that serves this "
                "model"
            )
        if self.hadamard is not None and self.hadamard != rotate_activation:
            does = "applies" if self.hadamard else "does not apply"
            problems.append(
                f"dsa_indexer_engine={self.name!r} {does} the Hadamard rotation to q and k, but "
                f"the model has dsa_indexer_rotate_activation={rotate_activation}; pick the "
                "profile of the engine path that serves this model"
            )
        if self.rope_interleaved is not None and self.rope_interleaved != rope_interleaved:
            layout = "interleaved" if self.rope_interleaved else "rotate-half (NeoX)"
            problems.append(
                f"dsa_indexer_engine={self.name!r} is the engine's path for {layout} indexer RoPE, "
                f"but the model has dsa_indexer_rope_interleaved={rope_interleaved}; pick the "
                "profile of the engine path that serves this model"
            )
        return problems

    def k_norm_eps_mismatch(self, k_norm_eps: float, *, field: str | None = None) -> str | None:
        """Why a key LayerNorm with epsilon ``k_norm_eps`` cannot reproduce this profile (the
        engine's own epsilon differs), or ``None``. ``field``: the Megatron config field the
        epsilon came from (the message then says which field to set); ``None``: a module's."""
        if self.k_norm_eps is None or float(k_norm_eps) == float(self.k_norm_eps):
            return None
        if field is None:
            where, fix = "", f"build the key LayerNorm with eps={self.k_norm_eps!r}"
        else:  # Megatron: dsa_indexer_k_norm_epsilon overrides layernorm_epsilon for the k_norm
            where = f" (from {field})"
            fix = f"set dsa_indexer_k_norm_epsilon={self.k_norm_eps!r} (the indexer's k_norm only)"
        return (
            f"dsa_indexer_engine={self.name!r} normalises the indexer keys with epsilon "
            f"{self.k_norm_eps!r} (the engine hard-codes it), but the model's k_norm has eps="
            f"{k_norm_eps!r}{where}; {fix} or pick the profile of the engine that serves this "
            "model"
        )


def _registry(*profiles: EngineProfile) -> dict[str, EngineProfile]:
    return {p.name: p for p in profiles}


_BF16 = torch.bfloat16
# vLLM >= 0.29 (read: 0.33.0) on SM90, both q and k: div_rn(max(amax, 1e-4), 448),
# exp2(ceil(log2(.))), div_rn(x, scale).
_VLLM_RULE = Fp8Rule(amax_floor=1e-4, scale_ratio="divide", ue8m0_ceil="log2")
# SGLang 0.5.23: plain float32 scales, multiplied by the IEEE reciprocal.
_SGLANG_FP32_RULE = Fp8Rule(
    scale_format="fp32", amax_floor=1e-4, scale_ratio="divide", scale_apply="reciprocal"
)

# LMDeploy: x * fp32(1 / 448) rounded up to a power of two by its bits, values multiplied by the
# reciprocal; tl.max promotes the BF16 amax to float32 first, so the floor is fl32(1e-6) against a
# float32 amax (PTX: max.f32 with 0f358637BD).
_LMDEPLOY_RULE = Fp8Rule(amax_floor=1e-6, scale_ratio="reciprocal", scale_apply="reciprocal")
# vLLM 0.33, LMDeploy 0.18 and SGLang 0.5.23 build the indexer key LayerNorm with eps=1e-6
# whatever the model (SGLang: its LayerNorm's default, the indexer passes none;
# srt/layers/layernorm.py:1019-1030, srt/layers/attention/dsa/dsa_indexer.py:378-385).
_ENGINE_K_NORM_EPS = 1e-6


class _TritonRules(TypedDict):
    layernorm: LayerNormArith
    fma: bool
    k_norm_eps: float


# vLLM 0.33's Triton kernels as Triton compiles them for Hopper (enable_fp_fusion left on).
_VLLM_TRITON: _TritonRules = dict(layernorm="fp32-ops", fma=True, k_norm_eps=_ENGINE_K_NORM_EPS)

ENGINE_PROFILES: dict[str, EngineProfile] = _registry(
    EngineProfile(
        name="vllm-exact",
        summary=(
            "the package's original all-FP32 contract (no engine's path): vLLM's DeepSeek-V3.2 / "
            "GLM-5 indexer rules with an FP32 cos/sin cache, float64 LayerNorm, no contraction, "
            "its UE8M0 scales decided exactly"
        ),
        projection_dtype=None,
    ),
    EngineProfile(
        name="vllm",
        summary=(
            "vLLM 0.29+ on Hopper (run: 0.33.0's and 0.34.0's Triton kernels and top-k "
            "kernels), the default compiled run, "
            "FP32 indexer logits: BF16 cos/sin cache (GLM-5 in every run mode); float32 "
            "LayerNorm operation by operation (eps 1e-6), contracted RoPE; UE8M0 by float32 log2"
        ),
        cos_sin_dtype=_BF16,
        hadamard=False,
        q_quant=_VLLM_RULE,
        k_quant=_VLLM_RULE,
        weights_fold=("qs", "Ds", "Hs"),
        **_VLLM_TRITON,
    ),
    EngineProfile(
        name="vllm-eager",
        summary=(
            "vLLM 0.29+ on Hopper with --enforce-eager (run: 0.33.0's and 0.34.0's kernels): "
            "FP32 cos/sin cache for DeepSeek-V3.2 (yarn RoPE with "
            "flashinfer); otherwise as 'vllm' (a plain-RoPE model's eager run, GLM-5's, is 'vllm')"
        ),
        rope_type="yarn",
        hadamard=False,
        q_quant=_VLLM_RULE,
        k_quant=_VLLM_RULE,
        weights_fold=("qs", "Ds", "Hs"),
        **_VLLM_TRITON,
    ),
    EngineProfile(
        name="vllm-legacy",
        summary=(
            "vLLM 0.26-0.28 (run: 0.28.0's kernels; generic deepseek_v2 Indexer, fused Triton "
            "q): BF16 cos/sin, "
            "Inductor's Welford LayerNorm (eps 1e-6) and RoPE outputs rounded to BF16, q amax "
            "floor 1e-10"
        ),
        cos_sin_dtype=_BF16,
        k_norm_dtype=_BF16,
        q_dtype=_BF16,
        k_dtype=_BF16,
        hadamard=False,
        q_quant=Fp8Rule(amax_floor=1e-10, scale_ratio="reciprocal", ue8m0_ceil="log2"),
        k_quant=_VLLM_RULE,
        weights_fold=("qs", "Ds", "Hs"),
        # The query kernel (fused_indexer_q_rope_quant) launches with Triton's default
        # contraction: fma(x0, cos, -fl(x1 sin)), fma(x1, cos, fl(x0 sin)) in its PTX
        # (docs/numerics.md, section 8.4); the key's RoPE is Inductor's Triton, read alike.
        fma=True,
        # The key LayerNorm as Inductor (torch 2.11, Triton 3.6) compiles vLLM's LayerNorm for
        # Hopper from 64 tokens per SM (max_num_batched_tokens; the LLM class's default 16384):
        # a Welford reduction with per-lane statistics (exact_math.layer_norm_fp32_welford;
        # docs/numerics.md, section 8.4; below that size: vllm_legacy_profile); Indexer.__init__
        # builds it with eps=1e-6.
        layernorm="fp32-welford",
        k_norm_eps=_ENGINE_K_NORM_EPS,
    ),
    EngineProfile(
        name="sglang-fused",
        summary=(
            "SGLang 0.5.23 fused CUDA indexer (GLM-5: interleaved indexer RoPE): FP32 "
            "preprocessing as nvcc compiles it (warp LayerNorm, eps 1e-6; contracted RoPE), k "
            "rounded to BF16 after RoPE, plain FP32 scales"
        ),
        k_dtype=_BF16,
        hadamard=False,
        rope_interleaved=True,
        q_quant=_SGLANG_FP32_RULE,
        k_quant=_SGLANG_FP32_RULE,
        weights_fold=("DsHs", "qs"),
        layernorm="fp32-warp",
        fma=True,
        rope_fma="cos-sin",
        k_norm_eps=_ENGINE_K_NORM_EPS,
    ),
    EngineProfile(
        name="sglang-unfused",
        summary=(
            "SGLang 0.5.23 unfused CUDA indexer (DeepSeek-V3.2: rotate-half RoPE): BF16 "
            "LayerNorm and RoPE outputs, BF16 Hadamard, UE8M0 q, plain FP32 k scales, FP32 "
            "head-weight GEMM"
        ),
        k_norm_dtype=_BF16,
        q_dtype=_BF16,
        k_dtype=_BF16,
        hadamard=True,
        rope_interleaved=False,
        q_quant=Fp8Rule(amax_floor=1e-4, scale_ratio="reciprocal", ue8m0_ceil="log2"),
        k_quant=_SGLANG_FP32_RULE,
        weights_dtype="fp32",
        weights_fold=("Hs", "qs", "Ds"),
        hadamard_scale="float32",
        # FlashInfer 0.7.2's CuTe DSL LayerNorm as its sm_90a PTX reads (one warp a row, the
        # butterfly up, the squares and var / 128 + eps fused) and SGLang's JIT RoPE as ptxas
        # contracts it (both halves fma(x, cos, fl(rot(x) sin))): every byte against SGLang's
        # own path on the GPU (docs/numerics.md, section 8.6).
        layernorm="fp32-warp-up",
        fma=True,
        rope_fma="cos",
        k_norm_eps=_ENGINE_K_NORM_EPS,
    ),
    EngineProfile(
        name="lmdeploy",
        summary=(
            "LMDeploy 0.18.0 / main (1263d5c) fused Triton indexer, the path xtuner matches: BF16 "
            "cos/sin, float32 LayerNorm (eps 1e-6) rounded to BF16, RoPE in BF16 arithmetic, "
            "amax floor fl32(1e-6), reciprocal multiply"
        ),
        cos_sin_dtype=_BF16,
        k_norm_dtype=_BF16,
        rope_dtype=_BF16,
        q_dtype=_BF16,
        k_dtype=_BF16,
        hadamard=False,
        q_quant=_LMDEPLOY_RULE,
        k_quant=_LMDEPLOY_RULE,
        weights_fold=("qs", "DsHs"),
        layernorm="fp32-ops",
        fma=True,
        k_norm_eps=_ENGINE_K_NORM_EPS,
        inv_freq_device="cpu",
        yarn_mscale="ratio-if-both",
    ),
)
# vLLM's default compiled run on Hopper; "vllm-exact" stays the literal all-FP32 contract.
DEFAULT_ENGINE = ENGINE_PROFILES["vllm"]


def _engine_profile(engine: EngineProfile | str, *, name: str = "engine") -> EngineProfile:
    """The profile for ``engine`` (a profile, or a name in :data:`ENGINE_PROFILES`)."""
    if isinstance(engine, EngineProfile):
        return engine
    if isinstance(engine, str) and engine in ENGINE_PROFILES:
        return ENGINE_PROFILES[engine]
    raise ValueError(
        f"{name}={engine!r} is not an engine profile; use one of {sorted(ENGINE_PROFILES)} or "
        "an EngineProfile."
    )


# Inductor (torch 2.11-2.13) compiles a row reduction as a persistent one only while the row
# count it compiles for is below 2 * 32 rows per SM (ir.Reduction's reduction hint; choices.py's
# threshold): 8,448 tokens on a 132-SM H100 SXM or H200.
_INDUCTOR_ROWS_PER_SM = 64
_INDUCTOR_XBLOCK_RULES: dict[int, LayerNormArith] = {
    1: "fp32-inductor-x1",
    8: "fp32-inductor-x8",
    32: "fp32-inductor-x8",
}


def vllm_legacy_profile(
    *, compiled_tokens: int, sm_count: int, xblock: int | None = None
) -> EngineProfile:
    """``vllm-legacy`` for the size vLLM 0.26-0.28 compiled its key LayerNorm for.

    Inductor's kernel for the key LayerNorm depends on the token count vLLM compiles for
    (``compiled_tokens``: ``max_num_batched_tokens``, the profiling run's size) and the GPU's
    ``sm_count``: from ``64 * sm_count`` tokens on a looped Welford reduction (the profile as
    registered, ``layernorm="fp32-welford"``); below, a persistent reduction whose configuration
    Inductor's autotuner keeps by timing at start-up, XBLOCK 1, 8 or 32 (``xblock``: the
    ``XBLOCK`` of the kernel's ``.best_config`` in vLLM's compile cache; 8 and 32 add alike).
    Raises when the configuration decides the bits and ``xblock`` is not given.
    """
    for arg, value in (("compiled_tokens", compiled_tokens), ("sm_count", sm_count)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{arg}={value!r} must be a positive integer, got a {type(value).__name__} (a "
                "bool or a float is refused)."
            )
    compiled_tokens, sm_count = int(compiled_tokens), int(sm_count)
    if xblock is not None:  # True == 1 and 8.0 == 8 would find a rule and name a profile by it
        if isinstance(xblock, bool) or not isinstance(xblock, numbers.Integral):
            raise TypeError(
                f"xblock={xblock!r} ({type(xblock).__name__}) must be an integer: the XBLOCK (1, "
                "8 or 32) of the LayerNorm kernel's .best_config in vLLM's compile cache."
            )
        xblock = int(xblock)
    base = ENGINE_PROFILES["vllm-legacy"]
    if compiled_tokens >= _INDUCTOR_ROWS_PER_SM * sm_count:
        return base
    if xblock is None or xblock not in _INDUCTOR_XBLOCK_RULES:
        raise ValueError(
            f"xblock={xblock!r}: vLLM compiled its key LayerNorm for {compiled_tokens} tokens, "
            f"below {_INDUCTOR_ROWS_PER_SM} * sm_count = {_INDUCTOR_ROWS_PER_SM * sm_count}, so "
            "Inductor's autotuner chose the kernel's XBLOCK by timing and the key's bits depend "
            "on it; pass the XBLOCK (1, 8 or 32) of the LayerNorm kernel's .best_config in "
            "vLLM's compile cache (docs/numerics.md, section 8.4)."
        )
    rule = _INDUCTOR_XBLOCK_RULES[xblock]
    return dataclasses.replace(base, name=f"vllm-legacy-xblock{xblock}", layernorm=rule)
