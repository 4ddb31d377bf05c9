"""The toy model of ``examples/toy_glm5_train.py`` in a one-process CUDA session, for the tools
that time it (``tools/host_profile.py``, ``tools/step_phases.py``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from types import ModuleType

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(port: int) -> ModuleType:
    """Join a one-rank NCCL group and Megatron's model parallelism (1 x 1); return the toy
    script as a module."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    spec = importlib.util.spec_from_file_location(
        "toy_glm5_train", os.path.join(_ROOT, "examples", "toy_glm5_train.py")
    )
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    return toy


def toy_args(seq: int, topk: int) -> argparse.Namespace:
    """The toy script's arguments for a full-size model on CUDA, batch 1, its default seed."""
    return argparse.Namespace(tiny=False, topk=topk, engine="vllm", device="cuda", seed=1234,
                              seq=seq, batch=1, lr=1e-3)  # fmt: skip
