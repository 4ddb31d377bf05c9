"""Structured synthetic indexer inputs for the demo: projection outputs with a real top-k boundary.

The generator stands in for the three projections of a DSA indexer (``linear_wq_b``,
``linear_wk``, ``linear_weights_proj``) and its key LayerNorm, so both sides of the comparison
start from the same BF16 tensors, as training and inference do. The scores it induces are not
i.i.d. noise: keys and queries share a low-rank, slowly drifting latent "topic", a shared RoPE
component gives the dot products a recency bias, and the first token is an attention sink.
See ``docs/numerics.md`` (section "The demo") for the construction in formulas.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["SyntheticIndexerInputs", "synthetic_indexer_inputs"]

# Generator constants (documented in docs/numerics.md; changing one changes the demo's numbers).
_LATENT_RANK = 16  # rank of the shared query/key structure
_LATENT_RHO = 0.98  # AR(1) coefficient of the latent topic: correlation length ~50 tokens
_ROPE_BASE = 10000.0  # Megatron's default rotary_base
_K_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class SyntheticIndexerInputs:
    """Indexer projection outputs for one sequence (batch 1), in Megatron's layouts.

    Attributes:
        q: ``[S, 1, H, D]`` bfloat16, the ``linear_wq_b`` output reshaped to heads.
        k: ``[S, 1, D]`` bfloat16, the ``linear_wk`` output.
        w: ``[S, 1, H]`` bfloat16, the raw ``linear_weights_proj`` output (unscaled).
        k_norm: the key ``nn.LayerNorm(D)`` with bfloat16 weight and bias (as under
            Megatron's ``--bf16``).
        freqs: ``[S, 1, 1, rope_dim]`` float32 RoPE angles (Megatron ``RotaryEmbedding`` layout).
    """

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor
    k_norm: nn.LayerNorm
    freqs: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.q.shape[0]

    @property
    def n_heads(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def rope_dim(self) -> int:
        return self.freqs.shape[-1]

    def to(self, device: torch.device | str) -> SyntheticIndexerInputs:
        """A copy on ``device`` (exact: no dtype changes)."""
        return SyntheticIndexerInputs(
            self.q.to(device),
            self.k.to(device),
            self.w.to(device),
            self.k_norm.to(device),
            self.freqs.to(device),
        )


def _rope_freqs(seq_len: int, rope_dim: int, base: float = _ROPE_BASE) -> torch.Tensor:
    """``[seq_len, 1, 1, rope_dim]`` float32 angles, as Megatron's ``RotaryEmbedding`` (rotate-half
    layout, no scaling): ``inv_freq = 1 / base ** (arange(0, rope_dim, 2) / rope_dim)``,
    ``cat([outer(pos, inv_freq)] * 2, -1)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@torch.no_grad()
def synthetic_indexer_inputs(
    seq_len: int,
    *,
    n_heads: int = 32,
    head_dim: int = 128,
    rope_dim: int = 64,
    seed: int = 0,
) -> SyntheticIndexerInputs:
    """Generate one sequence of structured indexer projection outputs on the CPU.

    Deterministic for a given ``seed`` (a private ``torch.Generator``; the global RNG is not
    touched), so every device sees the same BF16 inputs.

    Args:
        seq_len: tokens ``S``.
        n_heads, head_dim, rope_dim: indexer heads ``H``, width ``D``, RoPE slice (GLM-5-like
            defaults: 32 x 128, 64).
        seed: generator seed.

    Returns:
        :class:`SyntheticIndexerInputs` on the CPU.
    """
    if seq_len < 1 or n_heads < 1 or not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(
            f"need seq_len >= 1, n_heads >= 1 and an even rope_dim in (0, head_dim]; got "
            f"seq_len={seq_len}, n_heads={n_heads}, head_dim={head_dim}, rope_dim={rope_dim}."
        )
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    r, s, h, d = _LATENT_RANK, seq_len, n_heads, head_dim
    # Latent topic z_t: a unit-variance AR(1) process, so nearby tokens are about the same thing.
    innovations = normal(s, r) * math.sqrt(1.0 - _LATENT_RHO**2)
    z = torch.empty(s, r)
    z[0] = normal(r)
    for t in range(1, s):
        z[t] = _LATENT_RHO * z[t - 1] + innovations[t]
    basis = normal(r, d) / math.sqrt(r)  # shared query/key subspace
    head_mix = torch.eye(r) + 0.5 * normal(h, r, r) / math.sqrt(r)  # per-head view of the topic
    # A component shared by all queries and keys on the RoPE lanes: after RoPE its contribution
    # to q_s . k_t is sum_i |c_i|^2 cos((s - t) theta_i), largest for nearby keys (recency).
    rope_shared = torch.zeros(d)
    rope_shared[:rope_dim] = 0.7 * normal(rope_dim)
    # Attention sink: token 0 carries a direction every query leans towards (non-RoPE lanes).
    sink = torch.zeros(d)
    sink[rope_dim:] = normal(d - rope_dim) / math.sqrt(max(d - rope_dim, 1))

    k = 2.0 * (z @ basis) + 0.5 * normal(s, d) + rope_shared
    k[0] += 4.0 * math.sqrt(d) * sink
    q = 1.5 * torch.einsum("sr,hrj,jd->shd", z, head_mix, basis) + 0.5 * normal(s, h, d)
    q += rope_shared + math.sqrt(d) * sink
    # Head gates: a per-head offset (some heads mostly negative) plus per-token variation.
    w = (0.5 + 0.5 * normal(h)) + 0.7 * normal(s, h)

    k_norm = nn.LayerNorm(d, eps=_K_NORM_EPS, dtype=torch.bfloat16)
    k_norm.weight.copy_(1.0 + 0.1 * normal(d))
    k_norm.bias.copy_(0.1 * normal(d))
    return SyntheticIndexerInputs(
        q=q.view(s, 1, h, d).to(torch.bfloat16),
        k=k.view(s, 1, d).to(torch.bfloat16),
        w=w.view(s, 1, h).to(torch.bfloat16),
        k_norm=k_norm.requires_grad_(False),
        freqs=_rope_freqs(s, rope_dim),
    )
