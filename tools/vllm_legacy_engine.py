"""vLLM 0.28.0's indexer key and query in a process of their own, under any torch.

tools/layer_conformance.py runs this as a child for the ``vllm-legacy`` cells, with
``--engine-torch DIR`` (a ``pip install --target`` of torch 2.13.0 and Triton 3.7.1, what vLLM
0.28.0 pins) first on ``PYTHONPATH``, so that Inductor and Triton of vLLM's own release compile
the key path (:mod:`conformance.legacy_key`), and ``TORCHINDUCTOR_CACHE_DIR`` under
the output folder, so that the code Inductor generated is kept beside the result:

    python tools/vllm_legacy_engine.py INPUTS.pt OUTPUT.pt [--eager]

INPUTS.pt (``torch.save`` of a dict): ``kw`` [S, D + H] and ``q`` [S, H, D] bfloat16, the key
LayerNorm's ``norm_weight`` / ``norm_bias``, ``spec`` (a ``RopeSpec``), ``interleaved``,
``max_position_embeddings``. OUTPUT.pt: the :class:`LegacyEngineRun` fields on the CPU.

The process loads torch with lazy symbol binding: torch 2.13.0's ``libtorch_cuda.so`` names
functions of NCCL 2.29 (``ncclCommResume``, ``ncclCommSuspend``, ``ncclPutSignal``, ...) that the
GPU host's NCCL 2.28.9 (torch 2.11's pin) lacks; one process on one GPU never calls them, and
with eager binding the import would fail on the first.
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import os


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs")
    p.add_argument("output")
    p.add_argument("--eager", action="store_true", help="the same code without torch.compile")
    args = p.parse_args(argv)
    sys.setdlopenflags((sys.getdlopenflags() & ~os.RTLD_NOW) | os.RTLD_LAZY)
    import torch

    from conformance.legacy_key import legacy_engine_run

    inputs = torch.load(args.inputs, weights_only=False)
    run = legacy_engine_run(
        inputs["kw"], inputs["q"], inputs["norm_weight"], inputs["norm_bias"], inputs["spec"],
        interleaved=inputs["interleaved"],
        max_position_embeddings=inputs["max_position_embeddings"], compiled=not args.eager,
    )  # fmt: skip
    out = {
        f.name: getattr(run, f.name).cpu() if f.name != "source" else run.source
        for f in dataclasses.fields(run)
    }
    out["source"]["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    torch.save(out, args.output)
    print(run.source, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
