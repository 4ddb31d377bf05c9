"""Inputs for the building-block tests of the fused kernel (``tests/kernel_probes.py``)."""

from __future__ import annotations

import torch


def e4m3_inputs(device="cpu") -> torch.Tensor:
    """float32 values in [-448, 448]: every E4M3 value and midpoint, +-1 and +-2 ulps around
    each, float32 subnormals, signed zeros and random values over the whole range."""
    pos = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (pos[1:] + pos[:-1]) / 2
    exact = torch.cat([pos, mids])
    bits = exact.view(torch.int32)
    around = torch.cat([bits + d for d in (-2, -1, 0, 1, 2)]).view(torch.float32)
    around = around[(around >= 0) & (around <= 448)]
    g = torch.Generator().manual_seed(3)
    rand = torch.rand(1 << 16, generator=g) * 448 * torch.logspace(-20, 0, 1 << 16, base=2.0)
    sub = torch.randint(0, 1 << 23, (1024,), generator=g, dtype=torch.int32).view(torch.float32)
    x = torch.cat([around, rand, sub, torch.tensor([0.0, 448.0])])
    return torch.cat([x, -x]).to(device)


def bf16_rounding_inputs(device="cpu") -> torch.Tensor:
    """float32 bit patterns around every BF16 rounding case: ties, carries into the exponent,
    overflow to Inf, subnormals, Inf and NaN."""
    g = torch.Generator().manual_seed(4)
    hi = torch.randint(-(1 << 15), 1 << 15, (1 << 14,), generator=g, dtype=torch.int32) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    bits = (hi[:, None] | low[None, :]).flatten()
    special = torch.tensor(
        [0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0x00000001, 0x007FFFFF],
        dtype=torch.int32,
    )
    negative = special | torch.tensor(-(2**31), dtype=torch.int32)
    return torch.cat([bits, special, negative]).view(torch.float32).to(device)


def order_sensitive_rows(device="cpu") -> torch.Tensor:
    """float64 ``[64, 128]`` rows whose sums depend on the order of the additions."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    x *= torch.logspace(-70, 70, 128, base=2.0, dtype=torch.float64)[
        torch.randperm(128, generator=g)
    ]
    x[::4, 0], x[::4, 1], x[::4, 2] = 1.0, -1.0, 2.0**-60
    x[1::4, 0], x[1::4, 64], x[1::4, 5] = 2.0**60, -(2.0**60), 1.0
    return x.to(device)
