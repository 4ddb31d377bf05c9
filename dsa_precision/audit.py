"""Which precision each indexer scoring call really used.

Every call of the scoring choke point (:func:`dsa_precision.scoring._indexer_forward`) is
counted here by ``(precision, backend, site)``, so tests and training logs can prove that a
configured FP8 path is taken rather than assume it. ``site`` names the caller's path
(``"fused"``, ``"split"``, ...) when an integration declares it with :func:`scoring_site`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from collections.abc import Iterator

__all__ = ["reset_scoring_calls", "scoring_calls", "scoring_site"]

_lock = threading.Lock()
_calls: Counter[tuple[str, str, str]] = Counter()
_site: contextvars.ContextVar[str] = contextvars.ContextVar("dsa_precision_site", default="direct")


@contextlib.contextmanager
def scoring_site(name: str) -> Iterator[None]:
    """Label the scoring calls made inside the block (e.g. ``"fused"`` or ``"split"``)."""
    token = _site.set(name)
    try:
        yield
    finally:
        _site.reset(token)


def record_scoring_call(precision: str, backend: str) -> None:
    with _lock:
        _calls[(precision, backend, _site.get())] += 1


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
