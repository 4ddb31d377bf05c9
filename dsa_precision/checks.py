"""Argument checks shared by the public entry points. Every message names the argument, the value
and what to pass instead.

Two kinds (docs/robustness.md, "The validation contract"): host facts (types, Python numbers,
shapes, dtypes, devices), always checked and free of any host synchronisation; and the data of
integer tensors, read only when the caller passes ``validate=True`` (one synchronisation).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

_INT_DTYPES = (torch.int32, torch.int64)
# Largest value of the int32 index and length tensors the kernels take (cuDNN, DeepGEMM, Triton).
_INT32_MAX = 2**31 - 1


def _describe(value: object) -> str:
    """What an error message says was passed: ``"torch.int64 (16, 4)"`` for a tensor (its dtype and
    shape), the type's name otherwise."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    return value


def _check_float_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {names}.")


def _check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"tensors are on different devices ({where}); move them to one device.")
    return next(iter(devices))


def _check_int_tensor(name: str, t: torch.Tensor, *, ndim: int) -> None:
    _check_tensor(name, t)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected int32 or int64.")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")


def _check_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool`` (``1``, ``"yes"`` or a one-element tensor are refused)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be a bool, got {value!r} ({type(value).__name__}); pass True or False."
        )
    return value


def _check_positive_int(name: str, value: object, *, high: int | None = None) -> int:
    """``value`` as a Python int in ``[1, high]`` (bools and floats such as ``2.0`` refused)."""
    if type(value) is int and 0 < value and (high is None or value <= high):
        return value  # the common case, without the ABC checks below (host time per call)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return _check_int_fits(name, value, low=1, high=high)


def _check_int_fits(
    name: str, value: object, *, low: int = 0, high: int | None = _INT32_MAX, fix: str = ""
) -> int:
    """``value`` as a Python int in ``[low, high]`` (``high=None``: no upper bound).

    The bound is a host fact of a Python number: a value past int32 would otherwise wrap, or fail
    inside torch, when the kernels take it as an int32.
    """
    if type(value) is int and low <= value and (high is None or value <= high):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be a Python int.")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} is outside {bound}{'; ' + fix if fix else ''}.")
    return value


def _as_int32_tensor(
    name: str,
    t: torch.Tensor,
    *,
    device: torch.device,
    validate: bool,
    low: int = 0,
    high: int = _INT32_MAX,
    fix: str = "",
) -> torch.Tensor:
    """An int32 or int64 tensor (checked as such by the caller) as int32 on ``device``.

    With ``validate=True`` its values are range-checked in ``[low, high]`` *before* the cast, in
    the tensor's own dtype, so an int64 value past int32 is reported instead of wrapping to a
    small valid-looking number (one host synchronisation). ``high`` must not exceed int32.
    """
    if validate and t.numel():
        bad = (t < low) | (t > high)
        if bool(bad.any()):
            i = tuple(int(j) for j in bad.nonzero()[0])
            where = i[0] if len(i) == 1 else i
            raise ValueError(
                f"{name}[{where}]={int(t[i])} is outside [{low}, {high}]"
                f"{'; ' + fix if fix else ''}."
            )
    return t.to(device=device, dtype=torch.int32)


def _check_freqs_cover(name: str, freqs: object, tokens: int) -> torch.Tensor:
    """RoPE angles ``freqs`` ``[s', ...]`` with a row for each of ``tokens`` positions: a single
    row is never broadcast to every token (the reference and the fused kernel alike)."""
    freqs = _check_tensor(name, freqs)
    if freqs.ndim == 0 or freqs.shape[0] < tokens:
        rows = freqs.shape[0] if freqs.ndim else 0
        raise ValueError(
            f"{name} has {rows} rows of angles for {tokens} tokens; RoPE takes one row per "
            "position: build it for the whole sequence."
        )
    return freqs


def _check_real(
    name: str, value: object, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """A finite Python real number (``float``, ``int``, NumPy scalars) as ``float``.

    Strings, bools and tensors are refused with a ``TypeError`` (a tensor scale would need a host
    synchronisation to read); ``positive`` / ``nonnegative`` bound it below.
    """
    if (
        type(value) is float
        and math.isfinite(value)
        and (value > 0 or not positive)
        and (value >= 0 or not nonnegative)
    ):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}={value!r} ({type(value).__name__}) must be a real number; pass a Python float."
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name}={value!r} must be finite.")
    if positive and not number > 0:
        raise ValueError(f"{name}={value!r} must be positive.")
    if nonnegative and not number >= 0:
        raise ValueError(f"{name}={value!r} must be non-negative.")
    return number


# Loose precision keywords of 0.1, replaced by one IndexerPrecisionConfig.
_LOOSE_PRECISION = ("scoring_precision", "engine", "rope_fp32")


def _takes_precision_config[F: Callable[..., Any]](fn: F) -> F:
    """Give the removed ``scoring_precision=`` / ``engine=`` / ``rope_fp32=`` keywords of ``fn`` a
    ``TypeError`` saying what to pass now (``config=IndexerPrecisionConfig(...)``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        loose = [k for k in _LOOSE_PRECISION if k in kwargs]
        if loose:
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in loose)
            raise TypeError(
                f"{fn.__name__}() takes the precision as one object: pass "
                f"config=IndexerPrecisionConfig({given}) instead of {given}."
            )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
