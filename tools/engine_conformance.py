"""Conformance of the package's engine profiles with the engines' own kernels, on the GPU.

For each model (H heads, RoPE layout) and each profile with a kernel oracle
(``conformance.engine_kernels``): the engine's unmodified Triton kernels build their FP8
operands from the package's synthetic BF16 projections; the package builds its ``rope_fp32+fp8``
operands with the same profile (fused kernel and torch reference); bytes are compared, then both
sides are scored by DeepGEMM's ``fp8_mqa_logits`` and selected top-k (ties to the lower key) and
the rows with identical picks are counted. The old default ``vllm-exact`` is measured against
vLLM's default run for comparison. Diagnostics: vLLM's float32 keys before quantization against
the package's (both choices of the contracted lane in the variance sum), ``torch.rsqrt`` against
Triton's ``tl.rsqrt``, and the PTX the engines' kernels compiled to.

    DSA_ENGINE_KERNELS=/path/to/kernels PYTHONPATH=$PWD:/root/dg/DeepGEMM \\
        python tools/engine_conformance.py --out OUT_DIR

Prints one table (markdown) last; writes ``conformance.json`` and the PTX to ``--out``.

``--engine-triton DIR`` runs the engines' Triton kernels under another Triton release: in a child
process (this tool, ``--engine-child``) whose ``PYTHONPATH`` puts ``DIR`` (a ``pip install
--target`` of that release) first, with its own ``TRITON_CACHE_DIR``. The child builds the same
synthetic inputs (checked by their SHA-256), runs the engine kernels of each model and profile,
and writes what they built (q / k E4M3 bytes, k descales, folded weights, vLLM's float32 keys), its
``triton.__version__``, the PTX and its ``tl.rsqrt`` check to ``--out``/``engine-child``; this
process (the host's Triton, the package's fused kernel) compares and scores them as above. Every
row of the table names the release that compiled the engine's kernels. Without the flag nothing
changes: the engine kernels run here, under this process's Triton.

    PYTHONPATH=$PWD:/root/dg/DeepGEMM DSA_ENGINE_KERNELS=$PWD/.engine-kernels \\
        python tools/engine_conformance.py --engine-triton $HOME/triton38 --out OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import time
import traceback

import torch

from conformance import engine_kernels as ek
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.engine_model import EngineOperands, engine_scores, engine_select
from dsa_precision.cli.synthetic import synthetic_indexer_inputs
from dsa_precision.exact_math import layer_norm_fp32_ops
from dsa_precision.preprocess import layer_norm_params
from dsa_precision.rope import apply_rope

MODELS = ((32, True), (64, False), (32, False), (64, True))  # (heads, interleaved RoPE)
CHILD_DIR = "engine-child"  # under --out: what the --engine-triton child wrote


def _rows_identical(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    same = (a == b).all(dim=-1)
    return float(same.float().mean()), int((~same).sum())


def _swap16(x: torch.Tensor) -> torch.Tensor:
    """Lanes i and i + 16 of every 32-lane block swapped."""
    return x.reshape(*x.shape[:-1], 4, 2, 16).flip(-2).reshape(x.shape)


def _engine_lane_keys(k: torch.Tensor, interleaved: bool, rope_dim: int) -> torch.Tensor:
    """float32 keys [S, 128] in the engine's lane order (interleaved pairs back in place)."""
    if not interleaved:
        return k
    half, d = rope_dim // 2, k.shape[-1]
    lanes = torch.arange(d, device=k.device)
    order = torch.cat(
        (torch.stack((lanes[:half], lanes[half : 2 * half]), -1).flatten(), lanes[2 * half :])
    )
    return k.index_select(-1, order)


def _key_diagnostics(inputs, profile, interleaved, k_engine: torch.Tensor) -> dict:
    """vLLM's float32 keys after LayerNorm + RoPE against the package's, with the contracted
    square in the variance sum taken from the lower (lane 0) or the upper (lane 16) half."""
    w, b, eps = layer_norm_params(inputs.k_norm)
    k = inputs.k[:, 0].float()
    out = {}
    for side in ("low", "high"):
        if side == "low":
            kn = layer_norm_fp32_ops(k, w, b, eps, fma=profile.fma)
        else:
            kn = _swap16(
                layer_norm_fp32_ops(_swap16(k), _swap16(w), _swap16(b), eps, fma=profile.fma)
            )
        kr = apply_rope(
            kn[:, None, None, :], inputs.freqs, rope_interleaved=interleaved,
            table_dtype=profile.cos_sin_dtype, fma=profile.fma,
        )[:, 0, 0]  # fmt: skip
        kr = _engine_lane_keys(kr, interleaved, inputs.rope_dim)
        diff = kr.view(torch.int32) != k_engine.view(torch.int32)
        out[f"k_float_differ_{side}"] = int(diff.sum())
        out[f"k_float_rows_differ_{side}"] = int(diff.any(-1).sum())
    return out


def _rsqrt_check(device) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def rsqrt_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.rsqrt(tl.load(x_ptr + i, mask=m, other=1.0)), mask=m)

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.exp2(torch.rand(1 << 22, device=device, generator=g) * 40 - 20)
    y = torch.empty_like(x)
    rsqrt_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    exact = (1.0 / torch.sqrt(x.double())).float()
    return {
        "values": x.numel(),
        "torch_vs_triton_differ": int((torch.rsqrt(x) != y).sum()),
        "triton_vs_correctly_rounded_differ": int((y != exact).sum()),
    }


def _ptx_summary(module, out_dir: Path) -> dict:
    """The PTX of the engine kernels this process compiled, written out, and what matters."""
    summary = {}
    for name in dir(module):
        fn = getattr(module, name)
        caches = getattr(fn, "device_caches", None)
        if not caches:
            continue
        for dev, entry in caches.items():
            for i, kernel in enumerate(entry[0].values()):
                asm = getattr(kernel, "asm", {})
                ptx = asm.get("ptx")
                if not ptx:
                    continue
                (out_dir / f"{name}.{dev}.{i}.ptx").write_text(ptx)
                stores = [ln.strip() for ln in ptx.splitlines() if "st.shared" in ln]
                summary[f"{name}.{i}"] = {
                    "fma.rn.f32": ptx.count("fma.rn.f32"),
                    "rsqrt": sorted(set(re.findall(r"rsqrt\.\S+", ptx))),
                    "st.shared": stores[:6],
                }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profiles",
        nargs="+",
        default=sorted(ek.ORACLE_ENGINES),
        choices=sorted({**ek.ORACLE_ENGINES, **ek.JIT_ORACLE_ENGINES}),
    )
    p.add_argument("--out", type=Path, default=Path("conformance"))
    p.add_argument("--models", type=int, default=len(MODELS), help="the first N models")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    p.add_argument("--scores", default="deepgemm", choices=("deepgemm", "exact"))
    p.add_argument(
        "--engine-triton",
        type=Path,
        default=None,
        help="a folder holding another Triton (pip install --target): the engines' Triton "
        "kernels run in a child process with it first on PYTHONPATH",
    )
    p.add_argument("--engine-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_child is not None:
        return _child_main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    device = torch.device(args.device)
    env = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(env), flush=True)
    child = _run_child(args) if args.engine_triton is not None else None
    rows, results = [], {"env": env, "models": []}
    if child is not None:
        results["engine_child"] = {k: v for k, v in child.items() if k != "runs"}
    for heads, interleaved in MODELS[: args.models]:
        inputs = synthetic_indexer_inputs(args.seq, n_heads=heads, seed=args.seed).to(device)
        layout = "interleaved" if interleaved else "NeoX"
        for name in [*args.profiles, "vllm-exact"]:
            needs = ENGINE_PROFILES[name].rope_interleaved
            if needs is not None and needs != interleaved:  # sglang-fused: interleaved models
                continue
            try:
                rec = _record(inputs, heads, interleaved, name, args, child)
            except Exception as exc:  # keep measuring the others; the log has the reason
                rec = {"heads": heads, "layout": layout, "profile": name, "error": repr(exc),
                       "engine_compiler": _compiler(name, child, triton.__version__)}  # fmt: skip
                traceback.print_exc()
                print(json.dumps(rec), flush=True)
                results["models"].append(rec)
                continue
            results["models"].append(rec)
            print(json.dumps(rec), flush=True)
            t = rec["triton"]
            rows.append(
                f"| H={heads}, {layout} | `{name}` | {rec['engine_compiler']} | "
                f"{t['rows_identical'] * 100:.2f} % "
                f"({t['rows_differ']}) | {t['q_differ']} / {t['q_total']} | "
                f"{t['k_differ']} / {t['k_total']} | {t['k_descale_differ']} | "
                f"{t['weights_differ']} | {rec['torch']['rows_differ']} |"
            )
        del inputs
    results["rsqrt"] = _rsqrt_check(device) if device.type == "cuda" else None
    if child is not None:  # the engine kernels compiled there, by the child's Triton
        results["ptx"] = child["ptx"]
    else:
        triton_engines = {ek.ORACLE_ENGINES[p] for p in args.profiles if p in ek.ORACLE_ENGINES}
        mods = {e: ek.load_engine_kernels(e)[0] for e in triton_engines}  # PTX of their kernels
        results["ptx"] = {e: _ptx_summary(m, args.out) for e, m in mods.items()}
    (args.out / "conformance.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"rsqrt": results["rsqrt"], "ptx": results["ptx"]}, indent=1))
    print(
        f"\nS={args.seq}, top-{args.topk}, seed {args.seed}; {env['gpu']}, torch {env['torch']}, "
        f"Triton {env['triton']}; engine side: the engines' kernels (compiled by the release in "
        "the third column), package side: rope_fp32+fp8 with the profile (fused kernel, "
        f"Triton {env['triton']}; last column: torch reference), both scored by {args.scores}\n"
    )
    print("| model | profile | engine kernels compiled by | rows identical (differ) | "
          "q bytes differ | k bytes differ | k scales differ | weights differ | "
          "rows differ (reference) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


def _oracle_name(name: str) -> str:
    """The profile whose engine kernels a row runs (``vllm-exact`` is measured against vLLM)."""
    return "vllm" if name == "vllm-exact" else name


def _compiler(name: str, child: dict | None, host_triton: str) -> str:
    """Which compiler built the engine kernels of profile ``name``'s row."""
    if _oracle_name(name) in ek.JIT_ORACLE_ENGINES:
        return "nvcc (SGLang JIT)"
    if child is not None:
        return f"Triton {child['env']['triton']} (child)"
    return f"Triton {host_triton}"


def _record(inputs, heads: int, interleaved: bool, name: str, args, child=None) -> dict:
    """One model and profile: the engine kernel against the package (fused and reference);
    ``child``: what the ``--engine-triton`` child built (its Triton profiles' runs)."""
    import triton

    layout = "interleaved" if interleaved else "NeoX"
    t0 = time.perf_counter()
    oracle_profile = ENGINE_PROFILES[_oracle_name(name)]
    if child is not None and oracle_profile.name in ek.ORACLE_ENGINES:
        run = _child_run(child, inputs, interleaved, oracle_profile.name)
    else:
        run = ek.engine_kernel_operands(inputs, oracle_profile, interleaved=interleaved)
    eng_top = engine_select(engine_scores(run.operands, kernel=args.scores), args.topk)
    profile = ENGINE_PROFILES[name]
    rec = {"heads": heads, "layout": layout, "profile": name,
           "engine_kernel": f"{oracle_profile.name}: {run.source}",
           "engine_compiler": _compiler(name, child, triton.__version__)}  # fmt: skip
    built = {}
    for impl in ("triton", "torch"):
        ops = built[impl] = ek.package_operands(inputs, profile, interleaved=interleaved, impl=impl)
        diff = ek.operand_diff(ops, run.operands)
        top = engine_select(engine_scores(ops, kernel=args.scores), args.topk)
        frac, n_bad = _rows_identical(top, eng_top)
        rec[impl] = {**diff, "rows_identical": frac, "rows_differ": n_bad}
    rec["triton_vs_torch"] = ek.operand_diff(built["triton"], built["torch"])
    if run.k_float is not None and name != "vllm-exact":
        rec.update(_key_diagnostics(inputs, profile, interleaved, run.k_float))
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


# ------------------------------------------------------- the engine kernels under another Triton


def _inputs_digest(inputs) -> str:
    """SHA-256 of the BF16 projections (q, k, head weights, k_norm weight and bias)."""
    h = hashlib.sha256()
    for t in (inputs.q, inputs.k, inputs.w, inputs.k_norm.weight, inputs.k_norm.bias):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_key(heads: int, interleaved: bool, profile: str) -> str:
    return f"H{heads}-{'interleaved' if interleaved else 'neox'}-{profile}"


def _child_profiles(profiles: list[str]) -> list[str]:
    """The Triton profiles whose engine kernels the child runs (``vllm`` always: ``vllm-exact``
    is measured against it)."""
    return sorted({"vllm", *(p for p in profiles if p in ek.ORACLE_ENGINES)})


def _run_child(args) -> dict:
    """Runs this tool as ``--engine-child`` with ``args.engine_triton`` first on PYTHONPATH;
    returns its ``child.json`` (``env``, ``ptx``, ``rsqrt``, ``runs``: key -> file) with ``dir``."""
    out = (args.out / CHILD_DIR).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    paths = [os.path.abspath(args.engine_triton), str(repo), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")  # compiled fresh, by the child's Triton
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-child", str(out),
           "--seq", str(args.seq), "--seed", str(args.seed), "--models", str(args.models),
           "--device", args.device, "--profiles", *_child_profiles(args.profiles)]  # fmt: skip
    print(json.dumps({"engine_child": cmd, "PYTHONPATH": env["PYTHONPATH"]}), flush=True)
    subprocess.run(cmd, env=env, check=True)
    child = json.loads((out / "child.json").read_text())
    where = Path(child["env"]["triton_file"])  # as imported (a link in DIR stays in DIR)
    if not where.is_relative_to(Path(os.path.abspath(args.engine_triton))):
        raise RuntimeError(
            f"the engine child imported triton {child['env']['triton']} from {where}, not from "
            f"--engine-triton {args.engine_triton}."
        )
    child["dir"] = str(out)
    return child


def _child_run(child: dict, inputs, interleaved: bool, profile: str) -> ek.EngineKernelRun:
    """The engine kernel run the child wrote, on the inputs' device."""
    key = _run_key(inputs.n_heads, interleaved, profile)
    if key not in child["runs"]:
        raise RuntimeError(f"the engine child wrote no run {key}: {sorted(child['runs'])}.")
    saved = torch.load(Path(child["dir"]) / child["runs"][key], weights_only=True)
    digest = _inputs_digest(inputs)
    if saved["inputs_sha256"] != digest:
        raise RuntimeError(
            f"run {key}: the child's inputs (sha256 {saved['inputs_sha256'][:12]}) are not "
            f"these ({digest[:12]})."
        )
    dev = inputs.q.device
    ops = EngineOperands(*(saved[n].to(dev) for n in ("q", "k", "k_descale", "weights")))
    k_float = saved["k_float"].to(dev) if saved["k_float"] is not None else None
    return ek.EngineKernelRun(ops, saved["engine"], saved["source"], k_float)


def _child_main(args) -> int:
    """``--engine-child DIR``: the engine kernels of ``args.profiles`` under this interpreter's
    Triton, their operands written to ``DIR`` (one ``.pt`` a model and profile) with
    ``child.json``."""
    import triton

    out = args.engine_child
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    env = {
        "triton": triton.__version__,
        "triton_file": os.path.abspath(triton.__file__),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    print(json.dumps({"engine_child": env}), flush=True)
    runs = {}
    for heads, interleaved in MODELS[: args.models]:
        inputs = synthetic_indexer_inputs(args.seq, n_heads=heads, seed=args.seed).to(device)
        digest = _inputs_digest(inputs)
        for name in args.profiles:
            run = ek.engine_kernel_operands(inputs, ENGINE_PROFILES[name], interleaved=interleaved)
            key = _run_key(heads, interleaved, name)
            o = run.operands
            # Copies: vLLM's k bytes and descales are views of one cache buffer.
            saved = {n: getattr(o, n).cpu().clone() for n in ("q", "k", "k_descale", "weights")}
            saved["k_float"] = run.k_float.cpu().clone() if run.k_float is not None else None
            saved.update(engine=run.engine, source=run.source, inputs_sha256=digest)
            saved["triton"] = triton.__version__
            torch.save(saved, out / f"{key}.pt")
            runs[key] = f"{key}.pt"
        del inputs
    engines = {ek.ORACLE_ENGINES[p] for p in args.profiles}
    ptx = {e: _ptx_summary(ek.load_engine_kernels(e)[0], out) for e in engines}
    rsqrt = _rsqrt_check(device) if device.type == "cuda" else None
    summary = {"env": env, "ptx": ptx, "rsqrt": rsqrt, "runs": runs}
    (out / "child.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
