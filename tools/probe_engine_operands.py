"""Which FP8 operands differ between the demo's engine model and the package, per device (probe).

    python tools/probe_engine_operands.py [--engine sglang-fused --rope-interleaved] [--seq 2048]

Builds one sequence's operands four ways -- the engine model (``cli/engine_model.py``) on the CPU
and on CUDA, the package's torch reference and fused Triton kernel on CUDA -- and prints, for each
tensor, the share of elements whose bits differ from the engine model on the CPU (the exact
contract), and the same with each FP8 vector's codes sorted: a difference only in the first is
one of lane order, which the exact score ignores but the FP8 tensor cores' accumulation does not. A tensor that changes with the device points at an operation whose CUDA arithmetic
differs from the CPU's.
"""

import argparse

import torch

from dsa_precision import ENGINE_PROFILES, IndexerPrecisionConfig
from dsa_precision.cli.demo_operands import IndexerFields, training_operands
from dsa_precision.cli.engine_model import engine_operands
from dsa_precision.cli.synthetic import synthetic_indexer_inputs


def _package(inputs, engine, interleaved, hadamard, impl):
    """The demo's training side (rope_fp32+fp8), by ``impl`` (the fused kernel or the reference)."""
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine=engine)
    model = IndexerFields(hadamard=hadamard, rope_interleaved=interleaved)
    ops = training_operands(inputs, config, model, impl=impl)
    return dict(q=ops.q[0], k=ops.k[0], k_descale=ops.k_descale[0], weights=ops.weights[0])


def _engine(inputs, engine, interleaved, hadamard):
    ops = engine_operands(inputs, engine, hadamard=hadamard, interleaved=interleaved)
    return dict(q=ops.q, k=ops.k, k_descale=ops.k_descale, weights=ops.weights)


def _bits(t: torch.Tensor, sort: bool) -> torch.Tensor:
    """The bit patterns; ``sort``: each FP8 vector's codes sorted, which ignores the lane order."""
    t = t.cpu().contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8).sort(-1).values if sort else t.view(torch.uint8)
    return t.view(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="sglang-fused")
    p.add_argument("--rope-interleaved", action="store_true")
    p.add_argument("--hadamard", action="store_true")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    a = p.parse_args()
    engine = ENGINE_PROFILES[a.engine]
    inputs = synthetic_indexer_inputs(a.seq, n_heads=a.heads, head_dim=128, rope_dim=64, seed=0)
    ways = {"engine cpu": _engine(inputs, engine, a.rope_interleaved, a.hadamard)}
    cuda = inputs.to("cuda")
    ways["engine cuda"] = _engine(cuda, engine, a.rope_interleaved, a.hadamard)
    ways["package cpu"] = _package(inputs, engine, a.rope_interleaved, a.hadamard, "torch")
    for impl in ("torch", "triton"):
        ways[f"package cuda {impl}"] = _package(cuda, engine, a.rope_interleaved, a.hadamard, impl)
    ref = ways["engine cpu"]
    print(
        f"{a.engine}, S={a.seq}, H={a.heads}: share of elements whose bits differ from engine cpu"
    )
    print(f"{'':22}" + "".join(f"{name:>12}" for name in ref))
    for way, ops in ways.items():
        row = [float((_bits(ops[n]) != _bits(ref[n])).double().mean()) for n in ref]
        print(f"{way:22}" + "".join(f"{x:12.3e}" for x in row))


if __name__ == "__main__":
    main()
