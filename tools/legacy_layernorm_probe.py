"""Which float32 LayerNorm arithmetic Inductor's kernel for vLLM 0.28.0's compiled indexer key
has (docs/numerics.md, section 8.4): compiles the key path (``legacy_engine_run``) in a child
process per autotuner configuration (or once, ``PROBE_ONE=1``) at ``PROBE_S`` tokens, keeps
Inductor's generated code, and counts the BF16 key entries each candidate rule gets wrong
(pass-through lanes: the LayerNorm; RoPE lanes: the contraction forms).

    DSA_ENGINE_KERNELS=... PROBE_S=131072 PROBE_ONE=1 python tools/legacy_layernorm_probe.py OUTDIR

``PROBE_RUNS=0,1,2,-1``: the autotuner configurations to force, in turn (-1: Inductor's own pick).
"""

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json
import os
import shutil
import subprocess

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
    from conformance.legacy_key import legacy_engine_run
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
    runs = (-1,) if os.environ.get("PROBE_ONE") else (0, 1, 2, -1, -1, -1)
    runs = tuple(int(i) for i in os.environ.get("PROBE_RUNS", ",".join(map(str, runs))).split(","))
    for n, idx in enumerate(runs):
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
            if "def call(" in t and ("per_fused" in t or "red_fused" in t):
                shutil.copy(p, code / p.name)
        for p in (out / f"tri_{tag}").rglob("triton_*"):
            if p.suffix in (".ttgir", ".ptx", ".json") and "_fused" in p.name:
                shutil.copy(p, code / f"{p.parent.name[:6]}-{p.name}")
        shutil.rmtree(out / f"ind_{tag}", ignore_errors=True)
        shutil.rmtree(out / f"tri_{tag}", ignore_errors=True)
    analyse(out)


# (name, elements a thread holds, tree distances over the threads' partials: lanes, then warps)
PERSISTENT_PLANS = (
    ("v2-l32-w2", 2, (16, 8, 4, 2, 1, 32)),
    ("v2-w2-l32", 2, (32, 16, 8, 4, 2, 1)),
    ("v4-l32", 4, (16, 8, 4, 2, 1)),
    ("v8-l16", 8, (8, 4, 2, 1)),
    ("v8-l16-up", 8, (1, 2, 4, 8)),
    ("v16-l8", 16, (4, 2, 1)),
    ("v1-l32-w4", 1, (16, 8, 4, 2, 1, 64, 32)),
)


def _xor_tree(v, dists, first_squares=None):
    """Every entry of ``v`` (last dimension a power of two) after adding, for each distance ``d``
    in turn, the entry ``d`` away (index xor ``d``): each holds the tree's sum at the end.
    ``first_squares="fma"``: the first step is ``fma(lo, lo, fl(hi * hi))`` (lo: the lower index),
    ``True``: ``fl(lo * lo) + fl(hi * hi)``."""
    from dsa_precision.exact_math import fma_fp32

    index = torch.arange(v.shape[-1], device=v.device)
    for n, d in enumerate(dists):
        o = v[..., index ^ d]
        if n == 0 and first_squares:
            low = (index & d) == 0
            lo, hi = torch.where(low, v, o), torch.where(low, o, v)
            v = fma_fp32(lo, lo, hi * hi) if first_squares == "fma" else lo * lo + hi * hi
        else:
            v = v + o
    return v


def _plan_sum(x, v, dists, order, squares):
    """Sum over the last dimension (128): each thread's ``v`` contiguous elements in ``order``
    ("seq": in turn; "half": a tree halving the distance; "adj": a tree of adjacent pairs), then
    the threads' partials ``dists`` apart in turn. ``squares``: sum the squares; "fma": contracted
    as a compiler does (in turn ``fma(e0, e0, fl(e1 * e1))``, then ``fma(e, e, acc)``; a tree's
    first step ``fma(lo, lo, fl(hi * hi))``)."""
    from dsa_precision.exact_math import fma_fp32

    t = x.reshape(*x.shape[:-1], 128 // v, v)
    if v == 1:  # the squares' first step is the lanes' first
        return _xor_tree(t[..., 0], dists, squares)[..., :1]
    if order == "seq":
        e = [t[..., i] for i in range(v)]
        acc = e[0] * e[0] if squares else e[0]
        if squares == "fma" and v > 1:
            acc = fma_fp32(e[0], e[0], e[1] * e[1])
            e = e[1:]
        for a in e[1:]:
            if squares == "fma":
                acc = fma_fp32(a, a, acc)
            else:
                acc = acc + (a * a if squares else a)
    else:
        steps = [2**i for i in range(v.bit_length() - 1)]
        acc = _xor_tree(t, steps[::-1] if order == "half" else steps, squares)[..., 0]
    return _xor_tree(acc, dists)[..., :1]


def _two_pass(x, w, b, eps, v, dists, order, fma_squares, fma_affine):
    """Inductor's persistent LayerNorm: ``mean = sum(x) / 128``, ``var = sum(d * d) / 128``,
    ``y = fl(d * rsqrt(var + eps)) * w + b`` (``fma_affine``: one fma)."""
    from dsa_precision.exact_math import fma_fp32, rsqrt_fp32

    mean = _plan_sum(x, v, dists, order, False) / 128.0
    d = x - mean
    var = _plan_sum(d, v, dists, order, "fma" if fma_squares else True) / 128.0
    rstd = rsqrt_fp32(var + torch.tensor(eps, dtype=torch.float32, device=x.device))
    y = d * rstd
    return fma_fp32(y, w, b) if fma_affine else y * w + b


def analyse(out: Path):
    """Count the BF16 key entries each candidate gets wrong against every kept engine key."""
    import struct

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dsa_precision.exact_math import (
        fma_fp32,
        layer_norm_fp32,
        layer_norm_fp32_ops,
        layer_norm_fp32_welford,
    )

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
    for xb in (1, 8):  # the rules read from the PTX (exact_math.inductor_block_sum)
        y = layer_norm_fp32_ops(x, w, b, 1e-6, fma=True, inductor_xblock=xb)
        cands[f"RULE-inductor-x{xb}"] = y.bfloat16()[:, R:]
    # Inductor's persistent reduction: two tl.sum passes over a layout of `v` contiguous
    # elements a thread (summed in turn or as a pairwise tree), then lanes, then warps.
    for name, v, dists in PERSISTENT_PLANS:
        for order in ("seq", "half", "adj") if v > 2 else ("seq", "adj") if v == 2 else ("seq",):
            for fsq in (False, True):
                for faff in (True, False):
                    y = _two_pass(x, w, b, 1e-6, v, dists, order, fsq, faff)
                    tag = f"{name}-{order}-sq{int(fsq)}-aff{int(faff)}"
                    cands[tag] = y.bfloat16()[:, R:]
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
        results[kf.stem] = {"layernorm": sorted(res.items(), key=lambda t: t[1])[:8], "rope": pe}
        print(kf.stem, results[kf.stem], flush=True)
    (out / "analysis.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(int(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "analyse":
        analyse(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
