"""Shared fixtures: seeding, the ``gpu`` gate, a CPU-only Megatron environment, and the fixtures
of the GPU tests (``record``, ``megatron_parallel_gpu``), here so that a test marked ``gpu`` in
any folder sees them: the GPU step runs ``python -m pytest -m gpu tests``
(``tests/test_gpu_suite.py`` checks it collects every such test, fixtures found)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest
import torch

try:  # property-based tests: few examples in CI, more with DSA_PRECISION_HYPOTHESIS=thorough
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile(
        "thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile(os.environ.get("DSA_PRECISION_HYPOTHESIS", "ci"))
except ImportError:  # pip install -e '.[test]' brings it
    pass


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs an SM90 GPU, found SM{major}{minor}"
    try:
        from cudnn import DSA

        DSA.indexer_forward_wrapper  # noqa: B018
    except Exception as exc:
        return f"needs nvidia-cudnn-frontend's DSA kernels ({exc})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or _gpu_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def megatron_parallel():
    """gloo process group + Megatron model parallel state (TP = PP = 1) for CPU module tests."""
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install -e '.[megatron]')")
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield parallel_state


@pytest.fixture
def cpu_rotary(monkeypatch):
    """Megatron's RotaryEmbedding places its buffers on ``torch.cuda.current_device()`` whatever
    ``use_cpu_initialization`` says; point that at the CPU for the duration of a test."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture(scope="session")
def record():
    """Append a measured number to $DSA_PRECISION_REPORT (JSON lines) and print it."""
    path = os.environ.get("DSA_PRECISION_REPORT")

    def _record(name: str, **values):
        line = json.dumps({"test": name, **values})
        print(line)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return _record


@pytest.fixture(scope="session")
def megatron_parallel_gpu():
    """One NCCL process group (one rank) and Megatron's model-parallel state (TP = PP = 1) for
    the GPU tests that build Megatron modules."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return parallel_state
