"""Which precision each indexer scoring call really used, and strict mode.

Every launch of the package's scoring (:func:`dsa_precision.indexer_scores` and
:func:`dsa_precision.indexer_scores_varlen`, so also every chunk of ``indexer_select``) is counted
here by ``(precision, backend, site)``, so tests and training logs can prove that a configured FP8
path is taken rather than assume it. Megatron's own scoring (the default fields, which run stock
Megatron code) is not the package's and is not counted. ``site`` names the caller's path
(``"fused"``, ``"split"``, ...) when an integration declares it with :func:`scoring_site`.

Strict mode: inside :func:`strict_precision` (which the Megatron integration enters around the
owned top-k of ``PrecisionDSAttention`` when ``DSA_PRECISION_STRICT=1``), the first scoring call
in another precision raises :class:`PrecisionMismatchError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = [
    "PrecisionMismatchError",
    "reset_scoring_calls",
    "scoring_calls",
    "scoring_site",
    "strict_precision",
]

_STRICT_ENV = "DSA_PRECISION_STRICT"

_lock = threading.Lock()
_calls: Counter[tuple[str, str, str]] = Counter()
_site: contextvars.ContextVar[str] = contextvars.ContextVar("dsa_precision_site", default="direct")
_expected: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dsa_precision_expected", default=None
)
_recording: contextvars.ContextVar[Counter[tuple[str, str]] | None] = contextvars.ContextVar(
    "dsa_precision_recording", default=None
)


class PrecisionMismatchError(RuntimeError):
    """A scoring call ran in a precision other than the configured one (strict mode)."""


def _strict_enabled() -> bool:
    """Whether ``DSA_PRECISION_STRICT`` asks for strict mode (``1``/``true``/``yes``/``on``)."""
    return os.environ.get(_STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class _Setting:
    """``var`` set to ``value`` inside the block, restored after it (a class, not a generator:
    the Megatron layer enters one per forward)."""

    __slots__ = ("_token", "_value", "_var")

    def __init__(self, var: contextvars.ContextVar[Any], value: object) -> None:
        self._var, self._value = var, value

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._token)


def strict_precision(precision: str) -> contextlib.AbstractContextManager[None]:
    """Raise at the first scoring call inside the block whose precision is not ``precision``."""
    return _Setting(_expected, str(precision))


def scoring_site(name: str) -> contextlib.AbstractContextManager[None]:
    """Label the scoring calls made inside the block (e.g. ``"fused"`` or ``"split"``)."""
    return _Setting(_site, name)


@contextlib.contextmanager
def _captured_calls() -> Iterator[Counter[tuple[str, str]]]:
    """The ``(precision, backend)`` scoring calls made inside the block, counted here instead of
    in :func:`scoring_calls`: a CUDA graph's capture, which launches nothing; each replay
    launches them, and records them with :func:`_record_scoring_calls`."""
    calls: Counter[tuple[str, str]] = Counter()
    token = _recording.set(calls)
    try:
        yield calls
    finally:
        _recording.reset(token)


def _record_scoring_call(precision: str, backend: str) -> None:
    site = _site.get()
    recording = _recording.get()
    if recording is not None:
        recording[(precision, backend)] += 1
    else:
        with _lock:
            _calls[(precision, backend, site)] += 1
    expected = _expected.get()
    if expected is not None and precision != expected:
        raise PrecisionMismatchError(
            f"a {site} indexer scoring call ran in {precision} ({backend}) but {expected} is "
            f"configured (strict mode, {_STRICT_ENV})."
        )


def _record_scoring_calls(calls: Counter[tuple[str, str]]) -> None:
    """Record the calls :func:`_captured_calls` counted (strict mode checks each)."""
    for (precision, backend), n in calls.items():
        for _ in range(n):
            _record_scoring_call(precision, backend)


def scoring_calls(
    precision: str | None = None, backend: str | None = None, site: str | None = None
) -> int:
    """Scoring calls so far, optionally filtered by precision (``"bf16"``/``"fp8"``), backend
    (``"cudnn"``/``"torch"``/``"megatron"``) and site."""
    want = (precision, backend, site)
    with _lock:
        return sum(
            n
            for key, n in _calls.items()
            if all(w is None or w == v for w, v in zip(want, key, strict=True))
        )


def reset_scoring_calls() -> None:
    """Zero the counters (e.g. at the start of a test or a logging interval)."""
    with _lock:
        _calls.clear()
