"""The configurations and paths the tests share."""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from dsa_precision import IndexerPrecisionConfig

ROOT = Path(__file__).resolve().parents[2]
BF16, FP8 = IndexerPrecisionConfig(), IndexerPrecisionConfig(scoring_precision="fp8")
CONFIGS = {"bf16": BF16, "fp8": FP8}
CPU = torch.device("cpu")


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` (the tools are scripts, not a package), loaded as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
