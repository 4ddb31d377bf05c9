"""Constants of the hot path, built once: ``torch.tensor(value, device=cuda)`` is a blocking
host-to-device copy (a host synchronisation), and even a CPU scalar tensor per constant is a
measurable share of a kernel launch's host time.

Two kinds of cache, both for tensors the package only reads:

- by value (:func:`_device_constant`, :func:`_shared_device_tensor`): the tensor is a function of
  Python values and a device, built once per argument tuple (LRU, 256 entries each);
- by source tensor (:class:`_DerivedCache`): a tensor derived from another tensor, remembered for
  that tensor object and its version counter (``Tensor._version``, bumped by every in-place
  operation), never by its address (the caching allocator reuses addresses with other contents).

Every cached tensor is built outside inference mode (so it can be saved for backward later).
While the current CUDA stream is being captured into a graph, :func:`_shared_device_tensor` and
:class:`_DerivedCache` build nothing into their caches (a capture records a build instead of
running it) and serve nothing from them either: each call builds its own tensor, inside the
graph, as before these caches, since a replay must not read an entry evicted since.

:func:`_to_device` is the hot path's one way to move a tensor it is handed (packed lengths,
engine picks) onto the device: without the stream synchronisation of a blocking copy.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch

__all__ = ["f32"]


def _to_device(
    t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``t`` on ``device`` (as ``dtype``, default its own), queued without a host
    synchronisation: a host tensor's copy is ``non_blocking`` (a blocking ``Tensor.to`` from host
    memory waits for the stream after the copy). A pageable source is staged before the call
    returns; a pinned one is read when the stream reaches the copy, so it must not be changed in
    place before then (PyTorch's rule for every ``non_blocking`` copy). A tensor already there
    (and of that dtype) is returned as is."""
    return t.to(device=device, dtype=dtype or t.dtype, non_blocking=True)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def _device_constant(
    value: float | tuple[float, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``torch.tensor(value, dtype=dtype, device=device)``, built once per argument triple and
    shared: read it, never write into it. Built outside inference mode, so a constant first made
    under ``torch.inference_mode()`` can still be saved for backward later. Never evicted: a
    CUDA graph captured while it was cached reads it where it lies (the few constants the kernels
    take -- an epsilon, a scale -- are a handful of scalars)."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=dtype, device=device)


class _Lru:
    """A small LRU map whose lookups do not build (what a graph capture may read)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        entry = self.entries.get(key)
        if entry is not None:
            try:
                self.entries.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return entry

    def put(self, key: Hashable, value: Any) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()


def _shared_device_tensor[F: Callable[..., torch.Tensor]](build: F) -> F:
    """Decorate ``build(*hashable_args, device)`` (device last, positional) so that its tensor is
    built once per argument tuple and shared read-only (see the module docstring): for small
    index tensors of the hot path that depend only on Python values (causal offsets, key counts,
    lane orders), whose build is a few device launches per call otherwise."""
    cache = _Lru(256)

    @functools.wraps(build)
    def wrapper(*args: Hashable) -> torch.Tensor:
        if _capturing(cast(torch.device, args[-1])):  # the device is the last argument
            return build(*args)
        value: torch.Tensor | None = cache.get(args)
        if value is None:
            with torch.inference_mode(False):
                value = build(*args)
            cache.put(args, value)
        return value

    wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


class _DerivedCache:
    """Values derived from a source tensor, remembered for the source object and its version.

    ``get(source, key, build)`` returns ``build()``'s value from an earlier call with the same
    ``source`` object (held by a weak reference: a new tensor at a freed address misses), the
    same ``source._version`` (an in-place change of the source, or of any view of its storage,
    misses) and the same ``key`` (every other argument of the derivation); else it builds and
    remembers it (the ``size`` most recent entries; an entry whose source was freed is dropped
    at the next call, so a per-call source holds no memory). Inference tensors carry no version
    counter and are not cached (nor is anything during a graph capture). Only for sources whose
    contents change through operations the version counter sees: not for parameters, whose
    storage an optimizer may rewrite through ``.data`` or a flat buffer without a bump.
    """

    def __init__(self, size: int = 16) -> None:
        self._cache = _Lru(size)
        # keys whose source was freed (dropped at the next call)
        self._dead: list[tuple[int, int, Hashable]] = []

    def get(self, source: torch.Tensor, key: Hashable, build: Callable[[], Any]) -> Any:
        while self._dead:  # a freed source's values go with it (e.g. per-call THD angles)
            try:
                self._cache.entries.pop(self._dead.pop(), None)
            except IndexError:  # another thread took the last one
                break
        if source.is_inference() or _capturing(source.device):
            return build()
        full = (id(source), source._version, key)
        ref, value = self._cache.get(full) or (None, None)
        if ref is not None and ref() is source:
            return value
        with torch.inference_mode(False):
            value = build()
        self._cache.put(full, (weakref.ref(source, lambda _: self._dead.append(full)), value))
        return value

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()


@functools.lru_cache(maxsize=256)
def f32(value: float) -> float:
    """``value`` rounded to float32 (as a float32 scalar argument of a kernel), as a Python
    float; cached, the same few constants recur every call."""
    return float(torch.tensor(value, dtype=torch.float32))
