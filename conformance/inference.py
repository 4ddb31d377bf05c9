"""The inference side of the comparisons: the engine's own kernels on CUDA when they are present
(:mod:`.engine_kernels`), otherwise the independent model of :mod:`dsa_precision.cli.engine_model`."""

from __future__ import annotations

from dsa_precision.cli.engine_model import MODEL_SOURCE, EngineOperands, engine_operands
from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.engines import EngineProfile

from . import engine_kernels

__all__ = ["inference_operands"]


def inference_operands(
    inputs: SyntheticIndexerInputs, engine: EngineProfile, *, hadamard: bool, interleaved: bool
) -> tuple[EngineOperands, str]:
    """The inference side's operands and what built them: the engine's own kernels
    (:func:`~conformance.engine_kernels.engine_kernel_operands`) when the inputs are on
    CUDA and the profile's kernels are in ``DSA_ENGINE_KERNELS``, otherwise
    :func:`engine_operands`, with the reason in the description."""
    oracle = engine_kernels.oracle_for(engine)
    why: str | None
    if not inputs.q.is_cuda:
        why = "they run on CUDA"
    elif oracle is None:
        why = f"no engine kernel serves profile '{engine.name}' here"
    elif hadamard:
        why = f"{oracle}'s kernels have no Hadamard rotation"
    else:
        why = engine_kernels.missing_reason(oracle)
    if why is None:
        run = engine_kernels.engine_kernel_operands(inputs, engine, interleaved=interleaved)
        return run.operands, f"the engine's own kernels ({run.source})"
    ops = engine_operands(inputs, engine, hadamard=hadamard, interleaved=interleaved)
    return ops, f"{MODEL_SOURCE}; not the engine's kernels: {why}"
