"""Which precision each indexer scoring call really used.

Every call of the scoring choke point (:func:`dsa_precision.scoring._indexer_forward`) is
counted here by ``(precision, backend)``, so tests and training logs can prove that a configured
FP8 path is taken rather than assume it.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["reset_scoring_calls", "scoring_calls"]

_lock = threading.Lock()
_calls: Counter[tuple[str, str]] = Counter()


def record_scoring_call(precision: str, backend: str) -> None:
    with _lock:
        _calls[(precision, backend)] += 1


def scoring_calls(precision: str | None = None, backend: str | None = None) -> int:
    """Scoring calls so far, optionally filtered by precision (``"bf16"``/``"fp8"``) and backend
    (``"cudnn"``/``"torch"``)."""
    with _lock:
        return sum(
            n
            for (p, b), n in _calls.items()
            if (precision is None or p == precision) and (backend is None or b == backend)
        )


def reset_scoring_calls() -> None:
    """Zero the counters (e.g. at the start of a test or a logging interval)."""
    with _lock:
        _calls.clear()
