"""The package's own host (CPU) time, measured by a ``sys.setprofile`` tracer.

``torch.profiler``'s Python frames (``with_stack=True``) are not recorded on every build (the
H200 host's torch 2.11 records none, which made the toy's "pkg host" read 0.000), so this
counts the frames itself: the time between two Python call/return events goes to the innermost
frame that belongs to ``dsa_precision`` or to ``megatron`` (frames of torch and others in
between, e.g. ``Module.__call__`` or a tensor op's Python wrapper, count for the package frame
that called them). What lands on ``dsa_precision`` is the package's host time: its Python, its
argument checks, and the host side of the kernel launches it issues (on a CUDA device the
kernels themselves run asynchronously and cost the host nothing; on the CPU they are host time
too). Megatron's frames called from the package (``DSAttention.forward`` behind the seam, its
linear layers) are not counted. The tracer's own callback time is excluded from both.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["package_host_seconds"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _megatron_dir() -> str | None:
    try:
        import megatron
    except ImportError:
        return None
    return os.path.dirname(os.path.abspath(next(iter(megatron.__path__)))) + os.sep + "megatron"


def package_host_seconds(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn()`` on this thread under the tracer: ``(fn's result, seconds of host time spent
    in dsa_precision frames)``. Only the calling thread is traced (autograd's device threads
    are not)."""
    megatron_dir = _megatron_dir()
    owners: dict[Any, str | None] = {}  # code object -> "pkg" / "meg" / None (inherit)
    stack: list[str | None] = [None]
    spent = {"pkg": 0.0, "meg": 0.0, None: 0.0}
    clock = time.perf_counter
    mark = [clock()]

    def owner(code) -> str | None:
        path = os.path.abspath(code.co_filename)
        if path.startswith(_PACKAGE):
            return "pkg"
        if megatron_dir is not None and path.startswith(megatron_dir):
            return "meg"
        return None

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        now = clock()
        spent[stack[-1]] += now - mark[0]
        if event == "call":
            code = frame.f_code
            mine = owners.get(code, "?")
            if mine == "?":
                mine = owners[code] = owner(code)
            stack.append(mine if mine is not None else stack[-1])
        elif event == "return" and len(stack) > 1:
            stack.pop()
        mark[0] = clock()

    previous = sys.getprofile()
    sys.setprofile(tracer)
    try:
        result = fn()
    finally:
        sys.setprofile(previous)
    spent[stack[-1]] += clock() - mark[0]
    return result, spent["pkg"]
