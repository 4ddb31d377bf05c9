"""Which float32 LayerNorm arithmetic Inductor's kernel for vLLM 0.28.0's compiled indexer key
has (docs/numerics.md, section 8.4): compiles the key path (``legacy_engine_run``) in a child
process per autotuner configuration (or once, ``PROBE_ONE=1``) at ``PROBE_S`` tokens, keeps
Inductor's generated code, and counts the BF16 key entries each candidate rule gets wrong
(pass-through lanes: the LayerNorm; RoPE lanes: the contraction forms).

    DSA_ENGINE_KERNELS=... PROBE_S=131072 PROBE_ONE=1 python tools/legacy_layernorm_probe.py OUTDIR
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
S, D, H, R = int(os.environ.get("PROBE_S", 131072)), 128, 32, 64


def child(idx: int, out: Path):
    from torch._inductor.runtime import triton_heuristics as th

    chosen = {}
    orig = th.CachingAutotuner.benchmark_all_configs

    def forced(self, *a, **k):
        timings = orig(self, *a, **k)
        name = self.fn.__name__
        cfgs = [str(launcher.config) for launcher in self.launchers]
        t = {str(launcher.config): v for launcher, v in timings.items()}
        if idx < 0:
            chosen[name] = dict(configs=cfgs, timings=t)
            return timings
        pick = min(idx, len(self.launchers) - 1)
        chosen[name] = dict(configs=cfgs, timings=t, forced=cfgs[pick])
        return {launcher: (0.0 if i == pick else 1.0) for i, launcher in enumerate(self.launchers)}

    th.CachingAutotuner.benchmark_all_configs = forced
    orig_a = th.CachingAutotuner.autotune_to_one_config

    def a2o(self, *a, **k):
        r = orig_a(self, *a, **k)
        chosen.setdefault(self.fn.__name__, {})["kept"] = str(self.launchers[0].config)
        return r

    th.CachingAutotuner.autotune_to_one_config = a2o
    from dsa_precision.oracles.legacy_key import legacy_engine_run
    from dsa_precision.rope import RopeSpec

    d = torch.load(out / "inputs.pt")
    run = legacy_engine_run(
        *(d[n].to(DEV) for n in ("kw", "q", "w", "b")),
        RopeSpec(R, 1e6),
        interleaved=True,
        max_position_embeddings=S,
    )
    torch.save(run.k.cpu(), out / f"k_{idx}.pt")
    torch.save(run.cos_sin_cache.cpu(), out / "cache.pt")
    (out / f"chosen_{idx}.json").write_text(json.dumps(chosen, indent=1))
    print(json.dumps(chosen))


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    k = (
        torch.randn(S, D, generator=g) * (0.5 + torch.rand(S, 1, generator=g))
        + torch.randn(S, 1, generator=g) * 0.3
    )
    kw = torch.cat((k, torch.randn(S, H, generator=g)), 1).bfloat16()
    q = torch.randn(S, H, D, generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(D, generator=g)).bfloat16().float()
    b = (0.2 * torch.randn(D, generator=g)).bfloat16().float()
    torch.save(dict(kw=kw, q=q, w=w, b=b), out / "inputs.pt")
    for n, idx in enumerate((-1,) if os.environ.get("PROBE_ONE") else (0, 1, 2, -1, -1, -1)):
        tag = f"{idx}" if idx >= 0 else f"auto{n}"
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=str(out / f"ind_{tag}"),
            TRITON_CACHE_DIR=str(out / f"tri_{tag}"),
        )
        r = subprocess.run(
            [sys.executable, __file__, "child", str(idx), str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        print(tag, r.returncode, r.stdout[-3000:], r.stderr[-3000:] if r.returncode else "")
        if idx < 0:
            shutil.copy(out / "chosen_-1.json", out / f"chosen_{tag}.json")
            shutil.copy(out / "k_-1.pt", out / f"k_{tag}.pt")
        code = out / f"code_{tag}"
        code.mkdir(exist_ok=True)
        for p in (out / f"ind_{tag}").rglob("*.py"):
            t = p.read_text(errors="replace")
            if "def call(" in t and "per_fused" in t:
                shutil.copy(p, code / p.name)
        for p in (out / f"tri_{tag}").rglob("triton_*"):
            if p.suffix in (".ttgir", ".ptx", ".json") and "per_fused" in p.name:
                shutil.copy(p, code / f"{p.parent.name[:6]}-{p.name}")
        shutil.rmtree(out / f"ind_{tag}", ignore_errors=True)
        shutil.rmtree(out / f"tri_{tag}", ignore_errors=True)
    analyse(out)


def analyse(out: Path):
    """Count the BF16 key entries each candidate gets wrong against every kept engine key."""
    import struct

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dsa_precision.exact_math import fma_fp32, layer_norm_fp32, layer_norm_fp32_welford

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.load(out / "inputs.pt")
    x = d["kw"][:, :D].float().to(dev)
    w, b = d["w"].to(dev), d["b"].to(dev)
    cands = {}
    for bits in (0x3EAAAAAB, 0x3EAAAAAA):  # div.full(1, 3) and its neighbour
        third = struct.unpack("f", struct.pack("I", bits))[0]
        for fma in (True, False):
            y = layer_norm_fp32_welford(x, w, b, 1e-6, fma=fma, one_third=third)
            cands[f"welford-{bits:x}-fma{int(fma)}"] = y.bfloat16()[:, R:]
    cands["float64"] = layer_norm_fp32(x, w, b, 1e-6).bfloat16()[:, R:]
    if dev == "cuda":
        import triton
        import triton.language as tl

        @triton.jit
        def _div(a_ptr, b_ptr, o_ptr):
            tl.store(o_ptr, tl.load(a_ptr) / tl.load(b_ptr))

        o = torch.empty(1, device=dev)
        _div[(1,)](torch.ones(1, device=dev), torch.full((1,), 3.0, device=dev), o)
        print("triton 1/3 bits", hex(o.view(torch.int32).item()), flush=True)
    ln = layer_norm_fp32_welford(x, w, b, 1e-6, fma=True).bfloat16().float()
    cache = torch.load(out / "cache.pt").float().to(dev)
    c, sn = cache[:, : R // 2], cache[:, R // 2 :]
    x1, x2 = ln[:, 0:R:2], ln[:, 1:R:2]

    def il(o1, o2):
        return torch.stack((o1, o2), -1).flatten(1).bfloat16()

    rope = {
        "rope-cos": il(fma_fp32(x1, c, -(x2 * sn)), fma_fp32(x2, c, x1 * sn)),
        "rope-sin": il(fma_fp32(-x2, sn, x1 * c), fma_fp32(x1, sn, x2 * c)),
        "rope-nofma": il(x1 * c - x2 * sn, x2 * c + x1 * sn),
    }
    results = {}
    for kf in sorted(out.glob("k_*.pt")):
        if kf.name == "k_-1.pt":
            continue
        k = torch.load(kf).to(dev)
        pe = {
            n: int((r.view(torch.int16) != k[:, :R].view(torch.int16)).sum())
            for n, r in rope.items()
        }
        res = {
            n: int((c.view(torch.int16) != k[:, R:].view(torch.int16)).sum())
            for n, c in cands.items()
        }
        results[kf.stem] = {"layernorm": sorted(res.items(), key=lambda t: t[1]), "rope": pe}
        print(kf.stem, results[kf.stem], flush=True)
    (out / "analysis.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(int(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "analyse":
        analyse(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
