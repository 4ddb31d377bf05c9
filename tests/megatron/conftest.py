"""The preamble of every Megatron test: megatron-core importable (else the folder is not
collected: ``pip install -e '.[megatron]'``), a gloo process group with Megatron's model
parallel state, and Megatron's RotaryEmbedding on the CPU."""

import importlib.util

import pytest

if (
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None
):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _megatron_on_the_cpu(megatron_parallel, cpu_rotary):
    """Every test here runs with Megatron's parallel state and a CPU RotaryEmbedding."""
    yield megatron_parallel
