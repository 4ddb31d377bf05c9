"""Probe: how does cuDNN's SM90 FP8 indexer kernel accumulate q . k? (device-only experiment)

Feeds exact E4M3 operands with unit descales and one active head (weight 1), so each score is
relu(acc) of the hardware accumulation, and compares it with candidate models of the Hopper FP8
WGMMA accumulator: products exact, blocks of n products (plus the running accumulator) aligned to
the largest exponent and truncated to F fraction bits, the block sum rounded to FP32.
"""

import itertools
import json
import os

import torch
from cudnn import DSA

torch.manual_seed(0)
dev = "cuda"
SQ, SK, H = 256, 256, 32


def rand_e4m3(shape, spread):
    # sign * (1 + m/8) * 2**e with e in [-spread, 0]: exercise the alignment shifts.
    m = torch.randint(0, 8, shape, device=dev).float()
    e = torch.randint(-spread, 1, shape, device=dev).float()
    s = torch.where(torch.rand(shape, device=dev) < 0.35, -1.0, 1.0)
    return (s * (1 + m / 8) * torch.exp2(e)).to(torch.float8_e4m3fn)


def run_kernel(q8, k8):
    q = torch.zeros(1, SQ, H, 128, device=dev, dtype=torch.float8_e4m3fn)
    q[0, :, 0] = q8
    k = k8.view(1, SK, 1, 128).contiguous()
    w = torch.zeros(1, SQ, H, device=dev)
    w[..., 0] = 1.0
    qs = torch.ones(1, SQ, H, device=dev)
    ks = torch.ones(1, SK, 1, device=dev)
    off = torch.full((1,), SK, dtype=torch.int32, device=dev)
    return DSA.indexer_forward_wrapper(
        q,
        k,
        w,
        ratio=1,
        sm_scale=1.0,
        q_causal_offsets=off,
        precision="fp8",
        q_scale=qs,
        k_scale=ks,
    )["scores"][0]


def exponent(x):
    _, e = torch.frexp(x.abs())
    return (e - 1).to(torch.float64)


def model(prod, n, frac_bits, acc_aligned, rz_final):
    acc = torch.zeros(prod.shape[:-1], dtype=torch.float64, device=dev)
    for b0 in range(0, 128, n):
        terms = prod[..., b0 : b0 + n]
        allt = torch.cat([acc.unsqueeze(-1), terms], -1) if acc_aligned else terms
        mx = allt.abs().amax(-1)
        emax = torch.where(mx > 0, exponent(mx), torch.zeros_like(mx))
        ulp = torch.exp2(emax - frac_bits).unsqueeze(-1)
        tt = torch.trunc(terms / ulp) * ulp
        if acc_aligned:
            acc_t = torch.trunc(acc / ulp[..., 0]) * ulp[..., 0]
        else:
            acc_t = acc
        s = acc_t + tt.sum(-1)  # exact: all multiples of ulp, few terms
        f = s.float().double()
        if rz_final:
            over = f.abs() > s.abs()
            f = torch.where(
                over, torch.nextafter(s.float(), torch.zeros_like(s.float())).double(), f
            )
        acc = f
    return acc


results = []
for spread in (3, 8):
    q8 = rand_e4m3((SQ, 128), spread)
    k8 = rand_e4m3((SK, 128), spread)
    hw = run_kernel(q8, k8).double()
    prod = q8.double().unsqueeze(1) * k8.double().unsqueeze(0)  # [SQ, SK, 128] exact
    exact = prod.sum(-1)
    pos = exact > 0
    err_exact = float(((hw - exact.clamp_min(0)).abs()[pos] / exact[pos]).max())
    best = []
    for n, fb, acc_al, rz in itertools.product(
        (4, 8, 16, 32, 64, 128), range(10, 26), (True, False), (True, False)
    ):
        m = model(prod, n, fb, acc_al, rz).clamp_min(0)
        match = float((m == hw)[pos].double().mean())
        rel = float(((m - hw).abs()[pos] / exact[pos]).max())
        best.append((match, -rel, dict(n=n, frac_bits=fb, acc_aligned=acc_al, rz_final=rz)))
    best.sort(key=lambda t: (t[0], t[1]), reverse=True)
    results.append(
        dict(spread=spread, exact_rel_err=err_exact, top=[(b[0], -b[1], b[2]) for b in best[:8]])
    )
    print(json.dumps(results[-1]))
with open(os.path.join(os.environ.get("OUT", "."), "fp8_probe.json"), "w") as f:
    json.dump(results, f, indent=1)
