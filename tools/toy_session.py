"""The toy model of ``examples/toy_glm5_train.py`` in a one-process CUDA session, for the tools
that time it (``tools/host_profile.py``, ``tools/step_phases.py``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from types import ModuleType

import torch

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
    examples = os.path.join(_ROOT, "examples")
    if examples not in sys.path:  # the toy imports its neighbours (host_time)
        sys.path.insert(0, examples)
    spec = importlib.util.spec_from_file_location(
        "toy_glm5_train", os.path.join(examples, "toy_glm5_train.py")
    )
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    return toy


def toy_args(seq: int, topk: int) -> argparse.Namespace:
    """The toy script's arguments for a full-size model on CUDA, batch 1, its default seed."""
    return argparse.Namespace(tiny=False, topk=topk, engine="vllm", device="cuda", seed=1234,
                              seq=seq, batch=1, lr=1e-3)  # fmt: skip


def step_phases(trainer, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """One training step of the toy's ``trainer`` (its ``step``: forward, backward, update),
    with a clock and a CUDA event between the phases: host ms until each returns, GPU ms of each
    span, and the whole step's wall ms (the loss read back)."""
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    t = [time.perf_counter()]
    events[0].record()
    loss = trainer.forward(tokens, labels)
    events[1].record()
    t.append(time.perf_counter())
    trainer.backward(loss)
    events[2].record()
    t.append(time.perf_counter())
    trainer.update()
    events[3].record()
    t.append(time.perf_counter())
    loss.item()
    t.append(time.perf_counter())
    return {
        "fwd host": (t[1] - t[0]) * 1e3,
        "fwd gpu": events[0].elapsed_time(events[1]),
        "bwd host": (t[2] - t[1]) * 1e3,
        "bwd gpu": events[1].elapsed_time(events[2]),
        "opt host": (t[3] - t[2]) * 1e3,
        "opt gpu": events[2].elapsed_time(events[3]),
        "step": (t[4] - t[0]) * 1e3,
    }
