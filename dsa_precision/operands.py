"""What the scoring kernels read: :class:`ScoringOperands`, and the two ways to build them.

Precision is decided here, once, and is visible in the operands' dtypes::

    bf16:  q (B, S_q, H, D) bf16   k (B, S_k, D) bf16   weights (B, S_q, H) bf16|fp32
           score = sm_scale * sum_h relu(q_h . k) * w_h
    fp8:   q (B, S_q, H, D) e4m3   k (B, S_k, D) e4m3   weights (B, S_q, H) fp32
           q_descale (B, S_q, H) fp32, k_descale (B, S_k) fp32
           score = k_descale * sum_h relu(q_h . k) * w_h,  w_h = (head weight * q_descale) * sm_scale

(the FP8 layout of DeepGEMM's ``fp8_mqa_logits`` and of cuDNN's SM90 ``precision="fp8"`` kernel:
the q descale is folded into the float32 head weights, the k descale is applied per key).

- :func:`prepare_scoring_operands` builds them from preprocessed q / k carriers (BF16 or FP32)
  and head weights: BF16 rounding, or FP8 quantization under the engine profile's rules.
- :func:`prepare_indexer_operands` builds them from the indexer's projections: preprocessing
  (key LayerNorm -> RoPE -> Hadamard) and quantization.

On CUDA both run the fused Triton kernel (:mod:`dsa_precision.kernels.preprocess_quantize`) for
FP8 when it reproduces the torch reference bit for bit, and the reference otherwise; the bytes are
the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import types
from collections.abc import Mapping
from typing import Literal

import torch

from ._checks import (
    check_float_dtype,
    check_freqs_cover,
    check_real,
    check_same_device,
    check_tensor,
    takes_precision_config,
)
from ._device import DerivedCache, shared_device_tensor
from ._device import f32 as _f32
from .config import QUANT_BLOCK, IndexerPrecisionConfig, ScoringPrecision, check_precision_config
from .engines import EngineProfile
from .hadamard import HAVE_FAST_HADAMARD
from .preprocess import (
    IndexerPreprocess,
    _check_layer_norm,
    _layer_norm_params,
    indexer_head_weights,
    rope_tables,
    thd_token_freqs,
)
from .quantize import quantize_fp8

__all__ = [
    "Impl",
    "ScoringOperands",
    "as_scoring_operands",
    "fused_unsupported_reason",
    "prepare_indexer_operands",
    "prepare_scoring_operands",
]

Impl = Literal["auto", "triton", "torch"]
_IMPLS = ("auto", "triton", "torch")
_CARRIER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
# Smallest float32 amax floor of the kernel (kernels.preprocess_quantize.MIN_AMAX_FLOOR; repeated
# here so that deciding does not import Triton).
_MIN_AMAX_FLOOR = 2.0**-100


@dataclasses.dataclass(frozen=True)
class ScoringOperands:
    """Scoring operands, batch first (packed THD input has batch 1); see the module docstring.

    Construct through :func:`prepare_scoring_operands` / :func:`prepare_indexer_operands`, or
    directly from tensors of an engine (e.g. captured DeepGEMM operands); the constructor checks
    dtypes, shapes and devices (no data is read).
    """

    q: torch.Tensor  # (B, S_q, H, D) bf16 | float8_e4m3fn
    k: torch.Tensor  # (B, S_k, D) bf16 | float8_e4m3fn
    weights: torch.Tensor  # (B, S_q, H) bf16 | fp32; fp8: fp32 with q_descale and sm_scale folded
    q_descale: torch.Tensor | None = None  # (B, S_q, H) fp32, fp8 only (already in weights)
    k_descale: torch.Tensor | None = None  # (B, S_k) fp32, fp8 only
    sm_scale: float = 1.0  # applied by the kernel; fp8: 1.0 (folded into weights)

    def __post_init__(self) -> None:
        q, k, w = self.q, self.k, self.weights
        for name, t in (("q", q), ("k", k), ("weights", w)):
            check_tensor(name, t)
        fp8 = q.dtype == torch.float8_e4m3fn
        want = torch.float8_e4m3fn if fp8 else torch.bfloat16
        if q.dtype not in (torch.float8_e4m3fn, torch.bfloat16) or k.dtype != want:
            raise TypeError(
                f"ScoringOperands take bf16 or float8_e4m3fn q and k of the same dtype; got q "
                f"{q.dtype}, k {k.dtype} (build them with prepare_scoring_operands)."
            )
        if q.ndim != 4 or k.ndim != 3 or w.ndim != 3:
            raise ValueError(
                f"ScoringOperands are q (B, S_q, H, D), k (B, S_k, D), weights (B, S_q, H); got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(w.shape)}."
            )
        b, sq, h, d = q.shape
        if h == 0 or d == 0:
            raise ValueError(
                f"q has shape {tuple(q.shape)}: {h} heads of width {d} score nothing (every score "
                "would be 0); the indexer needs at least one head of nonzero width."
            )
        if k.shape[0] != b or k.shape[2] != d or tuple(w.shape) != (b, sq, h):
            raise ValueError(
                f"ScoringOperands shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)} "
                f"(expected ({b}, S_k, {d})), weights {tuple(w.shape)} (expected {(b, sq, h)})."
            )
        if fp8:
            if w.dtype != torch.float32 or self.q_descale is None or self.k_descale is None:
                raise TypeError(
                    "fp8 operands need float32 weights (q descale folded in) and float32 "
                    "q_descale and k_descale."
                )
            for name, t, shape in (
                ("q_descale", self.q_descale, (b, sq, h)),
                ("k_descale", self.k_descale, (b, k.shape[1])),
            ):
                if t.dtype != torch.float32 or tuple(t.shape) != shape:
                    raise ValueError(
                        f"{name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}."
                    )
            if self.sm_scale != 1.0:
                raise ValueError("fp8 operands fold sm_scale into the weights; pass sm_scale=1.0.")
        else:
            if w.dtype not in _WEIGHT_DTYPES:
                raise TypeError(f"bf16 operands take bf16 or float32 weights, got {w.dtype}.")
            if self.q_descale is not None or self.k_descale is not None:
                raise ValueError("bf16 operands carry no descales.")
        check_real("sm_scale", self.sm_scale)
        check_same_device(q=q, k=k, weights=w, q_descale=self.q_descale, k_descale=self.k_descale)

    @property
    def precision(self) -> ScoringPrecision:
        """FP8 for E4M3 operands, BF16 otherwise."""
        fp8 = self.q.dtype == torch.float8_e4m3fn
        return ScoringPrecision.FP8 if fp8 else ScoringPrecision.BF16

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self, start: int, stop: int) -> ScoringOperands:
        """The operands of query rows ``[start, stop)`` (views; keys unchanged); all of them:
        these operands (checked when they were built; nothing to rebuild)."""
        if start == 0 and stop == self.q.shape[1]:
            return self
        qs = None if self.q_descale is None else self.q_descale[:, start:stop]
        return self._replace_checked(
            q=self.q[:, start:stop], weights=self.weights[:, start:stop], q_descale=qs
        )

    def _replace_checked(self, **fields: torch.Tensor | None) -> ScoringOperands:
        """These operands with some tensors replaced by tensors of the same kind (dtype, device,
        and shapes that keep the operands consistent: a row slice, a lane permutation), which the
        package derived from these: built without running the constructor's checks again (they
        held for these operands; host time per call)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ScoringOperands._built(**{**current, **fields})

    @classmethod
    def _built(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        sm_scale: float = 1.0,
    ) -> ScoringOperands:
        """Operands the package built itself from inputs it checked (the fused kernel's outputs,
        whose dtypes, shapes and device follow from those inputs): the constructor's checks hold
        by construction and are not run again (host time per call; the tests compare these
        operands with the checked reference's)."""
        new = object.__new__(cls)
        for name, value in (
            ("q", q), ("k", k), ("weights", weights), ("q_descale", q_descale),
            ("k_descale", k_descale), ("sm_scale", sm_scale),
        ):  # fmt: skip
            object.__setattr__(new, name, value)
        return new


# ------------------------------------------------------------------------------ from carriers


def _carriers(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor):
    q, k, weights = check_tensor("q", q), check_tensor("k", k), check_tensor("weights", weights)
    check_float_dtype("q", q, _CARRIER_DTYPES)
    check_float_dtype("k", k, _CARRIER_DTYPES)
    check_float_dtype("weights", weights, _CARRIER_DTYPES)
    check_same_device(q=q, k=k, weights=weights)
    if k.ndim == 4:
        if k.shape[2] != 1:
            raise ValueError(
                f"k has {k.shape[2]} heads ({tuple(k.shape)}); the indexer scores every query "
                "head against one key."
            )
        k = k.squeeze(2)
    if q.ndim != 4 or k.ndim != 3 or weights.ndim != 3:
        raise ValueError(
            "expected q (B, S_q, H, D), k (B, S_k, D) or (B, S_k, 1, D) and weights (B, S_q, H); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}."
        )
    b, sq, h, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"batch mismatch: q has {b}, k has {k.shape[0]}.")
    if k.shape[2] != d:
        raise ValueError(f"head dim mismatch: q has {d}, k has {k.shape[2]}.")
    if tuple(weights.shape) != (b, sq, h):
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}; expected one weight per query row and "
            f"head, {(b, sq, h)}."
        )
    return q, k, weights


def _round_bf16(q, k, weights, sm_scale: float) -> ScoringOperands:
    """BF16 operands: FP32 carriers rounded to BF16 (what BF16 scoring means here)."""
    w = weights if weights.dtype in _WEIGHT_DTYPES else weights.to(torch.float32)
    # A non-finite query row gets NaN weights, so its scores are NaN on every backend (cuDNN's
    # ReLU is fmax, which would turn a NaN dot product into 0). Reads q once; no host sync.
    bad_rows = ~torch.isfinite(q).all(dim=-1)
    w = w.masked_fill(bad_rows, float("nan"))
    return ScoringOperands(
        q.to(torch.bfloat16).contiguous(),
        k.to(torch.bfloat16).contiguous(),
        w.contiguous(),
        sm_scale=float(sm_scale),
    )


_CARRIER_FOLD: tuple[str, ...] = ("qs",)


def fold_head_weights(
    weights: torch.Tensor,
    q_descale: torch.Tensor,
    steps: tuple[str, ...],
    *,
    n_heads: int,
    head_dim: int,
    sm_scale: float = 1.0,
) -> torch.Tensor:
    """float32 scoring weights: ``weights`` multiplied in float32 by each step in turn.

    ``"qs"`` is the q descale, ``"Ds"`` ``fp32(D**-0.5)``, ``"Hs"`` ``fp32(H**-0.5)``, ``"DsHs"``
    ``fp32(D**-0.5 * H**-0.5)`` (the product taken in double); a final ``sm_scale`` when it is
    not 1.0 (:attr:`dsa_precision.EngineProfile.weights_fold` names each engine's order).
    """
    constants = _fold_constants(n_heads, head_dim)
    w = weights.to(torch.float32)
    for step in steps:
        w = w * (q_descale if step == "qs" else constants[step])  # (no "qs": q_descale unused)
    return w if sm_scale == 1.0 else w * _f32(sm_scale)


@functools.lru_cache(maxsize=64)
def _fold_constants(n_heads: int, head_dim: int) -> Mapping[str, float]:
    return types.MappingProxyType(
        {
            "Ds": _f32(head_dim**-0.5),
            "Hs": _f32(n_heads**-0.5),
            "DsHs": _f32(head_dim**-0.5 * n_heads**-0.5),
        }
    )


def _quantize_reference(
    q, k, weights, sm_scale: float, engine: EngineProfile, fold: tuple[str, ...]
) -> ScoringOperands:
    """FP8 operands in torch: the engine's quantizers; the q descale folded into the weights."""
    q8, q_descale = quantize_fp8(q, engine.q_quant)
    k8, k_descale = quantize_fp8(k, engine.k_quant)
    h, d = q.shape[-2], q.shape[-1]
    w = fold_head_weights(weights, q_descale, fold, n_heads=h, head_dim=d, sm_scale=sm_scale)
    return ScoringOperands(
        q8.contiguous(), k8.contiguous(), w.contiguous(), q_descale.contiguous(), k_descale
    )


@takes_precision_config
def prepare_scoring_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    config: IndexerPrecisionConfig,
    sm_scale: float = 1.0,
    impl: Impl = "auto",
) -> ScoringOperands:
    """Scoring operands from preprocessed carriers.

    Args:
        q: ``(B, S_q, H, 128)`` preprocessed queries, bfloat16 or an FP32 carrier.
        k: ``(B, S_k, 128)`` (or ``(B, S_k, 1, 128)``) preprocessed keys, same dtypes.
        weights: ``(B, S_q, H)`` head weights as Megatron computes them (already scaled by
            ``H**-0.5 * D**-0.5``), bfloat16 or float32.
        config: the precision. ``scoring_precision="bf16"`` rounds the carriers to BF16;
            ``"fp8"`` quantizes them under the ``engine``'s rules (``q_quant``, ``k_quant``) and
            folds the q descale and ``sm_scale`` into float32 weights,
            ``((fp32(w) * q_descale) * sm_scale)`` (the engine's head-weight order applies from
            the projections: :func:`prepare_indexer_operands`). Its ``rope_fp32`` is the
            carriers' business (they are already preprocessed).
        sm_scale: score scale (1.0 for Megatron, whose weights carry the scaling).
        impl: ``"triton"`` (the fused kernel, FP8 on CUDA; raises with the reason when it cannot
            reproduce the reference), ``"torch"`` (the reference) or ``"auto"``.

    Returns:
        :class:`ScoringOperands`; the same bytes whichever implementation built them.
    """
    config = check_precision_config(config)
    precision, engine = config.scoring_precision, config.engine
    q, k, weights = _carriers(q, k, weights)
    sm_scale = check_real("sm_scale", sm_scale)
    if precision is ScoringPrecision.BF16:
        _check_impl(impl, "the fused kernel builds FP8 operands; BF16 scoring only rounds")
        return _round_bf16(q, k, weights, sm_scale)
    if q.shape[-1] != QUANT_BLOCK:
        raise ValueError(
            f"q and k have head dim {q.shape[-1]}; FP8 scoring quantizes {QUANT_BLOCK}-wide "
            "vectors. Use scoring_precision='bf16'."
        )
    reason = _quantize_kernel_reason(q, k, weights, engine)
    if _use_kernel(impl, reason):
        return _quantize_triton(q, k, weights, sm_scale, engine)
    return _quantize_reference(q, k, weights, sm_scale, engine, _CARRIER_FOLD)


def _quantize_triton(q, k, weights, sm_scale: float, engine: EngineProfile) -> ScoringOperands:
    """The fused kernel with no preprocessing: BSHD carriers read as ``[S, B, H, D]`` views."""
    from .kernels.preprocess_quantize import preprocess_quantize

    common = dict(rope_dim=0, interleaved=False, hadamard=False, bf16_math=False)
    q8, q_descale, w = preprocess_quantize(
        q.transpose(0, 1),
        rule=engine.q_quant,
        weights=weights.transpose(0, 1),
        fold_scales=(_f32(sm_scale),),
        **common,
    )
    k8, k_descale, _ = preprocess_quantize(k.transpose(0, 1), rule=engine.k_quant, **common)
    return ScoringOperands._built(q8, k8[:, :, 0], w, q_descale, k_descale[:, :, 0])


def as_scoring_operands(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
) -> ScoringOperands:
    """``q`` if it is :class:`ScoringOperands` (then no carriers may be given, and ``config``,
    if given, must name their precision), else the carriers prepared by
    :func:`prepare_scoring_operands` under ``config``: what every scoring entry point takes."""
    if config is not None:
        config = check_precision_config(config)
    if isinstance(q, ScoringOperands):
        if k is not None or weights is not None:
            raise ValueError("pass either ScoringOperands or q, k, weights carriers, not both.")
        if config is not None and config.scoring_precision is not q.precision:
            raise ValueError(
                f"the operands are {q.precision.value} but config asks for "
                f"scoring_precision='{config.scoring_precision.value}'; prepare them in the "
                "requested precision."
            )
        if check_real("sm_scale", sm_scale) != 1.0:
            raise ValueError("sm_scale is part of ScoringOperands; prepare them with it.")
        return q
    if k is None or weights is None or config is None:
        raise ValueError(
            "carriers need q, k, weights and config=IndexerPrecisionConfig(scoring_precision="
            "'bf16' or 'fp8', engine=...); or pass ScoringOperands."
        )
    return prepare_scoring_operands(q, k, weights, config=config, sm_scale=sm_scale)


# ---------------------------------------------------------------------------- from projections


def prepare_indexer_operands(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    w_proj: torch.Tensor,
    freqs: torch.Tensor,
    *,
    config: IndexerPrecisionConfig,
    sm_scale: float = 1.0,
    mscale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    token_freqs: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> ScoringOperands:
    """Scoring operands of the indexer from its projections (no autograd: FP8 scoring has no
    indexer gradient, and BF16 operands are rounded copies).

    Args:
        preprocess: the indexer's :class:`~dsa_precision.preprocess.IndexerPreprocess`, built for
            ``config`` (same ``rope_fp32`` and engine).
        q_proj: ``[s, b, h, 128]`` projected queries (BF16 in training).
        k_proj: ``[s, b, 128]`` projected keys.
        w_proj: ``[s, b, h]`` the ``linear_weights_proj`` output (BF16; FP32 for an engine whose
            ``weights_dtype`` is ``"fp32"``). BF16 scoring scales it as Megatron does, FP8
            scoring folds it in the engine's order (:attr:`EngineProfile.weights_fold`).
        freqs: ``[s, 1, 1, rope_dim]`` float32 RoPE angles (packed: per-sequence or per-token).
        config: the precision (and engine) to build the operands in.
        sm_scale: score scale folded into the FP8 weights (BF16: applied by the kernel).
        mscale: YaRN magnitude scale of the RoPE tables.
        cu_seqlens: ``[n + 1]`` cumulative lengths for packed THD input (``b == 1``); checked
            when on the CPU, never read on the host when on a device (:func:`thd_token_freqs`).
        token_freqs: ``[s, 1, 1, rope_dim]`` angles of every row, when the caller knows them
            (context-parallel THD chunks); by default gathered from ``freqs`` by ``cu_seqlens``.
        impl: ``"triton"`` (the fused kernel; raises ``RuntimeError`` with the reason when it
            cannot produce the reference bits), ``"torch"`` (the reference) or ``"auto"``.

    Returns:
        :class:`ScoringOperands` in BSHD (packed input: batch 1), the same bytes whichever path
        built them.
    """
    config = check_precision_config(config)
    if preprocess.rope_fp32 != config.rope_fp32 or (
        preprocess.engine is not config.engine and preprocess.engine != config.engine
    ):
        raise ValueError(
            f"preprocess (rope_fp32={preprocess.rope_fp32}, engine={preprocess.engine.name!r}) "
            f"does not match config (rope_fp32={config.rope_fp32}, engine="
            f"{config.engine.name!r}); build the IndexerPreprocess from the same config."
        )
    sm_scale, mscale = check_real("sm_scale", sm_scale), check_real("mscale", mscale)
    if cu_seqlens is not None and q_proj.shape[1] != 1:
        raise ValueError(f"packed (THD) input needs batch 1, got q {tuple(q_proj.shape)}.")
    n_heads, head_dim = q_proj.shape[-2], q_proj.shape[-1]
    with torch.no_grad():
        if not config.fp8:
            _check_impl(impl, "the fused kernel builds FP8 operands; BF16 scoring only rounds")
            q, k = preprocess(
                q_proj, k_proj, freqs, mscale=mscale, cu_seqlens=cu_seqlens, token_freqs=token_freqs
            )
            w = indexer_head_weights(w_proj, n_heads=n_heads, head_dim=head_dim, fp32=False)
            return _round_bf16(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), sm_scale)
        engine = config.engine
        pre, post = _split_fold(engine.weights_fold, sm_scale, n_heads, head_dim)
        reason = fused_unsupported_reason(preprocess, q_proj, k_proj, w_proj, config=config)
        if reason is None and len(post) > _MAX_KERNEL_FOLD_SCALES:
            reason = (
                f"the head weights take {len(post)} scalings after the q descale; the fused "
                f"kernel takes at most {_MAX_KERNEL_FOLD_SCALES}"
            )
        if _use_kernel(impl, reason):
            # With no step before the q descale the kernel reads the projection's weights as
            # they are (BF16 widened exactly): no float32 copy per call.
            w_pre = (
                w_proj
                if not pre
                else fold_head_weights(w_proj, None, pre, n_heads=n_heads, head_dim=head_dim)
            )
            if token_freqs is None:  # the kernel reads every row's angles
                rows = q_proj.shape[0]
                token_freqs = (
                    freqs if cu_seqlens is None else thd_token_freqs(freqs, cu_seqlens, rows)
                )
            # The kernel writes the engine's lane order itself (no reordering copy).
            return _fused(
                preprocess, q_proj, k_proj, w_pre, token_freqs, engine=engine, mscale=mscale,
                fold_scales=post,
            )  # fmt: skip
        q, k = preprocess(
            q_proj, k_proj, freqs, mscale=mscale, cu_seqlens=cu_seqlens, token_freqs=token_freqs
        )
        ops = _quantize_reference(
            q.transpose(0, 1), k.transpose(0, 1), w_proj.transpose(0, 1), sm_scale, engine,
            engine.weights_fold,
        )  # fmt: skip
        return _engine_lane_order(ops, preprocess)


def _engine_lane_order(ops: ScoringOperands, preprocess: IndexerPreprocess) -> ScoringOperands:
    """FP8 operands with interleaved RoPE pairs back in place (no Hadamard rotation).

    Megatron de-interleaves the RoPE lanes of ``dsa_indexer_rope_interleaved`` models into halves
    (``apply_rope``); the engines rotate each adjacent pair in place (vLLM
    ``models/deepseek_v32/common/kernels.py`` ``INDEX_ROPE_INTERLEAVE``; SGLang's fused GLM
    path), so their q and k hold the same values in the checkpoint's lane order. The exact score
    does not depend on the order, but Hopper's FP8 tensor cores add the products of each 32-lane
    step with about 13 bits (docs/numerics.md, section 7): the engine's order gives the engine's
    logits. With the Hadamard rotation on, lanes are mixed after RoPE and Megatron's order stays.
    """
    if not _engine_lanes_differ(preprocess):
        return ops
    order = _engine_lanes(preprocess.rope_dim // 2, ops.q.shape[-1], ops.device)

    def reorder(x8: torch.Tensor) -> torch.Tensor:  # on the bytes: E4M3 has no index kernels
        return x8.view(torch.uint8).index_select(-1, order).view(torch.float8_e4m3fn)

    # The same shapes, dtypes and device as the operands checked when they were built.
    return ops._replace_checked(q=reorder(ops.q), k=reorder(ops.k))


def _engine_lanes_differ(preprocess: IndexerPreprocess) -> bool:
    """Whether the engines' lane order is not Megatron's: interleaved RoPE pairs, no Hadamard."""
    return preprocess.rope_interleaved and not preprocess.rotate_activation


@shared_device_tensor
def _engine_lanes(half: int, d: int, device: torch.device) -> torch.Tensor:
    """int64 ``(d,)``: the interleaved RoPE pairs ``(j, half + j)`` of the first ``2 * half``
    lanes, then the rest in order (built on the device, once: shared read-only)."""
    lanes = torch.arange(d, device=device)
    pairs = torch.stack((lanes[:half], lanes[half : 2 * half]), dim=-1).flatten()
    return torch.cat((pairs, lanes[2 * half :]))


# The fused kernel multiplies the folded weight by at most this many scalars after the descale.
_MAX_KERNEL_FOLD_SCALES = 3


@functools.lru_cache(maxsize=64)
def _split_fold(
    steps: tuple[str, ...], sm_scale: float, n_heads: int, head_dim: int
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The fold steps before the q descale, and the float32 scalars after it (``sm_scale`` last
    when it is not 1.0)."""
    i = steps.index("qs")
    constants = _fold_constants(n_heads, head_dim)
    post = tuple(constants[s] for s in steps[i + 1 :])
    return steps[:i], post + ((_f32(sm_scale),) if sm_scale != 1.0 else ())


def _interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run in its CPU interpreter (set before import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_unavailable_reason() -> str | None:
    """Why the package's Triton kernels cannot run here, or ``None`` if they import."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        from .kernels import preprocess_quantize, topk_picks  # noqa: F401
    except Exception as exc:  # a broken Triton install
        return f"the Triton kernels do not import ({exc})"
    return None


def _device_reason(t: torch.Tensor) -> str | None:
    if _interpreting():
        return None  # Triton's interpreter runs the kernel on CPU tensors (the exactness tests)
    if t.device.type != "cuda":
        return f"the tensors are on {t.device}; the fused kernel runs on CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return None


def _rule_reason(engine: EngineProfile) -> str | None:
    for name, rule in (("q_quant", engine.q_quant), ("k_quant", engine.k_quant)):
        floor32 = _f32(rule.amax_floor)
        if not _MIN_AMAX_FLOOR <= floor32 < float("inf"):
            return f"{name}.amax_floor={rule.amax_floor!r} is below the fused kernel's 2**-100"
    return None


def _quantize_kernel_reason(q, k, weights, engine: EngineProfile) -> str | None:
    """Why the fused kernel cannot quantize these carriers bit-identically, or ``None``."""
    reason = _device_reason(q) or _rule_reason(engine)
    if reason:
        return reason
    if q.shape[-1] != QUANT_BLOCK:
        return f"head_dim={q.shape[-1]}; the fused kernel quantizes {QUANT_BLOCK}-wide vectors"
    if q.dtype not in _WEIGHT_DTYPES or k.dtype not in _WEIGHT_DTYPES:
        return f"carriers are {q.dtype}/{k.dtype}; the fused kernel takes BF16 or float32"
    if weights.dtype not in _WEIGHT_DTYPES:
        return f"weights are {weights.dtype}; the fused kernel takes BF16 or float32"
    return triton_unavailable_reason()


def fused_unsupported_reason(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    weights: torch.Tensor,
    *,
    config: IndexerPrecisionConfig,
) -> str | None:
    """Why the fused kernel cannot build these FP8 operands bit-identically, or ``None`` if it can."""
    if not config.fp8:
        return "the fused kernel builds FP8 operands; BF16 scoring only rounds (torch path)"
    reason = _device_reason(q_proj) or _rule_reason(config.engine)
    if reason:
        return reason
    if q_proj.ndim != 4 or k_proj.ndim != 3 or weights.ndim != 3:
        return "the fused kernel takes q [s, b, h, 128], k [s, b, 128] and weights [s, b, h]"
    if preprocess.head_dim != QUANT_BLOCK or q_proj.shape[-1] != QUANT_BLOCK:
        return f"head_dim={preprocess.head_dim}; the fused kernel quantizes 128-wide vectors"
    if q_proj.dtype not in _WEIGHT_DTYPES or k_proj.dtype != q_proj.dtype:
        return (
            f"projections are {q_proj.dtype}/{k_proj.dtype}; the fused kernel takes BF16 or "
            "float32, the same for q and k"
        )
    if weights.dtype not in _WEIGHT_DTYPES:
        return f"weights are {weights.dtype}; the fused kernel takes BF16 or float32"
    if not preprocess.rope_fp32 and not preprocess.exact_bf16_rope:
        return (
            "the model's BF16 RoPE is a fused kernel (apply_rope_fusion), whose bits the fused "
            "preprocess + quantize kernel does not reproduce"
        )
    if not preprocess.rope_fp32 and preprocess.rotate_activation and HAVE_FAST_HADAMARD:
        return (
            "fast_hadamard_transform is installed, so the reference BF16 Hadamard is that "
            "kernel's arithmetic, which the fused kernel does not reproduce bit for bit"
        )
    if preprocess.rope_fp32:
        try:
            _check_layer_norm(preprocess.k_norm)
        except TypeError as exc:
            return str(exc)
    return triton_unavailable_reason()


def _fused(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    w_pre: torch.Tensor,
    freqs: torch.Tensor,
    *,
    engine: EngineProfile,
    mscale: float,
    fold_scales: tuple[float, ...],
) -> ScoringOperands:
    """The fused kernel; ``freqs`` holds one row of angles per token, ``w_pre`` the head weights
    before the q descale (BF16 or float32), ``fold_scales`` the scalars after it. The operands
    come out in the engine's lane order (:func:`_engine_lane_order`'s bytes, written so)."""
    from .kernels.preprocess_quantize import preprocess_quantize

    s, b, h, _ = q_proj.shape
    if k_proj.shape != (s, b, q_proj.shape[-1]) or w_pre.shape != (s, b, h):
        raise ValueError(
            f"expected k [{s}, {b}, 128] and weights [{s}, {b}, {h}] for q {tuple(q_proj.shape)}; "
            f"got k {tuple(k_proj.shape)}, weights {tuple(w_pre.shape)}."
        )
    if freqs.shape[-1] != preprocess.rope_dim:
        raise ValueError(
            f"freqs has rope width {freqs.shape[-1]}, expected rope_dim={preprocess.rope_dim}."
        )
    check_freqs_cover("freqs", freqs, s)
    if preprocess.rope_fp32:
        # The engine's rules: tables rounded to its cache dtype, RoPE in its arithmetic dtype,
        # outputs rounded where it rounds.
        math_dtype = engine.rope_dtype
        cos, sin = _kernel_rope_tables(freqs, s, mscale, engine.cos_sin_dtype, math_dtype)
        k_in, layer_norm = k_proj, _layer_norm_params(preprocess.k_norm)
        ln_out_bf16 = engine.k_norm_dtype == torch.bfloat16
        out_bf16 = {"q": engine.q_dtype == torch.bfloat16, "k": engine.k_dtype == torch.bfloat16}
        rules = dict(
            fma=engine.fma,
            layer_norm_ops=engine.layernorm == "fp32-ops",
            hadamard_scale_fp32=engine.hadamard_scale == "float32",
        )
    else:  # Megatron's BF16 path; the model's own LayerNorm, whose reduction order only the
        # module reproduces
        math_dtype = q_proj.dtype
        cos, sin = _kernel_rope_tables(freqs, s, mscale, math_dtype, math_dtype)
        k_in, layer_norm, ln_out_bf16 = preprocess.norm_key(k_proj), None, False
        bf16 = math_dtype == torch.bfloat16  # its outputs (the Hadamard's too) stay BF16
        out_bf16 = {"q": bf16, "k": bf16}
        rules = {}
    common = dict(
        rope_dim=preprocess.rope_dim,
        interleaved=preprocess.rope_interleaved,
        hadamard=preprocess.rotate_activation,
        input_lane_order=_engine_lanes_differ(preprocess),
        bf16_math=math_dtype == torch.bfloat16,
        cos=cos,
        sin=sin,
        **rules,
    )
    q8, q_descale, w = preprocess_quantize(
        q_proj, rule=engine.q_quant, weights=w_pre, fold_scales=fold_scales,
        out_bf16=out_bf16["q"], **common,
    )  # fmt: skip
    k8, k_descale, _ = preprocess_quantize(
        k_in, rule=engine.k_quant, layer_norm=layer_norm, ln_out_bf16=ln_out_bf16,
        out_bf16=out_bf16["k"], **common,
    )  # fmt: skip
    return ScoringOperands._built(q8, k8[:, :, 0], w, q_descale, k_descale[:, :, 0])


# The fused kernel's RoPE tables by angle tensor: Megatron's RotaryEmbedding returns the same
# (lru-cached) angles tensor for a length while its class-wide cache (32 entries over every
# layer's instance) holds it; each layer's indexer has its own instance, so past ~16 layers the
# angles, and these tables, are rebuilt per forward (a miss costs what the tables cost uncached).
_ROPE_TABLES = DerivedCache(size=16)


def _kernel_rope_tables(
    freqs: torch.Tensor, s: int, mscale: float, table_dtype: torch.dtype, math_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[s, rope_dim]`` contiguous in ``math_dtype``: :func:`rope_tables` of the
    first ``s`` rows of ``freqs`` rounded to ``table_dtype``, remembered for this ``freqs``
    object and version (:class:`~dsa_precision._device.DerivedCache`; shared: read only)."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(freqs[:s], mscale, table_dtype)
        cos, sin = cos.to(math_dtype), sin.to(math_dtype)
        return cos.reshape(s, -1).contiguous(), sin.reshape(s, -1).contiguous()

    return _ROPE_TABLES.get(freqs, (s, mscale, table_dtype, math_dtype), build)


def _check_impl(impl: str, bf16_reason: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not an implementation; use one of {_IMPLS}.")
    if impl == "triton":
        raise RuntimeError(
            f"impl='triton' cannot build these operands: {bf16_reason}. Use impl='torch' or "
            "impl='auto'."
        )


def _use_kernel(impl: str, reason: str | None) -> bool:
    """Whether to run the fused kernel; an explicit ``impl="triton"`` that cannot run raises."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not an implementation; use one of {_IMPLS}.")
    if impl == "torch":
        return False
    if reason is not None and impl == "triton":
        raise RuntimeError(
            f"impl='triton' cannot build these operands: {reason}. Use impl='torch' (the "
            "reference, same bytes) or impl='auto'."
        )
    return reason is None


# Re-exported for the Megatron integration and the commands (one definition of the head weights).
__all__ += ["indexer_head_weights"]
