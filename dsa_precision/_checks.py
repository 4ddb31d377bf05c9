"""Argument checks shared by the public entry points. Every message names the argument, the value
and what to pass instead."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    return value


def check_float_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {names}.")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"tensors are on different devices ({where}); move them to one device.")
    return next(iter(devices))


def check_int_tensor(name: str, t: torch.Tensor, *, ndim: int) -> None:
    check_tensor(name, t)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected int32 or int64.")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value
