"""The configurations and paths the tests share."""

from pathlib import Path

import torch

from dsa_precision import IndexerPrecisionConfig

ROOT = Path(__file__).resolve().parents[2]
BF16, FP8 = IndexerPrecisionConfig(), IndexerPrecisionConfig(scoring_precision="fp8")
CONFIGS = {"bf16": BF16, "fp8": FP8}
CPU = torch.device("cpu")
