"""An independent model of an engine's FP8 indexer (the inference side of the comparisons where the
engine's own kernels do not run: :func:`conformance.inference.inference_operands` decides).

Written from the engines' sources (``docs/numerics.md``) and an :class:`~dsa_precision.EngineProfile`
(facts only), it shares no preprocessing, quantization or scoring code with the package: RoPE
rotates the engine's (cos, sin) pairs in place, the Hadamard transform is a dense Sylvester matrix,
the FP8 scales follow each rule's formula in float64 / float32 torch arithmetic, and the scores are
an exact float64 sum of E4M3 products rounded once to float32 (or, on CUDA, DeepGEMM's
MQA logits -- the engines' own kernel -- on the model's operands). Where an engine's
arithmetic is float32 (RoPE, its ratio and scaling), the model uses IEEE float32 operations with
no fused multiply-add; where it is a reduction whose order is the engine's kernel's (LayerNorm
statistics), the model is exact.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engines import EngineProfile
from .synthetic import SyntheticIndexerInputs

__all__ = ["MODEL_SOURCE", "EngineOperands", "engine_operands", "engine_scores", "engine_select"]

MODEL_SOURCE = "an independent model of its operands (dsa_precision.cli.engine_model)"


@dataclasses.dataclass(frozen=True)
class EngineOperands:
    """One sequence's FP8 operands as the engine builds them."""

    q: torch.Tensor  # (S, H, D) float8_e4m3fn
    k: torch.Tensor  # (S, D) float8_e4m3fn
    k_descale: torch.Tensor  # (S,) float32
    weights: torch.Tensor  # (S, H) float32, q descale folded in


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float32)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dtype, interleaved: bool):
    """Rotate (even, odd) pairs (interleaved) or (i, i + half) pairs (NeoX) of the first lanes, in
    place of the pair; products and differences in ``rope_dtype``."""
    half = cos.shape[-1]
    y = x.clone()
    if interleaved:
        i0 = torch.arange(0, 2 * half, 2, device=x.device)
        i1 = i0 + 1
    else:
        i0 = torch.arange(half, device=x.device)
        i1 = i0 + half
    a, b = x[..., i0].to(rope_dtype), x[..., i1].to(rope_dtype)
    c, s = cos.to(rope_dtype), sin.to(rope_dtype)
    y[..., i0] = (a * c - b * s).to(torch.float32)
    y[..., i1] = (b * c + a * s).to(torch.float32)
    return y


def _sylvester(n: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * n**-0.5


def _descale(amax: torch.Tensor, rule) -> torch.Tensor:
    """The rule's descale from float32 amax values (docs/numerics.md, "Quantization")."""
    a = torch.maximum(amax, torch.tensor(rule.amax_floor, dtype=torch.float32, device=amax.device))
    a64 = a.double()
    if rule.scale_ratio == "exact":  # the smallest power of two s with a <= 448 s
        e = torch.ceil(torch.log2(a64 / 448.0))
        e = torch.where(a64 <= 448.0 * torch.exp2(e - 1), e - 1, e)
        e = torch.where(a64 > 448.0 * torch.exp2(e), e + 1, e)
        return torch.exp2(e).float()
    if rule.scale_ratio == "divide":
        r = a / torch.tensor(448.0, device=a.device)
    else:
        r = a * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=a.device)
    if rule.scale_format == "fp32":
        return r
    if rule.ue8m0_ceil == "bits":
        m, e = torch.frexp(r.double())
        return torch.exp2(torch.where(m == 0.5, e - 1, e).double()).float()
    return torch.exp2(torch.ceil(torch.log2(r.double()).float().double())).float()


def _quantize(x: torch.Tensor, rule) -> tuple[torch.Tensor, torch.Tensor]:
    s = _descale(x.abs().amax(-1), rule)
    if rule.scale_apply == "divide":
        v = x / s.unsqueeze(-1)
    else:
        v = x * torch.reciprocal(s).unsqueeze(-1)
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


@torch.no_grad()
def engine_operands(
    inputs: SyntheticIndexerInputs, engine: EngineProfile, *, hadamard: bool, interleaved: bool
) -> EngineOperands:
    """The engine's FP8 operands of one sequence (batch 1) of synthetic projections."""
    e = engine
    q = inputs.q[:, 0].float()  # (S, H, D): the BF16 GEMM output
    k = inputs.k[:, 0].float()  # (S, D)
    device = q.device
    # The cos/sin cache: float32 cos/sin of the angles, in the engine's cache dtype.
    angles = inputs.freqs[:, 0, 0, : inputs.rope_dim // 2]
    cos, sin = (
        _round(torch.cos(angles), e.cos_sin_dtype),
        _round(torch.sin(angles), e.cos_sin_dtype),
    )
    # Key LayerNorm: exact statistics, the float32 affine parameters; the engine's output dtype.
    k64 = k.double()
    mean = k64.mean(-1, keepdim=True)
    var = ((k64 - mean) ** 2).mean(-1, keepdim=True)
    norm = inputs.k_norm
    k = (k64 - mean) / torch.sqrt(var + norm.eps) * norm.weight.double() + norm.bias.double()
    k = _round(k.float(), e.k_norm_dtype)
    q = _round(_rope(q, cos[:, None], sin[:, None], e.rope_dtype, interleaved), e.q_dtype)
    k = _round(_rope(k, cos, sin, e.rope_dtype, interleaved), e.k_dtype)
    if hadamard:
        h = _sylvester(q.shape[-1], device)
        q = _round((q.double() @ h).float(), e.q_dtype)
        k = _round((k.double() @ h).float(), e.k_dtype)
    q8, q_descale = _quantize(q, e.q_quant)
    k8, k_descale = _quantize(k, e.k_quant)
    heads, dim = q.shape[-2], q.shape[-1]
    w = inputs.w[:, 0].float()
    constants = {
        "Ds": torch.tensor(dim**-0.5, dtype=torch.float32),
        "Hs": torch.tensor(heads**-0.5, dtype=torch.float32),
        "DsHs": torch.tensor(dim**-0.5 * heads**-0.5, dtype=torch.float32),
    }
    for step in e.weights_fold:
        w = w * (q_descale if step == "qs" else constants[step].to(device))
    return EngineOperands(q8, k8, k_descale, w)


@torch.no_grad()
def engine_scores(ops: EngineOperands, *, kernel: str = "exact") -> torch.Tensor:
    """``(S, S)`` float32 causal scores: ``"exact"`` (float64 sum of the E4M3 products, rounded
    once) or ``"deepgemm"`` (DeepGEMM's MQA logits on CUDA)."""
    s = ops.q.shape[0]
    keys = torch.arange(s, device=ops.q.device)
    if kernel == "deepgemm":
        from ..backends import deepgemm

        logits = deepgemm._causal_logits(
            ops.q.contiguous(),
            (ops.k.contiguous(), ops.k_descale.contiguous()),
            ops.weights.contiguous(),
            (keys + 1).to(torch.int32),
        )
        return logits[:, :s].contiguous()
    k64 = ops.k.double().t()
    acc = torch.zeros(s, s, dtype=torch.float64, device=ops.q.device)
    for h in range(ops.q.shape[1]):
        acc += (ops.q[:, h].double() @ k64).clamp_min(0) * ops.weights[:, h, None].double()
    scores = (acc * ops.k_descale.double()).float()
    return scores.masked_fill(keys[None, :] > keys[:, None], float("-inf"))


def engine_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of each row (ties toward the lower key; -inf never selected): ``(S, k)`` int32,
    keys ascending, ``-1`` padded."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    picks = order.indices[:, :k]
    picks = torch.where(order.values[:, :k] > float("-inf"), picks, scores.shape[-1])
    picks = picks.sort(-1).values
    return torch.where(picks == scores.shape[-1], -1, picks).to(torch.int32)
