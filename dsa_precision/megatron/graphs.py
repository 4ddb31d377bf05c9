"""CUDA graphs of the owned top-k (``dsa_indexer_cuda_graph``): captured once per input layout,
replayed on every later forward.

At short sequences a DSA layer's FP8 top-k is a dozen small kernels whose launches and checks
cost the host more than the device (``tools/host_profile.py``). :class:`GraphedCalls` captures the
whole computation -- from ``x``, ``qr`` to the picks -- in one ``torch.cuda.CUDAGraph`` the first
time a layout is seen, then serves every later call by copying the inputs into the graph's static
buffers, one ``replay()`` and a copy of the result: the same kernels on the same bytes, so the
same bits (the GPU tests compare replays with the eager top-k).

What a replay reads, and when a layer captures again:

- **its inputs**, copied into the static buffers on every call (their shapes, dtypes and device
  are part of the key: another shape captures another graph);
- **the parameters**, read where they lie: an in-place update (the optimizer's) is seen by the
  next replay; new storage (``param.data = ...``) changes their addresses, which are part of the
  key, so the layer captures again;
- **tensors built before the capture** that the computation reads: Megatron's cached RoPE
  angles (kept alive by the graph, ``keep``), the package's device constants and the engine's
  RoPE tables of ``rope_fp32`` (``dsa_precision.rope.EngineRopeTables``; both never evicted),
  pure functions of the key. The package's other caches (``dsa_precision.devices``) are bypassed
  while a stream is captured, so what they would serve is built inside the graph, every replay.

Every graph of a device shares one memory pool. That is safe because each replay's result is
copied out before anything else runs, so no graph's output outlives the next replay; replays
must run one at a time (as Megatron runs layers, on one stream). A call made while the current
stream is itself being captured (Megatron's own CUDA graphs around the layer) runs eagerly, so
the outer graph records the kernels themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .. import audit

__all__ = ["GraphedCalls"]

# Graphs kept per layer (the least recently used dropped first): one per input layout and key.
MAX_GRAPHS = 8

# The graphs alive per device: a new capture joins their pool (a pool lives while a graph of it
# does; the handle of one whose graphs are all gone cannot be reused).
_LIVE: dict[torch.device, weakref.WeakSet[torch.cuda.CUDAGraph]] = {}


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the warm-ups and captures of ``device`` run on (``torch.cuda.graph``'s
    own default is one stream, of whichever device was current when it was first made)."""
    return torch.cuda.Stream(device)


def _pool(device: torch.device) -> Any:
    """The memory pool the graphs of ``device`` capture into: that of a live one, else new."""
    for graph in _LIVE.get(device, ()):
        return graph.pool()
    return torch.cuda.graph_pool_handle()


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: Any
    calls: Any  # Counter of (precision, backend) scoring calls one run records
    keep: tuple[Any, ...]


def _clone(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.clone()
    return type(output)(_clone(o) for o in output)


class GraphedCalls:
    """One function of fixed-layout CUDA tensors, as CUDA graphs keyed by its inputs' layout.

    Calls are serialised (one set of static buffers per graph); replays of one device must run
    on one stream at a time (their graphs share a memory pool), as Megatron runs its layers."""

    def __init__(self, max_graphs: int = MAX_GRAPHS) -> None:
        self._graphs: dict[Hashable, _Graph] = {}
        self._max = max_graphs
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def __deepcopy__(self, memo: dict) -> GraphedCalls:
        """A copy of the module captures its own graphs (a graph reads its owner's storage)."""
        return GraphedCalls(self._max)

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the pool)."""
        with self._lock:
            self._graphs.clear()

    def __call__(
        self,
        fn: Callable[..., Any],
        inputs: tuple[torch.Tensor, ...],
        key: Hashable,
        keep: Callable[[], tuple[Any, ...]] = tuple,
    ) -> Any:
        """``fn(*inputs)`` (a tensor or a tuple of tensors, no autograd), from the graph captured
        for ``key`` and the inputs' layout (captured now if there is none).

        ``key`` must hold everything else the computation's launches depend on (host values,
        parameter addresses, the modules it runs); ``keep()``, called when a graph is captured:
        the tensors built before the capture that it reads, kept as long as the graph.
        """
        if torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        full = (key, tuple([(t.shape, t.dtype, t.device) for t in inputs]))
        with self._lock:
            entry = self._graphs.pop(full, None)
            if entry is None:
                with torch.cuda.device(inputs[0].device):
                    entry = self._capture(fn, inputs, keep())
                if len(self._graphs) >= self._max:  # the least recently used goes
                    self._graphs.pop(next(iter(self._graphs)))
            self._graphs[full] = entry  # most recently used last
            # No device switch: the copies run on their tensors' device, and a replay on the
            # current stream of the device it was captured on.
            torch._foreach_copy_(entry.inputs, inputs)  # one launch for inputs of one dtype
            entry.graph.replay()
            output = _clone(entry.output)
        audit.record_scoring_calls(entry.calls)
        return output

    @staticmethod
    def _capture(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], keep) -> _Graph:
        """Two eager warm-up runs on a side stream (they compile every kernel and fill the
        caches; counted as the scoring calls they are), then the capture. Built outside inference
        mode, so the static buffers take copies in and out of it alike."""
        device = inputs[0].device
        with torch.inference_mode(False):
            static = tuple(t.detach().clone() for t in inputs)
            side = _capture_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*static)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            capture = torch.cuda.graph(
                graph, pool=_pool(device), stream=side,
                capture_error_mode="thread_local",  # other threads' CUDA calls may go on
            )  # fmt: skip
            with audit.captured_calls() as calls, capture:
                output = fn(*static)
        _LIVE.setdefault(device, weakref.WeakSet()).add(graph)
        return _Graph(graph, static, output, calls, tuple(keep))
