"""Megatron configuration: the dsa-precision ``TransformerConfig`` fields and their flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

from ..backends import cudnn
from ..checks import _check_positive_int, _check_real
from ..config import _SCORING_BACKENDS, IndexerPrecisionConfig
from ..engines import DEFAULT_ENGINE, ENGINE_PROFILES, EngineProfile
from ..rope import RopeSpec, YarnScaling
from .kernel_backend import _TILELANG, _tilelang_problems
from .replay import _TOPK_SOURCES

__all__ = [
    "PRECISION_FIELDS",
    "DSAPrecisionTransformerConfig",
    "add_dsa_precision_args",
    "config_from_args",
]


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

    dsa_indexer_engine: str | EngineProfile = DEFAULT_ENGINE.name
    """The inference engine profile whose numerics the two fields above reproduce (a name of
    dsa_precision.ENGINE_PROFILES, or an EngineProfile such as vllm_legacy_profile(...)'s).
    Default "vllm": vLLM's default compiled run on Hopper ("vllm-exact" is the literal all-FP32
    contract of earlier releases)."""

    dsa_indexer_topk_source: Literal["compute", "replay", "verify", "replay_ties"] = "compute"
    """Where each DSA layer's top-k comes from: "compute" (as configured), "replay" (the keys the
    inference engine picked for this micro-batch, handed in with
    dsa_precision.megatron.engine_topk; the indexer does not score; needs zero indexer loss),
    "verify" (compute as configured and compare with the engine's picks; metrics from
    dsa_precision.megatron.topk_metrics) or "replay_ties" (compute as configured, FP8, and take
    the engine's picks of the rows it sent: its boundary-tied rows, from
    dsa_precision.capture.pack_tie_rows; every other row checked against the engine's digest).
    Default "compute"."""

    dsa_indexer_cuda_graph: bool | Literal["auto"] = "auto"
    """Replay each FP8 layer's owned top-k (projections, fused preprocess + quantize, scoring,
    top-k) from a CUDA graph captured on its first forward of each input layout, so a step pays
    one graph launch per layer instead of the indexer's host work (the short-sequence steps that
    wait for the host); the same bits as the eager top-k. A graph needs a CUDA device, no context
    parallelism and no sequence-parallel gather; packed (THD) input is captured per bucket of
    sequence count and length bound (dsa_precision.megatron.graphs.graph_packing). Default
    "auto": graphed where it can be, for forwards of at most AUTO_GRAPH_MAX_ROWS indexer rows,
    eager otherwise; True: every forward (one that cannot be captured raises; needs FP8
    scoring); False: always eager. Only FP8 layers that compute their top-k are affected: BF16
    scoring is Megatron's own."""

    dsa_indexer_scoring_backend: Literal["auto", "cudnn", "deepgemm", "torch"] = "auto"
    """The kernel the package scores the indexer with where it scores (FP8; BF16 verify and
    record): "deepgemm" (DeepGEMM's MQA logits, the engines' own kernel; FP8 only), "cudnn"
    (cuDNN's SM90 indexer kernel), "torch" (the exact reference) or "auto" (the fastest that
    serves the layer: DeepGEMM for FP8 when installed, else cuDNN, else torch), decided once per
    layer at its first call (``PrecisionDSAttention.scoring_backend``). The backends' FP8 logits
    differ in their accumulation order, so pin one to get the same bits on every machine; an
    explicit one that cannot run raises. Default "auto"."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate_dsa_precision()

    def validate_dsa_precision(self) -> IndexerPrecisionConfig:
        """Validate the dsa-precision fields against the model (one ``ValueError`` naming every
        field to fix) and freeze them (see ``__setattr__``). ``__post_init__`` runs it; a config
        that defers Megatron's checks to later (Megatron-Bridge's providers, ``finalize()``) runs
        it there."""
        precision = _validate_precision(self)
        object.__setattr__(self, _VALIDATED, precision)
        return precision

    def __setattr__(self, name: str, value: Any) -> None:
        """After ``__post_init__`` a precision field cannot change (the built layers decided on
        it); a Megatron field the precision was validated against is re-validated, and the
        assignment is undone if the combination can no longer be honoured."""
        validated = self.__dict__.get(_VALIDATED)
        if validated is None or name not in _REVALIDATED:
            object.__setattr__(self, name, value)
            return
        if name in PRECISION_FIELDS:
            if value == getattr(self, name):
                return
            raise AttributeError(
                f"{name} is frozen after the config is validated (it is {getattr(self, name)!r}, "
                f"asked {value!r}); the DSA layers decided on it when they were built. Build a "
                f"new config instead: dataclasses.replace(config, {name}={value!r})."
            )
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            object.__setattr__(self, _VALIDATED, _validate_precision(self))
        except (TypeError, ValueError) as exc:
            object.__setattr__(self, name, old)
            raise type(exc)(f"{name}={value!r} rejected (kept {old!r}): {exc}") from None

    @property
    def dsa_indexer_precision(self) -> IndexerPrecisionConfig:
        """The dsa-precision fields as the core's frozen :class:`IndexerPrecisionConfig`,
        validated against the model once (one ``ValueError`` naming every field to fix)."""
        validated = self.__dict__.get(_VALIDATED)
        return validated if validated is not None else _validate_precision(self)


# The fields of DSAPrecisionTransformerConfig: frozen once validated.
PRECISION_FIELDS = (
    "dsa_indexer_rope_fp32",
    "dsa_indexer_scoring_precision",
    "dsa_indexer_engine",
    "dsa_indexer_topk_source",
    "dsa_indexer_cuda_graph",
    "dsa_indexer_scoring_backend",
)
# The Megatron fields of the indexer's RoPE (megatron-core 0.19.2 DSAIndexer.__init__ builds its
# RotaryEmbedding / YarnRotaryEmbedding from them), with what each must be for the engine's tables.
_ROPE_FIELDS = (
    ("rope_type", "'rope' or 'yarn'"),
    ("rotary_base", "a positive finite number"),
    ("rotary_percent", "1.0"),
    ("rotary_scaling_factor", "a positive finite number"),
    ("original_max_position_embeddings", "a positive integer"),
    ("beta_fast", "a positive finite number"),
    ("beta_slow", "a positive finite number"),
    ("mscale", "a finite number"),
    ("mscale_all_dim", "a finite number"),
)
# Megatron's fields the precision is validated against (_validate_precision): re-validated when
# assigned after __post_init__ (Megatron's own layers read them per forward, and so may a test).
_VALIDATED_MEGATRON_FIELDS = (
    "dsa_indexer_loss_coeff",
    "dsa_indexer_scoring_relu",
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_rotate_activation",
    "dsa_indexer_rope_interleaved",
    "layernorm_epsilon",
    "dsa_indexer_k_norm_epsilon",
    "params_dtype",
    *(name for name, _ in _ROPE_FIELDS),
    # dsa_kernel_backend="tilelang" with a field switched on (kernel_backend.tilelang_problems)
    "dsa_kernel_backend",
    "attention_backend",
    "kv_lora_rank",
    "num_attention_heads",
    "tensor_model_parallel_size",
    "dsa_indexer_topk",
)
_REVALIDATED = frozenset(PRECISION_FIELDS + _VALIDATED_MEGATRON_FIELDS)
# Instance slot of the validated IndexerPrecisionConfig (set by __post_init__; absent before).
_VALIDATED = "_dsa_indexer_precision_validated"


def _layer_decisions(config: Any) -> tuple[IndexerPrecisionConfig, str]:
    """``(precision, topk_source)`` a DSA layer built on ``config`` decides once.

    A :class:`DSAPrecisionTransformerConfig` hands its validated (and frozen) fields; any other
    config (Megatron's ``MLATransformerConfig``) means Megatron's behaviour, and must not carry
    the fields as loose attributes, which nothing would validate or freeze."""
    if isinstance(config, DSAPrecisionTransformerConfig):
        return config.dsa_indexer_precision, config.dsa_indexer_topk_source
    loose = [name for name in PRECISION_FIELDS if hasattr(config, name)]
    if loose:
        raise TypeError(
            f"{type(config).__name__} carries {', '.join(loose)} as plain attributes; build the "
            "config as dsa_precision.megatron.DSAPrecisionTransformerConfig, which validates "
            "and freezes them."
        )
    return IndexerPrecisionConfig(), "compute"


def _indexer_k_norm_eps(config: Any) -> tuple[float, str]:
    """``(eps, field)``: the epsilon megatron-core 0.19.2 builds the indexer's key LayerNorm with
    (``DSAIndexer.__init__``: ``dsa_indexer_k_norm_epsilon`` when set, else
    ``layernorm_epsilon``) and the field it came from."""
    if config.dsa_indexer_k_norm_epsilon is not None:
        return config.dsa_indexer_k_norm_epsilon, "dsa_indexer_k_norm_epsilon"
    return config.layernorm_epsilon, "layernorm_epsilon"


def _rope_problems(config: Any) -> list[str]:
    """Why the engine's tables cannot stand for the indexer's RoPE of ``config`` (one line per
    field; empty: :func:`_indexer_rope_spec` builds them)."""
    rope_type = config.rope_type
    if rope_type not in ("rope", "yarn"):
        return [
            f"rope_type={rope_type!r}: megatron-core's DSA indexer builds 'rope' or 'yarn' RoPE "
            "only; set rope_type to one of them"
        ]
    if rope_type == "rope":
        values = {"rotary_base": config.rotary_base, "rotary_percent": config.rotary_percent}
    else:
        values = {
            "rotary_base": config.rotary_base,
            "rotary_scaling_factor": config.rotary_scaling_factor,
            "original_max_position_embeddings": config.original_max_position_embeddings,
            "beta_fast": config.beta_fast,
            "beta_slow": config.beta_slow,
            "mscale": config.mscale,
            "mscale_all_dim": config.mscale_all_dim,
        }
    problems = []
    for name, needed in _ROPE_FIELDS:
        if name not in values:
            continue
        value = values[name]
        try:
            if name == "original_max_position_embeddings":
                _check_positive_int(name, value)
            elif name == "rotary_percent":
                if _check_real(name, value) != 1.0:
                    raise ValueError(name)
            else:
                _check_real(name, value, positive="positive" in needed)
        except (TypeError, ValueError):
            why = (
                "the engines rotate all qk_pos_emb_head_dim lanes of the indexer (Megatron's "
                "RotaryEmbedding would rotate that share of them)"
                if name == "rotary_percent"
                else f"the engine's {rope_type} tables are built from it"
            )
            problems.append(
                f"{name}={value!r}: with dsa_indexer_rope_fp32 {why}; set {name} to {needed}"
            )
    if not problems:  # each value is one; together they must give a table (YaRN's range...)
        try:
            _rope_spec(config)
        except (TypeError, ValueError) as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in values.items())
            problems.append(
                f"{given} (qk_pos_emb_head_dim={config.qk_pos_emb_head_dim!r}): with "
                f"dsa_indexer_rope_fp32 the engine's {rope_type} tables are built from them, and "
                f"they give none: {str(exc).removesuffix('.')} (nor does Megatron's own RoPE "
                "module give a usable one)"
            )
    return problems


def _rope_spec(config: Any) -> RopeSpec:
    """The :class:`RopeSpec` of ``config``'s RoPE fields, built as they are."""
    yarn = None
    if config.rope_type == "yarn":
        yarn = YarnScaling(
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
            mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim,
        )
    return RopeSpec(config.qk_pos_emb_head_dim, config.rotary_base, yarn)


def _indexer_rope_spec(config: Any) -> RopeSpec:
    """The indexer's RoPE as megatron-core 0.19.2's ``DSAIndexer.__init__`` reads it
    (``qk_pos_emb_head_dim``, ``rope_type``, ``rotary_base`` and, for ``"yarn"``, the YaRN
    fields), for the engine's own tables; ``ValueError`` naming every field the tables cannot
    honour (a ``DSAPrecisionTransformerConfig`` with ``rope_fp32`` refuses them when built)."""
    problems = _rope_problems(config)
    if problems:
        raise ValueError("the indexer's RoPE fields:\n  - " + "\n  - ".join(problems))
    return _rope_spec(config)


def _validate_precision(config: DSAPrecisionTransformerConfig) -> IndexerPrecisionConfig:
    """One ``ValueError`` naming every field that keeps the requested precision from running."""
    try:  # the scoring backend joins once its own rules hold (below, with Megatron's names)
        precision = IndexerPrecisionConfig(
            rope_fp32=config.dsa_indexer_rope_fp32,
            scoring_precision=config.dsa_indexer_scoring_precision,
            engine=config.dsa_indexer_engine,
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"dsa_indexer_{exc}") from None
    problems = []
    source = config.dsa_indexer_topk_source
    if source not in _TOPK_SOURCES:
        raise ValueError(
            f"dsa_indexer_topk_source={source!r} is not a top-k source; use one of {_TOPK_SOURCES}."
        )
    if source == "replay_ties" and not precision.fp8:
        problems.append(
            "dsa_indexer_topk_source='replay_ties' keeps its own picks wherever the engine's "
            "boundary is not tied, which are the engine's only under its precision; set "
            "dsa_indexer_scoring_precision='fp8' (with dsa_indexer_rope_fp32=True for the vLLM "
            "and SGLang profiles)"
        )
    if source == "replay" and config.dsa_indexer_loss_coeff not in (None, 0, 0.0):
        problems.append(
            f"dsa_indexer_loss_coeff={config.dsa_indexer_loss_coeff!r}: dsa_indexer_topk_source="
            "'replay' skips the indexer's scoring, so there are no scores to train; set it to 0"
        )
    backend = config.dsa_indexer_scoring_backend
    if backend not in _SCORING_BACKENDS:
        raise ValueError(
            f"dsa_indexer_scoring_backend={backend!r} is not a scoring backend; use one of "
            f"{_SCORING_BACKENDS}."
        )
    if backend == "deepgemm" and not precision.fp8:
        problems.append(
            "dsa_indexer_scoring_backend='deepgemm': DeepGEMM's MQA logits score FP8 operands "
            "only; set dsa_indexer_scoring_precision='fp8' or another backend"
        )
    graph = config.dsa_indexer_cuda_graph
    if not isinstance(graph, bool) and graph != "auto":
        raise TypeError(f"dsa_indexer_cuda_graph={graph!r}: pass True, False or 'auto'.")
    if graph is True and not precision.fp8:
        problems.append(
            "dsa_indexer_cuda_graph=True: the graph replays the owned FP8 top-k, and BF16 scoring "
            "is Megatron's; set dsa_indexer_scoring_precision='fp8' or dsa_indexer_cuda_graph=False"
        )
    if graph is True and source == "replay":
        problems.append(
            "dsa_indexer_cuda_graph=True: dsa_indexer_topk_source='replay' does not score, so "
            "there is nothing to capture; set dsa_indexer_cuda_graph=False"
        )
    stock = precision == IndexerPrecisionConfig(engine=precision.engine)
    if (not stock or source != "compute") and config.dsa_kernel_backend == _TILELANG:
        # Megatron's TileLang sparse attention declines some layouts and then falls back to its
        # PyTorch one without a word: with a field of ours on, such a layout is refused here.
        problems += _tilelang_problems(config)
    if stock and not problems and backend == "auto":
        return precision  # Megatron's behaviour: nothing of ours runs
    # Not checked here: experimental_attention_variant. A DSA module built directly (as Megatron's
    # own tests do) acts on the fields whatever it says; a spec with no DSA layer for them is
    # refused where it is built (get_gpt_dsa_precision_block_spec, with_dsa_precision(spec, config)).
    if precision.fp8:
        if not config.dsa_indexer_scoring_relu:
            problems.append(
                "dsa_indexer_scoring_relu=False: the FP8 indexer kernels apply ReLU per head; "
                "set dsa_indexer_scoring_relu=True"
            )
        if torch.cuda.is_available() and not cudnn.dsa_available():
            problems.append(
                f"dsa_indexer_scoring_precision='fp8' on this GPU: {cudnn.dsa_unavailable_reason()}"
            )
    # An MLA model without a DSA indexer (no indexer heads or width): nothing for the fields to
    # act on here; a spec builder refuses a spec with no DSA layer for them (specs.py).
    if config.dsa_indexer_n_heads is not None or config.dsa_indexer_head_dim is not None:
        k_norm_eps, k_norm_eps_field = _indexer_k_norm_eps(config)
        problems += precision.model_problems(
            indexer_loss_coeff=config.dsa_indexer_loss_coeff,
            n_heads=config.dsa_indexer_n_heads,
            head_dim=config.dsa_indexer_head_dim,
            rotate_activation=config.dsa_indexer_rotate_activation,
            rope_interleaved=config.dsa_indexer_rope_interleaved,
            k_norm_eps=k_norm_eps,  # what Megatron builds the indexer's k_norm with
            k_norm_eps_field=k_norm_eps_field,
            params_dtype=config.params_dtype,  # the projections' and the k_norm's parameters
            rope_type=config.rope_type,
        )
        if precision.rope_fp32:  # the engine's RoPE tables stand for Megatron's angles
            problems += _rope_problems(config)
    if problems:
        raise ValueError(
            f"dsa-precision fields ({precision.short_str()}, dsa_indexer_engine="
            f"{precision.engine.name!r}) cannot be honoured:\n  - " + "\n  - ".join(problems)
        )
    return dataclasses.replace(precision, scoring_backend=backend)


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
        choices=_TOPK_SOURCES,
        default="compute",
        help="Where each DSA layer's top-k comes from: computed, replayed from the inference "
        "engine, computed and verified against it, or computed with the engine's tied rows "
        "replayed (replay_ties; default compute).",
    )
    group.add_argument(
        "--dsa-indexer-cuda-graph",
        choices=("auto", "true", "false"),
        default="auto",
        help="Replay each FP8 layer's owned top-k from a CUDA graph (no CP/SP gather): auto "
        "(default: where it can be, up to AUTO_GRAPH_MAX_ROWS rows), true (always), false.",
    )
    group.add_argument(
        "--dsa-indexer-scoring-backend",
        choices=_SCORING_BACKENDS,
        default="auto",
        help="Kernel of the package's indexer scoring (default auto: DeepGEMM for FP8 when "
        "installed, else cuDNN, else the torch reference).",
    )
    group.add_argument(
        "--dsa-indexer-engine",
        choices=sorted(ENGINE_PROFILES),
        default=DEFAULT_ENGINE.name,
        help="Inference engine profile the indexer numerics reproduce "
        f"(default {DEFAULT_ENGINE.name}).",
    )
    return parser


def _graph_flag(value: str | bool) -> bool | str:
    """``--dsa-indexer-cuda-graph``'s value as the field takes it (``"true"`` / ``"false"`` ->
    ``True`` / ``False``; a namespace may also carry the bool or ``"auto"``)."""
    return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value


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
        dsa_indexer_cuda_graph=_graph_flag(getattr(args, "dsa_indexer_cuda_graph", "auto")),
        dsa_indexer_scoring_backend=getattr(args, "dsa_indexer_scoring_backend", "auto"),
    )
    fields.update(overrides)
    return DSAPrecisionTransformerConfig(**fields)
