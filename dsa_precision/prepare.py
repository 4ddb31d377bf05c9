"""How :class:`~dsa_precision.ScoringOperands` are built: from preprocessed carriers or from the
indexer's projections, in one precision, decided once.

- :func:`prepare_scoring_operands` builds them from preprocessed q / k carriers (BF16 or FP32)
  and head weights: BF16 rounding, or FP8 quantization under the engine profile's rules.
- :func:`prepare_indexer_operands` builds them from the indexer's projections: preprocessing
  (key LayerNorm -> RoPE -> Hadamard) and quantization.
- :func:`_as_scoring_operands`: operands as they are, or carriers prepared (what every scoring
  entry point takes).

On CUDA both run the fused Triton kernel (:mod:`dsa_precision.kernels.preprocess_quantize`) for
FP8 when it reproduces the torch reference bit for bit (:mod:`dsa_precision.preprocess_kernel`), and the
reference otherwise; the bytes are the same either way.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Mapping
from typing import cast

import torch

from .checks import (
    _check_float_dtype,
    _check_freqs_cover,
    _check_real,
    _check_same_device,
    _check_tensor,
    _takes_precision_config,
)
from .config import _QUANT_BLOCK, IndexerPrecisionConfig, ScoringPrecision, _check_precision_config
from .devices import _DerivedCache, _shared_device_tensor, f32
from .engines import EngineProfile
from .kernels.rules import PreprocessRules, _engine_lanes_differ
from .operands import _WEIGHT_DTYPES, ScoringOperands
from .preprocess import IndexerPreprocess, _indexer_head_weights, layer_norm_params
from .preprocess_kernel import (
    _MAX_KERNEL_FOLD_SCALES,
    Impl,
    _check_impl,
    _fused_unsupported_reason,
    _quantize_kernel_reason,
    _use_kernel,
)
from .quantize import quantize_fp8
from .rope import RopePositions, _thd_token_freqs, rope_tables

__all__ = ["prepare_indexer_operands", "prepare_scoring_operands"]

_CARRIER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------ from carriers


def _carriers(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, weights = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("weights", weights)
    _check_float_dtype("q", q, _CARRIER_DTYPES)
    _check_float_dtype("k", k, _CARRIER_DTYPES)
    _check_float_dtype("weights", weights, _CARRIER_DTYPES)
    _check_same_device(q=q, k=k, weights=weights)
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


def _round_bf16(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, sm_scale: float
) -> ScoringOperands:
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


def _fold_head_weights(
    weights: torch.Tensor,
    q_descale: torch.Tensor | None,
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
        # (no "qs": q_descale unused, may be None)
        w = w * (cast(torch.Tensor, q_descale) if step == "qs" else constants[step])
    return w if sm_scale == 1.0 else w * f32(sm_scale)


@functools.lru_cache(maxsize=64)
def _fold_constants(n_heads: int, head_dim: int) -> Mapping[str, float]:
    return types.MappingProxyType(
        {
            "Ds": f32(head_dim**-0.5),
            "Hs": f32(n_heads**-0.5),
            "DsHs": f32(head_dim**-0.5 * n_heads**-0.5),
        }
    )


def _quantize_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    sm_scale: float,
    engine: EngineProfile,
    fold: tuple[str, ...],
) -> ScoringOperands:
    """FP8 operands in torch: the engine's quantizers; the q descale folded into the weights."""
    q8, q_descale = quantize_fp8(q, engine.q_quant)
    k8, k_descale = quantize_fp8(k, engine.k_quant)
    h, d = q.shape[-2], q.shape[-1]
    w = _fold_head_weights(weights, q_descale, fold, n_heads=h, head_dim=d, sm_scale=sm_scale)
    return ScoringOperands(
        q8.contiguous(), k8.contiguous(), w.contiguous(), q_descale.contiguous(), k_descale
    )


@_takes_precision_config
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
    config = _check_precision_config(config)
    q, k, weights = _carriers(q, k, weights)
    sm_scale = _check_real("sm_scale", sm_scale)
    return _with_backend(_scoring_operands(q, k, weights, config, sm_scale, impl), config)


def _scoring_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    config: IndexerPrecisionConfig,
    sm_scale: float,
    impl: Impl,
) -> ScoringOperands:
    """:func:`prepare_scoring_operands` of checked carriers, before the config's kernel is set."""
    if config.scoring_precision is ScoringPrecision.BF16:
        _check_impl(impl, "the fused kernel builds FP8 operands; BF16 scoring only rounds")
        return _round_bf16(q, k, weights, sm_scale)
    if q.shape[-1] != _QUANT_BLOCK:
        raise ValueError(
            f"q and k have head dim {q.shape[-1]}; FP8 scoring quantizes {_QUANT_BLOCK}-wide "
            "vectors. Use scoring_precision='bf16'."
        )
    engine = config.engine
    if _use_kernel(impl, _quantize_kernel_reason(q, k, weights, engine)):
        return _quantize_triton(q, k, weights, sm_scale, engine)
    return _quantize_reference(q, k, weights, sm_scale, engine, _CARRIER_FOLD)


def _with_backend(ops: ScoringOperands, config: IndexerPrecisionConfig) -> ScoringOperands:
    """``ops`` carrying ``config``'s scoring kernel (checked against their precision when the
    config was built): the last step of both preparing entry points, whichever path built the
    operands."""
    if config.scoring_backend == ops.backend:
        return ops
    return ops.replace_trusted(backend=config.scoring_backend)


def _quantize_triton(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, sm_scale: float, engine: EngineProfile
) -> ScoringOperands:
    """The fused kernel with no preprocessing: BSHD carriers read as ``[S, B, H, D]`` views."""
    from .kernels.preprocess_quantize import preprocess_quantize

    rules = PreprocessRules.carriers(engine)
    q8, q_descale, w = preprocess_quantize(
        q.transpose(0, 1), rules, weights=weights.transpose(0, 1), fold_scales=(f32(sm_scale),)
    )
    k8, k_descale, _ = preprocess_quantize(k.transpose(0, 1), rules)
    assert w is not None  # weights were given
    return ScoringOperands.trusted(q8, k8[:, :, 0], w, q_descale, k_descale[:, :, 0])


def _as_scoring_operands(
    q: torch.Tensor | ScoringOperands,
    k: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    config: IndexerPrecisionConfig | None = None,
    sm_scale: float = 1.0,
    entry: str | None = None,
) -> ScoringOperands:
    """``q`` if it is :class:`ScoringOperands` (then no carriers may be given, and ``config``,
    if given, must name their precision), else the carriers prepared by
    :func:`prepare_scoring_operands` under ``config``: what every scoring entry point takes.
    ``entry``: the public function called with carriers, named in its ``DeprecationWarning``
    (scoring and selection take prepared operands; the carrier form goes in the next release)."""
    if config is not None:
        config = _check_precision_config(config)
    if isinstance(q, ScoringOperands):
        if k is not None or weights is not None:
            raise ValueError("pass either ScoringOperands or q, k, weights carriers, not both.")
        if config is not None and config.scoring_precision is not q.precision:
            raise ValueError(
                f"the operands are {q.precision.value} but config asks for "
                f"scoring_precision='{config.scoring_precision.value}'; prepare them in the "
                "requested precision."
            )
        if _check_real("sm_scale", sm_scale) != 1.0:
            raise ValueError("sm_scale is part of ScoringOperands; prepare them with it.")
        return q
    if k is None or weights is None or config is None:
        raise ValueError(
            "carriers need q, k, weights and config=IndexerPrecisionConfig(scoring_precision="
            "'bf16' or 'fp8', engine=...); or pass ScoringOperands."
        )
    if entry is not None:
        warnings.warn(
            f"{entry}(q, k, weights, config=...) is deprecated: prepare the operands once with "
            f"dsa_precision.prepare_scoring_operands(q, k, weights, config=...) and pass them, "
            f"{entry}(operands, ...).",
            DeprecationWarning,
            stacklevel=4,  # the caller of the public entry (through its keyword-check wrapper)
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
    positions: RopePositions | None = None,
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
            when on the CPU, never read on the host when on a device.
        token_freqs: ``[s, 1, 1, rope_dim]`` angles of every row, when the caller knows them
            (context-parallel THD chunks); by default gathered from ``freqs`` by ``cu_seqlens``.
        positions: every row's RoPE position, for a ``preprocess`` with the engine's own tables
            (:attr:`IndexerPreprocess.rope_tables`, ``rope_fp32``): the fused kernel and the
            reference read the same rows of them (:meth:`IndexerPreprocess.engine_rope_rows`).
        impl: ``"triton"`` (the fused kernel; raises ``RuntimeError`` with the reason when it
            cannot produce the reference bits), ``"torch"`` (the reference) or ``"auto"``.

    Returns:
        :class:`ScoringOperands` in BSHD (packed input: batch 1), the same bytes whichever path
        built them.
    """
    config = _check_precision_config(config)
    if preprocess.rope_fp32 != config.rope_fp32 or (
        preprocess.engine is not config.engine and preprocess.engine != config.engine
    ):
        raise ValueError(
            f"preprocess (rope_fp32={preprocess.rope_fp32}, engine={preprocess.engine.name!r}) "
            f"does not match config (rope_fp32={config.rope_fp32}, engine="
            f"{config.engine.name!r}); build the IndexerPreprocess from the same config."
        )
    sm_scale, mscale = _check_real("sm_scale", sm_scale), _check_real("mscale", mscale)
    if cu_seqlens is not None and q_proj.shape[1] != 1:
        raise ValueError(f"packed (THD) input needs batch 1, got q {tuple(q_proj.shape)}.")
    with torch.no_grad():
        ops = _indexer_operands(
            preprocess, q_proj, k_proj, w_proj, freqs, config, sm_scale, mscale, cu_seqlens,
            token_freqs, positions, impl,
        )  # fmt: skip
    return _with_backend(ops, config)


def _indexer_operands(
    preprocess: IndexerPreprocess,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    w_proj: torch.Tensor,
    freqs: torch.Tensor,
    config: IndexerPrecisionConfig,
    sm_scale: float,
    mscale: float,
    cu_seqlens: torch.Tensor | None,
    token_freqs: torch.Tensor | None,
    positions: RopePositions | None,
    impl: Impl,
) -> ScoringOperands:
    """:func:`prepare_indexer_operands` of checked arguments, before the config's kernel is
    set."""
    n_heads, head_dim = q_proj.shape[-2], q_proj.shape[-1]
    if not config.fp8:
        _check_impl(impl, "the fused kernel builds FP8 operands; BF16 scoring only rounds")
        q, k = preprocess(
            q_proj, k_proj, freqs, mscale=mscale, cu_seqlens=cu_seqlens,
            token_freqs=token_freqs, positions=positions,
        )  # fmt: skip
        w = _indexer_head_weights(w_proj, n_heads=n_heads, head_dim=head_dim, fp32=False)
        return _round_bf16(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), sm_scale)
    engine = config.engine
    pre, post = _split_fold(engine.weights_fold, sm_scale, n_heads, head_dim)
    reason = _fused_unsupported_reason(preprocess, q_proj, k_proj, w_proj, config=config)
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
            else _fold_head_weights(w_proj, None, pre, n_heads=n_heads, head_dim=head_dim)
        )
        # The kernel writes the engine's lane order itself (no reordering copy).
        rules = PreprocessRules.indexer(preprocess, engine, q_proj.dtype)
        rows = q_proj.shape[0]
        if preprocess.rope_fp32 and preprocess.rope_tables is not None:
            # The engine's tables, the rows the reference reads (one definition).
            cos, sin = preprocess.engine_rope_rows(
                positions, rows, q_proj.device, freqs, cu_seqlens, dtype=rules.math_dtype
            )
        else:
            if token_freqs is None:  # the kernel reads every row's angles
                token_freqs = (
                    freqs if cu_seqlens is None else _thd_token_freqs(freqs, cu_seqlens, rows)
                )
            if token_freqs.shape[-1] != preprocess.rope_dim:
                raise ValueError(
                    f"freqs has rope width {token_freqs.shape[-1]}, expected rope_dim="
                    f"{preprocess.rope_dim}."
                )
            _check_freqs_cover("freqs", token_freqs, rows)
            cos, sin = _kernel_rope_tables(
                token_freqs, rows, mscale, rules.table_dtype, rules.math_dtype
            )
        return _fused(preprocess, rules, q_proj, k_proj, w_pre, cos, sin, fold_scales=post)
    q, k = preprocess(
        q_proj, k_proj, freqs, mscale=mscale, cu_seqlens=cu_seqlens, token_freqs=token_freqs,
        positions=positions,
    )  # fmt: skip
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
    return ops.replace_trusted(q=reorder(ops.q), k=reorder(ops.k))


@_shared_device_tensor
def _engine_lanes(half: int, d: int, device: torch.device) -> torch.Tensor:
    """int64 ``(d,)``: the interleaved RoPE pairs ``(j, half + j)`` of the first ``2 * half``
    lanes, then the rest in order (built on the device, once: shared read-only)."""
    lanes = torch.arange(d, device=device)
    pairs = torch.stack((lanes[:half], lanes[half : 2 * half]), dim=-1).flatten()
    return torch.cat((pairs, lanes[2 * half :]))


@functools.lru_cache(maxsize=64)
def _split_fold(
    steps: tuple[str, ...], sm_scale: float, n_heads: int, head_dim: int
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The fold steps before the q descale, and the float32 scalars after it (``sm_scale`` last
    when it is not 1.0)."""
    i = steps.index("qs")
    constants = _fold_constants(n_heads, head_dim)
    post = tuple(constants[s] for s in steps[i + 1 :])
    return steps[:i], post + ((f32(sm_scale),) if sm_scale != 1.0 else ())


def _fused(
    preprocess: IndexerPreprocess,
    rules: PreprocessRules,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    w_pre: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    fold_scales: tuple[float, ...],
) -> ScoringOperands:
    """The fused kernel under ``rules``; ``cos`` / ``sin`` ``[s, rope_dim]`` (contiguous, in
    ``rules.math_dtype``) hold one row of the RoPE tables per token, ``w_pre`` the head weights
    before the q descale (BF16 or float32), ``fold_scales`` the scalars after it. The operands
    come out in the engine's lane order (:func:`_engine_lane_order`'s bytes, written so)."""
    from .kernels.preprocess_quantize import preprocess_quantize

    s, b, h, _ = q_proj.shape
    if k_proj.shape != (s, b, q_proj.shape[-1]) or w_pre.shape != (s, b, h):
        raise ValueError(
            f"expected k [{s}, {b}, 128] and weights [{s}, {b}, {h}] for q {tuple(q_proj.shape)}; "
            f"got k {tuple(k_proj.shape)}, weights {tuple(w_pre.shape)}."
        )
    if cos.shape != (s, preprocess.rope_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"expected RoPE tables [{s}, {preprocess.rope_dim}]; got cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}."
        )
    if preprocess.rope_fp32:  # the engine's LayerNorm, in the kernel
        k_in, layer_norm = k_proj, layer_norm_params(preprocess.k_norm)
    else:  # Megatron's BF16 path: the model's own LayerNorm, whose reduction order only the
        # module reproduces
        k_in, layer_norm = preprocess.norm_key(k_proj), None
    q8, q_descale, w = preprocess_quantize(
        q_proj, rules, cos=cos, sin=sin, weights=w_pre, fold_scales=fold_scales
    )
    k8, k_descale, _ = preprocess_quantize(k_in, rules, cos=cos, sin=sin, layer_norm=layer_norm)
    assert w is not None  # weights were given
    return ScoringOperands.trusted(q8, k8[:, :, 0], w, q_descale, k_descale[:, :, 0])


# The fused kernel's RoPE tables by angle tensor: Megatron's RotaryEmbedding returns the same
# (lru-cached) angles tensor for a length while its class-wide cache (32 entries over every
# layer's instance) holds it; each layer's indexer has its own instance, so past ~16 layers the
# angles, and these tables, are rebuilt per forward (a miss costs what the tables cost uncached).
_ROPE_TABLES = _DerivedCache(size=16)


def _kernel_rope_tables(
    freqs: torch.Tensor, s: int, mscale: float, table_dtype: torch.dtype, math_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[s, rope_dim]`` contiguous in ``math_dtype``: :func:`rope_tables` of the
    first ``s`` rows of ``freqs`` rounded to ``table_dtype``, remembered for this ``freqs``
    object and version (:class:`~dsa_precision.devices._DerivedCache`; shared: read only)."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(freqs[:s], mscale, table_dtype)
        cos, sin = cos.to(math_dtype), sin.to(math_dtype)
        return cos.reshape(s, -1).contiguous(), sin.reshape(s, -1).contiguous()

    return _ROPE_TABLES.get(freqs, (s, mscale, table_dtype, math_dtype), build)
