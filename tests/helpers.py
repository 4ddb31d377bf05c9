"""Reference computations for the tests, written independently of the package internals."""

from __future__ import annotations

import torch


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
