"""dsa-precision: train the DSA lightning indexer with the precision inference scores it in.

Importing this package loads no kernels and needs neither megatron-core nor cudnn-frontend.
The Megatron integration lives in ``dsa_precision.megatron``; the commands in
``dsa_precision.cli`` (``python -m dsa_precision``).
"""

# ruff: noqa: I001  (sections follow the dataflow, not the alphabet)

# Configuration: the switches and the inference engine's rules
from .engines import ENGINE_PROFILES, EngineProfile, Fp8Rule, vllm_legacy_profile
from .config import IndexerPrecisionConfig, ScoringPrecision

# Quantization (E4M3 values, one FP32 descale per 128-vector)
from .quantize import dequantize_fp8, quantize_e4m3_ue8m0, quantize_fp8, ue8m0_descale

# Preprocessing (key LayerNorm -> RoPE -> Hadamard, query RoPE -> Hadamard)
from .preprocess import IndexerPreprocess

# Scoring operands: where the precision is visible, and how they are built
from .operands import ScoringOperands
from .prepare import prepare_indexer_operands, prepare_scoring_operands

# Scoring, top-k, and both in one pass (BSHD and packed THD)
from .rows import WindowScores
from .scoring import (
    indexer_scores,
    indexer_scores_varlen,
    indexer_window_scores,
    indexer_window_scores_varlen,
)
from .topk import indexer_topk
from .select import indexer_select, indexer_select_varlen

# Train / inference top-k agreement, and why rows differ (ties no precision can decide)
from .agreement import TopkAgreement, topk_agreement
from .ties import RowCauses, classify_rows

# Accounting of the precision each scoring call used
from .audit import (
    PrecisionMismatchError,
    reset_scoring_calls,
    scoring_calls,
    scoring_site,
    strict_precision,
)

__version__ = "0.2.0"

__all__ = [
    "ENGINE_PROFILES",
    "EngineProfile",
    "Fp8Rule",
    "IndexerPrecisionConfig",
    "IndexerPreprocess",
    "PrecisionMismatchError",
    "RowCauses",
    "ScoringOperands",
    "ScoringPrecision",
    "TopkAgreement",
    "WindowScores",
    "classify_rows",
    "dequantize_fp8",
    "indexer_scores",
    "indexer_scores_varlen",
    "indexer_select",
    "indexer_select_varlen",
    "indexer_topk",
    "indexer_window_scores",
    "indexer_window_scores_varlen",
    "prepare_indexer_operands",
    "prepare_scoring_operands",
    "quantize_e4m3_ue8m0",
    "quantize_fp8",
    "reset_scoring_calls",
    "scoring_calls",
    "scoring_site",
    "strict_precision",
    "topk_agreement",
    "ue8m0_descale",
    "vllm_legacy_profile",
]
