"""Smoke test of tilelang 0.1.15 on the GPU host (``bash tools/gpu_session.sh tilelang``).

Prints what was imported from where (tilelang, apache-tvm-ffi, the CUDA toolkit tilelang's JIT
compiles with), checks that megatron-core finds its TileLang DSA kernels, runs Megatron's TileLang
SparseMLA hook (``ops.tilelang_dsa.fused_sparse_mla_absorbed``: forward and backward, one causal
sequence, -1 in the unused slots) against a float32 reference, and checks that cuDNN's DSA
namespace (the package's FP8 scoring) still imports beside it. Exit status 1 on any failure.
"""

from __future__ import annotations

import sys
import time

import torch


def _reference(query, key, idx, scale):
    """Float32 absorbed sparse attention ``[s, b, h, 512]`` over the picks ``idx`` ``[b, s, k]``."""
    q, kv = query.float()[:, 0], key.float()[:, 0, 0]  # (s, h, 576), (s, 576)
    picks = idx[0].long()
    sel = kv[picks.clamp(min=0)]  # (s, k, 576)
    scores = torch.einsum("shd,skd->shk", q, sel) * scale
    scores = scores.masked_fill((picks < 0)[:, None, :], float("-inf"))
    return torch.einsum("shk,skd->shd", scores.softmax(-1), sel[..., :512])[:, None]


def main() -> int:
    import tilelang
    import tvm_ffi
    from tilelang import env

    print(f"tilelang {tilelang.__version__} ({tilelang.__file__})")
    print(f"apache-tvm-ffi {tvm_ffi.__version__} ({tvm_ffi.__file__})")
    print(f"CUDA_HOME {env.CUDA_HOME}; torch {torch.__version__} (CUDA {torch.version.cuda})")
    from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

    missing = _missing_tilelang_dsa_kernel_dependencies()
    print(f"megatron-core's TileLang DSA kernels: {'missing ' + str(missing) if missing else 'ok'}")
    if missing:
        return 1
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    s, h, k, scale = 1024, 16, 256, 576**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    query = (torch.randn(s, 1, h, 576, device="cuda", generator=g) / 4).bfloat16()
    key = (torch.randn(s, 1, 1, 576, device="cuda", generator=g) / 4).bfloat16()
    rows = torch.arange(s, device="cuda")[:, None]
    cols = torch.randperm(s, device="cuda", generator=g)[:k].sort().values[None, :]
    idx = torch.where(cols <= rows, cols, -1)
    idx[:, 0] = rows[:, 0]  # every row sees itself
    idx = idx.to(torch.int32)[None].contiguous()  # (b, s, k)
    query.requires_grad_()
    key.requires_grad_()
    start = time.perf_counter()
    out = tilelang_dsa.fused_sparse_mla_absorbed(query, key, idx, scale, 512)
    if out is None:
        print("fused_sparse_mla_absorbed declined the smoke test's layout")
        return 1
    grad = torch.randn_like(out)
    dq, dk = torch.autograd.grad(out, (query, key), grad)
    torch.cuda.synchronize()
    print(f"SparseMLA forward + backward (first call, JIT compile included): "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    q32, k32 = query.detach().float().requires_grad_(), key.detach().float().requires_grad_()
    ref = _reference(q32, k32, idx, scale)
    rq, rk = torch.autograd.grad(ref, (q32, k32), grad.float())
    errs = {
        name: ((a.float() - b).abs().max() / b.abs().max()).item()
        for name, a, b in (("out", out, ref), ("dq", dq, rq), ("dkv", dk, rk))
    }
    print("max rel err vs float32: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    ok = all(e < 3e-2 for e in errs.values())  # BF16 outputs and gradients
    from dsa_precision.backends import cudnn

    have_cudnn = cudnn.dsa_available()
    reason = "" if have_cudnn else f": {cudnn.dsa_unavailable_reason()}"
    print(f"cuDNN DSA namespace beside tilelang: {'ok' if have_cudnn else 'missing'}{reason}")
    print("tilelang smoke test:", "ok" if ok and have_cudnn else "FAILED")
    return 0 if ok and have_cudnn else 1


if __name__ == "__main__":
    sys.exit(main())
