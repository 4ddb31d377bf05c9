"""Device constants built once: ``torch.tensor(value, device=cuda)`` is a blocking host-to-device
copy (a host synchronisation), so the hot path must not build one per call."""

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
