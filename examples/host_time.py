"""The package's own host (CPU) time, measured with ``sys.monitoring`` (PEP 669).

``torch.profiler``'s Python frames (``with_stack=True``) are not recorded on every build (the
H200 host's torch 2.11 records none, which made the toy's "pkg host" read 0.000), so this
counts the frames itself: the time between two Python frame events (a function starting,
resuming, returning, yielding or unwinding) goes to the innermost frame that belongs to
``dsa_precision`` or to ``megatron``; frames of torch and others in between (``Module.__call__``,
a tensor op's Python wrapper) count for the package frame that called them. What lands on
``dsa_precision`` is the package's host time: its Python, its argument checks, and the host side
of the kernel launches it issues (on a CUDA device the kernels run asynchronously and cost the
host nothing; on the CPU they are host time too). Megatron's frames called from the package
(``DSAttention.forward`` behind the seam, its linear layers) are not counted.

Only Python frame events are monitored (no C calls, unlike ``sys.setprofile``), and a code
object of neither package stops reporting after its first event, so the monitoring adds about
one callback per package or Megatron frame; its callbacks' own time is left out. Events of other
threads are ignored.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import dsa_precision

__all__ = ["package_host_seconds"]

# The package's folder (what counts as its frames); names of its functions are relative to it.
_PACKAGE = os.path.dirname(os.path.abspath(dsa_precision.__file__)) + os.sep


def _megatron_dirs() -> tuple[str, ...]:
    try:
        import megatron
    except ImportError:
        return ()
    return tuple(os.path.abspath(path) + os.sep for path in megatron.__path__)


def package_host_seconds(
    fn: Callable[[], Any], by_function: dict[str, float] | None = None
) -> tuple[Any, float]:
    """Run ``fn()`` on this thread, monitored: ``(fn's result, seconds of host time spent in
    dsa_precision frames)``. ``by_function``, if given, gains each package function's own share
    of those seconds (``"module.py:line name"`` -> seconds, added to what it holds). Raises
    ``RuntimeError`` if another profiler holds ``sys.monitoring``'s profiler slot."""
    mon = sys.monitoring
    tool = mon.PROFILER_ID
    if mon.get_tool(tool) is not None:
        raise RuntimeError(
            f"sys.monitoring's profiler slot is taken by {mon.get_tool(tool)!r}; stop that "
            "profiler (cProfile, a debugger) before measuring the package's host time."
        )
    megatron_dirs = _megatron_dirs()
    owners: dict[Any, str | None] = {}  # code object -> "pkg" / "meg" / None (inherit)
    stack: list[str | None] = [None]
    codes: list[Any] = [None]  # the code object of each frame on ``stack``
    spent = {"pkg": 0.0, "meg": 0.0, None: 0.0}
    per_code: dict[Any, float] = {}

    def charge(seconds: float) -> None:
        spent[stack[-1]] += seconds
        if by_function is not None and stack[-1] == "pkg":
            per_code[codes[-1]] = per_code.get(codes[-1], 0.0) + seconds

    clock = time.perf_counter
    mark = [clock()]
    me = threading.get_ident()
    disable = mon.DISABLE

    def owner(code) -> str | None:
        mine = owners.get(code, "?")
        if mine == "?":
            path = os.path.abspath(code.co_filename)
            if path.startswith(_PACKAGE):
                mine = "pkg"
            elif path.startswith(megatron_dirs):
                mine = "meg"
            else:
                mine = None
            owners[code] = mine
        return mine

    def enter(code, *_: Any) -> Any:
        now = clock()
        if threading.get_ident() != me:
            return None
        mine = owner(code)
        if mine is None:  # inherits its caller's owner: never pushed, never popped
            mark[0] += clock() - now
            return disable
        charge(now - mark[0])
        stack.append(mine)
        codes.append(code)
        mark[0] = clock()
        return None

    def leave(code, *_: Any) -> Any:
        now = clock()
        if threading.get_ident() != me:
            return None
        if owner(code) is None:
            mark[0] += clock() - now
            return disable
        charge(now - mark[0])
        if len(stack) > 1:
            stack.pop()
            codes.pop()
        mark[0] = clock()
        return None

    def unwind(code, *args: Any) -> None:  # not a local event: it cannot be disabled
        leave(code)

    def throw(code, *args: Any) -> None:
        enter(code)

    ev = mon.events
    callbacks = {
        ev.PY_START: enter,
        ev.PY_RESUME: enter,
        ev.PY_THROW: throw,
        ev.PY_RETURN: leave,
        ev.PY_YIELD: leave,
        ev.PY_UNWIND: unwind,
    }
    mon.use_tool_id(tool, "host_time (examples)")
    try:
        for event, callback in callbacks.items():
            mon.register_callback(tool, event, callback)
        mon.restart_events()
        mark[0] = clock()
        mon.set_events(tool, sum(callbacks))
        try:
            result = fn()
        finally:
            mon.set_events(tool, 0)
            charge(clock() - mark[0])
    finally:
        for event in callbacks:
            mon.register_callback(tool, event, None)
        mon.free_tool_id(tool)
    if by_function is not None:
        for code, seconds in per_code.items():
            name = f"{os.path.relpath(code.co_filename, _PACKAGE)}:{code.co_firstlineno} "
            name += code.co_qualname
            by_function[name] = by_function.get(name, 0.0) + seconds
    return result, spent["pkg"]
