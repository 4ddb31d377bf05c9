"""Hadamard rotation of indexer activations (Megatron's ``dsa_indexer_rotate_activation``).

``y = H_n x / sqrt(n)`` with ``H_n`` the Sylvester-ordered Hadamard matrix, the transform
``fast_hadamard_transform.hadamard_transform(x, scale=n**-0.5)`` computes.
"""

from __future__ import annotations

import torch

from .devices import _device_constant

__all__ = ["hadamard_transform", "rotate_activation"]

try:  # Optional CUDA extension; Megatron's own rotate_activation calls it.
    from fast_hadamard_transform import hadamard_transform as _fast_hadamard_transform

    HAVE_FAST_HADAMARD = True
except ImportError:  # absent on CPU-only machines and on the lent H200
    _fast_hadamard_transform = None
    HAVE_FAST_HADAMARD = False


def hadamard_transform(
    x: torch.Tensor, out_dtype: torch.dtype, *, scale_fp32: bool = False
) -> torch.Tensor:
    """``H_n x * n**-0.5``, correctly rounded to ``out_dtype``.

    ``x``: ``[..., n]``, ``n`` a power of two, any float dtype. The butterfly runs in float64,
    where the sums of ``n <= 128`` BF16 or FP32 values are exact (unless their magnitudes span more
    than ~2**22), so the only roundings are the ``n**-0.5`` product in float64 and the final cast:
    the result does not depend on summation order, batch shape or device. ``scale_fp32``: the sums
    rounded to float32 and multiplied in float32 by ``fl32(n**-0.5)``, as
    ``fast_hadamard_transform``'s float32 kernel scales (1.7e-8 relative below the float64
    constant for n = 128).
    """
    n = x.shape[-1]
    if n & (n - 1) or n == 0:
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}.")
    lead = x.shape[:-1]
    y = x.to(torch.float64).reshape(-1, n)
    h = 1
    while h < n:
        # Blocks of 2h values: first half a, second half b -> (a + b, a - b) (Sylvester order).
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, n)
    if scale_fp32:
        scale = _device_constant(n**-0.5, torch.float32, y.device)
        return (y.to(torch.float32) * scale).to(out_dtype)
    return (y * (n**-0.5)).to(out_dtype)


def rotate_activation(x: torch.Tensor, *, fp32: bool, scale_fp32: bool = False) -> torch.Tensor:
    """Hadamard-rotate ``x`` ``[..., n]``.

    ``fp32=True`` (the ``rope_fp32`` path): float32 in, float32 out, never rounded to BF16;
    ``scale_fp32`` as :func:`hadamard_transform` (an engine profile's ``hadamard_scale``).
    ``fp32=False`` (Megatron's path): the output has ``x``'s dtype. On CUDA with
    ``fast_hadamard_transform`` installed it calls that kernel, as Megatron does, so the bits
    match; elsewhere (where Megatron cannot rotate at all) it returns the correctly rounded
    transform, which that kernel's float32 arithmetic matches except in rare last-bit cases.
    """
    if fp32:
        if x.dtype != torch.float32:
            raise TypeError(f"rotate_activation(fp32=True) expects float32 input, got {x.dtype}.")
        return hadamard_transform(x, torch.float32, scale_fp32=scale_fp32)
    if _fast_hadamard_transform is not None and x.is_cuda:
        return _fast_hadamard_transform(x, scale=x.shape[-1] ** -0.5)
    return hadamard_transform(x, x.dtype)
