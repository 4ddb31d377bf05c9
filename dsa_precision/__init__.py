"""dsa-precision: train the DSA lightning indexer with the precision inference scores it in.

Importing this package loads no kernels and needs neither megatron-core nor cudnn-frontend.
The Megatron integration lives in ``dsa_precision.megatron``.
"""

# ruff: noqa: I001  (sections follow the dataflow, not the alphabet)

# Configuration
from .config import IndexerPrecisionConfig, ScoringPrecision

# Preprocessing (key LayerNorm -> RoPE -> Hadamard, query RoPE -> Hadamard)
from .preprocess import IndexerPreprocess

# Quantization (E4M3 values, one UE8M0 descale per 128-vector)
from .quantize import dequantize_e4m3_ue8m0, quantize_e4m3_ue8m0, ue8m0_descale

# Scoring (the single choke point) and top-k selection
from .scoring import indexer_scores
from .topk import indexer_select, indexer_topk

# Fused indexer + sparse attention (the precision is a forward input)
from .fused import FusedIndexerSparseAttnFunc, fused_indexer_sparse_attention

# Train / inference top-k agreement
from .agreement import TopkAgreement, topk_agreement

# Accounting of the precision each scoring call used
from .audit import reset_scoring_calls, scoring_calls, scoring_site

__version__ = "0.1.0"

__all__ = [
    "FusedIndexerSparseAttnFunc",
    "IndexerPrecisionConfig",
    "IndexerPreprocess",
    "ScoringPrecision",
    "TopkAgreement",
    "dequantize_e4m3_ue8m0",
    "fused_indexer_sparse_attention",
    "indexer_scores",
    "indexer_select",
    "indexer_topk",
    "quantize_e4m3_ue8m0",
    "reset_scoring_calls",
    "scoring_calls",
    "scoring_site",
    "topk_agreement",
    "ue8m0_descale",
]
