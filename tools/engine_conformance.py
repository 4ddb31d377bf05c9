"""Conformance of the package's engine profiles with the engines' own kernels, on the GPU.

For each model (H heads, RoPE layout) and each profile with a kernel oracle
(``dsa_precision.oracles.engine_kernels``): the engine's unmodified Triton kernels build their FP8
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
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from dsa_precision import ENGINE_PROFILES
from dsa_precision.exact_math import layer_norm_fp32_ops
from dsa_precision.oracles import engine_kernels as ek
from dsa_precision.oracles.engine_model import engine_scores, engine_select
from dsa_precision.oracles.synthetic import synthetic_indexer_inputs
from dsa_precision.preprocess import layer_norm_params
from dsa_precision.rope import apply_rope

MODELS = ((32, True), (64, False), (32, False), (64, True))  # (heads, interleaved RoPE)


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
    args = p.parse_args(argv)
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
    rows, results = [], {"env": env, "models": []}
    for heads, interleaved in MODELS[: args.models]:
        inputs = synthetic_indexer_inputs(args.seq, n_heads=heads, seed=args.seed).to(device)
        layout = "interleaved" if interleaved else "NeoX"
        for name in [*args.profiles, "vllm-exact"]:
            needs = ENGINE_PROFILES[name].rope_interleaved
            if needs is not None and needs != interleaved:  # sglang-fused: interleaved models
                continue
            try:
                rec = _record(inputs, heads, interleaved, name, args)
            except Exception as exc:  # keep measuring the others; the log has the reason
                rec = {"heads": heads, "layout": layout, "profile": name, "error": repr(exc)}
                traceback.print_exc()
                print(json.dumps(rec), flush=True)
                results["models"].append(rec)
                continue
            results["models"].append(rec)
            print(json.dumps(rec), flush=True)
            t = rec["triton"]
            rows.append(
                f"| H={heads}, {layout} | `{name}` | {t['rows_identical'] * 100:.2f} % "
                f"({t['rows_differ']}) | {t['q_differ']} / {t['q_total']} | "
                f"{t['k_differ']} / {t['k_total']} | {t['k_descale_differ']} | "
                f"{t['weights_differ']} | {rec['torch']['rows_differ']} |"
            )
        del inputs
    results["rsqrt"] = _rsqrt_check(device) if device.type == "cuda" else None
    triton_engines = {ek.ORACLE_ENGINES[p] for p in args.profiles if p in ek.ORACLE_ENGINES}
    mods = {e: ek.load_engine_kernels(e)[0] for e in triton_engines}  # PTX of the Triton kernels
    results["ptx"] = {e: _ptx_summary(m, args.out) for e, m in mods.items()}
    (args.out / "conformance.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"rsqrt": results["rsqrt"], "ptx": results["ptx"]}, indent=1))
    print(
        f"\nS={args.seq}, top-{args.topk}, seed {args.seed}; {env['gpu']}, torch {env['torch']}, "
        f"Triton {env['triton']}; engine side: the engines' kernels, package side: rope_fp32+fp8 "
        "with the profile (fused kernel; last column: torch reference), both scored by "
        f"{args.scores}\n"
    )
    print("| model | profile | rows identical (differ) | q bytes differ | k bytes differ | "
          "k scales differ | weights differ | rows differ (reference) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


def _record(inputs, heads: int, interleaved: bool, name: str, args) -> dict:
    """One model and profile: the engine kernel against the package (fused and reference)."""
    layout = "interleaved" if interleaved else "NeoX"
    t0 = time.perf_counter()
    oracle_profile = ENGINE_PROFILES["vllm" if name == "vllm-exact" else name]
    run = ek.engine_kernel_operands(inputs, oracle_profile, interleaved=interleaved)
    eng_top = engine_select(engine_scores(run.operands, kernel=args.scores), args.topk)
    profile = ENGINE_PROFILES[name]
    rec = {"heads": heads, "layout": layout, "profile": name,
           "engine_kernel": f"{oracle_profile.name}: {run.source}"}  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())
