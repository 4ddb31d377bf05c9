"""The engines' Triton indexer kernels compiled ahead of time for Hopper, without a GPU.

Runs the engines' own launch code (``conformance.engine_kernels``: vLLM 0.33's
``fused_norm_rope`` / ``fused_q``, LMDeploy 0.18's ``prepare_dsa_indexer_{q,k_cache}``; with
``--profiles vllm-legacy`` vLLM 0.28's ``fused_indexer_q_rope_quant``, ``.legacy_q``; unmodified
from ``DSA_ENGINE_KERNELS``) on CPU tensors with a stand-in driver that answers ``sm_90`` (Triton
compiles capability 90 for ``sm_90a``) and turns every launch into a warm-up: each kernel is
specialised exactly as its launch specialises it (signature, constexprs, divisibility of the
pointers and integers, ``num_warps``, ``enable_fp_fusion``) and compiled by the Triton this
interpreter imports, never run (the engine's outputs stay unwritten). Writes the PTX, the cubin and,
where ``cuobjdump`` is on ``PATH``, its SASS to ``--out``, with ``aot.json`` (Triton release, the
engine files' release, each kernel's options and a few instruction counts).

    DSA_ENGINE_KERNELS=$PWD/.engine-kernels PATH=/path/to/cuda/bin:$PATH \\
        python tools/engine_kernels_aot.py --out /tmp/aot38

docs/numerics.md, section 8.11, has what the SASS of Triton 3.8 shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import torch

from conformance import engine_kernels as ek
from conformance import legacy_q
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.synthetic import synthetic_indexer_inputs

# (heads, interleaved RoPE): GLM-5-like, DeepSeek-V3.2-like.
MODELS = ((32, True), (64, False))


class _CompileOnlyDriver:
    """Triton's active driver for compiling: a Hopper target, device 0, no stream, no launches."""

    def __init__(self, capability: int = 90, warp_size: int = 32) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(captured: list) -> Iterator[None]:
    """Every ``kernel[grid](...)`` inside compiles (appending ``(name, CompiledKernel)`` to
    ``captured``) and launches nothing."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter compiles nothing")

    def warm(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        captured.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active  # no GPU here: the default driver cannot be created
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = warm
    try:
        yield
    finally:
        JITFunction.run = run
        driver._active = previous


def _counts(sass: str) -> dict[str, int]:
    ops = ("FFMA", "FMUL", "FADD", "SHFL.BFLY", "MUFU.RSQ", "STS", "LDS", "BAR.SYNC", "S2R")
    return {op: len(re.findall(rf"\b{re.escape(op)}\b", sass)) for op in ops}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens (the launch's integer arguments)")
    p.add_argument("--profiles", nargs="+", default=["vllm", "vllm-eager", "lmdeploy"],
                   choices=[*sorted(ek.ORACLE_ENGINES), "vllm-legacy"])  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("aot"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    cuobjdump = shutil.which("cuobjdump")
    summary: dict = {"triton": triton.__version__, "target": "cuda 90 (sm_90a)", "kernels": {}}
    for heads, interleaved in MODELS:
        inputs = synthetic_indexer_inputs(args.seq, n_heads=heads, seed=0)
        layout = "interleaved" if interleaved else "neox"
        for name in args.profiles:
            captured: list = []
            profile = ENGINE_PROFILES[name]
            with compile_only(captured):
                if name == "vllm-legacy":  # vLLM 0.28's query kernel (its key kernel is CUDA)
                    keys = ek.package_operands(
                        inputs, profile, interleaved=interleaved, impl="torch"
                    )
                    _, source = legacy_q.legacy_q_operands(
                        inputs, profile, keys, interleaved=interleaved
                    )
                    summary["source_vllm-legacy-q"] = source
                else:
                    run = ek.engine_kernel_operands(inputs, profile, interleaved=interleaved)
                    summary["source_" + run.engine] = run.source
            for kname, kernel in captured:
                tag = f"{name}.H{heads}.{layout}.{kname}"
                (args.out / f"{tag}.ptx").write_text(kernel.asm["ptx"])
                (args.out / f"{tag}.cubin").write_bytes(kernel.asm["cubin"])
                rec = {
                    "num_warps": kernel.metadata.num_warps,
                    "enable_fp_fusion": kernel.metadata.enable_fp_fusion,
                    "arch": kernel.metadata.arch,
                    "fma.rn.f32 (ptx)": kernel.asm["ptx"].count("fma.rn.f32"),
                }
                if cuobjdump:
                    sass = subprocess.run(
                        [cuobjdump, "-sass", str(args.out / f"{tag}.cubin")],
                        check=True, capture_output=True, text=True,
                    ).stdout  # fmt: skip
                    (args.out / f"{tag}.sass").write_text(sass)
                    rec.update(_counts(sass))
                summary["kernels"][tag] = rec
    (args.out / "aot.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
