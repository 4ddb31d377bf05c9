"""Reference computations for the tests, written independently of the package internals."""

from __future__ import annotations

import contextlib
import importlib
import math
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dsa_precision import quantize_e4m3_ue8m0
from dsa_precision.backends import deepgemm as _deepgemm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def import_example(name: str) -> ModuleType:
    """A module of ``examples/`` (the examples import their neighbours by name, so the folder
    goes on the import path once)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` over the finite entries, after checking the ``-inf`` patterns match."""
    fin_a, fin_e = torch.isfinite(actual), torch.isfinite(expected)
    assert torch.equal(fin_a, fin_e), "finite / -inf patterns differ"
    assert torch.equal(actual[~fin_a], expected[~fin_e]), "non-finite values differ"
    if not fin_e.any():
        return 0.0
    a, e = actual[fin_a].double(), expected[fin_e].double()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-300))


def causal_limit(offset: int, s: int, ratio: int, sk: int) -> int:
    return min((offset + s + 1) // ratio, sk)


def contract_scores_f64(
    q_vals, k_vals, w_vals, *, post_scale, key_scale=None, offsets=None, ratio=1
):
    """float64 ``[B, Sq, Sk]``: ``post_scale * (key_scale[t]) * sum_h relu(q . k) * w`` with the
    top-left causal mask, from already-rounded operand values (float64 tensors)."""
    b, sq = q_vals.shape[:2]
    sk = k_vals.shape[1]
    dots = torch.einsum("bshd,btd->bsht", q_vals.double(), k_vals.double())
    s = (dots.clamp_min(0) * w_vals.double().unsqueeze(-1)).sum(2) * post_scale
    if key_scale is not None:
        s = s * key_scale.double().unsqueeze(1)
    offsets = [0] * b if offsets is None else list(offsets)
    for bi in range(b):
        for si in range(sq):
            s[bi, si, causal_limit(offsets[bi], si, ratio, sk) :] = float("-inf")
    return s


def calc_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """DeepGEMM's scale-free difference ``1 - 2 sum(a b) / sum(a^2 + b^2)`` over finite entries."""
    fin = torch.isfinite(expected)
    a, e = actual[fin].double(), expected[fin].double()
    denom = (a * a + e * e).sum()
    return float(1 - 2 * (a * e).sum() / denom) if denom > 0 else 0.0


# Hopper's FP8 tensor cores keep ~13 bits when they align and sum E4M3 products, so cuDNN's FP8
# scores differ from an exact-accumulation reference by up to ~2**-12 of the largest score
# (measured: 2.3e-4 to 2.8e-4). BF16 operands accumulate at full FP32 precision (~2e-7).
MAX_REL_ERR = {"bf16": 1e-5, "fp8": 1e-3}
CALC_DIFF_MAX = 1e-5


# ------------------------------------------------------------------ contracts of the scoring API


def bf16_contract(q, k, w, *, sm_scale=1.0, offsets=None, ratio=1):
    """float64 ``[B, Sq, Sk]`` of BF16 scoring from carriers: q and k rounded to BF16 (k may be
    ``[B, Sk, 1, D]``), the head weights as given, ``sm_scale`` applied once at the end."""
    k = k.reshape(k.shape[0], k.shape[1], -1)
    return contract_scores_f64(
        q.to(torch.bfloat16).double(),
        k.to(torch.bfloat16).double(),
        w.double(),
        post_scale=sm_scale,
        offsets=offsets,
        ratio=ratio,
    )


def fp8_contract(q, k, w, *, sm_scale=1.0, offsets=None, ratio=1):
    """float64 ``[B, Sq, Sk]`` of FP8 scoring from carriers under the default engine: q and k
    quantized per 128-vector (exact UE8M0 descales, floor 1e-4), the q descale and ``sm_scale``
    folded into the head weights, the k descale applied per key."""

    k = k.reshape(k.shape[0], k.shape[1], -1)
    q8, qs = quantize_e4m3_ue8m0(q)
    k8, ks = quantize_e4m3_ue8m0(k)
    w_fold = w.double() * qs.double() * sm_scale
    return contract_scores_f64(
        q8.double(), k8.double(), w_fold, post_scale=1.0, key_scale=ks, offsets=offsets, ratio=ratio
    )


CONTRACTS = {"bf16": bf16_contract, "fp8": fp8_contract}


def reference_topk(row: list[float], k: int, seq_len: int) -> list[int]:
    """The top-k rule for one row, in plain Python: among keys ``< seq_len`` whose score is
    neither ``-inf`` nor NaN, the ``k`` largest, ties toward the lower index, ``+0.0`` above
    ``-0.0``; returned ascending and padded with ``-1`` to ``k``."""
    cand = [(v, i) for i, v in enumerate(row[:seq_len]) if v != -math.inf and not math.isnan(v)]
    cand.sort(key=lambda vi: (-vi[0], -math.copysign(1.0, vi[0]), vi[1]))
    picked = sorted(i for _, i in cand[:k])
    return picked + [-1] * (k - len(picked))


def reference_topk_rows(scores: torch.Tensor, k: int, seq_lens=None) -> list[list[int]]:
    """:func:`reference_topk` of every row of ``scores`` (``seq_lens`` of shape ``scores.shape[:-1]``)."""
    flat = scores.reshape(-1, scores.shape[-1]).tolist()
    lens = [scores.shape[-1]] * len(flat) if seq_lens is None else seq_lens.reshape(-1).tolist()
    return [reference_topk(r, k, n) for r, n in zip(flat, lens, strict=True)]


def cu_seqlens(lens, dtype=torch.int32) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` cumulative lengths."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def causal_counts(offset: int, rows: range, ratio: int, sk: int) -> list[int]:
    """Visible keys ``min(floor((offset + s + 1) / ratio), sk)`` of each query row ``s``."""
    return [max(0, causal_limit(offset, s, ratio, sk)) for s in rows]


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view with ``t``'s exact bit pattern (for bitwise comparisons, NaN included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.detach().contiguous()
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    )
    diff = bits(a) != bits(b)
    if diff.any():
        first = tuple(int(i) for i in diff.nonzero()[0])
        raise AssertionError(f"{what}: first difference at {first}: {a[first]} vs {b[first]}")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 number of float32 steps between ``a`` and ``b`` (finite values; across zero it
    counts the steps on both sides, ``+0`` and ``-0`` being the same point)."""

    def ordered(x):
        bits = x.float().contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (ordered(a) - ordered(b)).abs()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Run the block with CUDA's synchronisation debug mode at ``"error"``: a host
    synchronisation inside it raises. The device is synchronised first, so that earlier work
    (warm-ups, compilation) cannot count."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def exact_hadamard_like_fast_hadamard(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Stand-in for the CUDA-only fast_hadamard_transform (absent here): a dense float64
    Sylvester product, rounded once to the input dtype."""
    h = sylvester(x.shape[-1])
    return ((x.double() @ h) * scale).to(x.dtype)


def scoring_carriers(b=2, sq=5, sk=7, h=32, dtype=torch.float32, w_dtype=torch.bfloat16):
    """``(q (b, sq, h, 128), k (b, sk, 128), weights (b, sq, h))`` carriers, seeded."""
    g = torch.Generator().manual_seed(11)
    # Magnitudes spanning ~2**-8 .. 2**6 across lanes, so the descales differ per vector.
    lanes = torch.logspace(-8, 6, 128, base=2.0)
    q = (torch.randn(b, sq, h, 128, generator=g) * lanes[torch.randperm(128, generator=g)]).to(
        dtype
    )
    k = (torch.randn(b, sk, 128, generator=g) * lanes).to(dtype)
    w = (torch.randn(b, sq, h, generator=g) * 0.02).to(w_dtype)
    return q, k, w


def indexer_projections(s=6, b=2, h=32, rope_fp32=True, dtype=torch.bfloat16):
    """``(IndexerPreprocess, q [s, b, h, 128], k [s, b, 128], w [s, b, h], freqs)``, seeded."""
    from dsa_precision import IndexerPreprocess

    g = torch.Generator().manual_seed(5)
    pre = IndexerPreprocess(128, 64, rope_fp32=rope_fp32)
    q = torch.randn(s, b, h, 128, generator=g).to(dtype)
    k = torch.randn(s, b, 128, generator=g).to(dtype)
    w = torch.randn(s, b, h, generator=g).to(dtype)
    freqs = torch.rand(s, 1, 1, 64, generator=g) * 10
    return pre, q, k, w, freqs


# GPU tests of the DeepGEMM paths: skipped, with the import errors, where it does not import.
needs_deepgemm = pytest.mark.skipif(
    not _deepgemm._deepgemm_available(), reason=str(_deepgemm._unavailable_reason())
)
