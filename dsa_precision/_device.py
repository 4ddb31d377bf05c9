"""Constants of the hot path, built once: ``torch.tensor(value, device=cuda)`` is a blocking
host-to-device copy (a host synchronisation), and even a CPU scalar tensor per constant is a
measurable share of a kernel launch's host time."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=256)
def device_constant(
    value: float | tuple[float, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``torch.tensor(value, dtype=dtype, device=device)``, built once per argument triple and
    shared: read it, never write into it. Built outside inference mode, so a constant first made
    under ``torch.inference_mode()`` can still be saved for backward later."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def f32(value: float) -> float:
    """``value`` rounded to float32 (as a float32 scalar argument of a kernel), as a Python
    float; cached, the same few constants recur every call."""
    return float(torch.tensor(value, dtype=torch.float32))
