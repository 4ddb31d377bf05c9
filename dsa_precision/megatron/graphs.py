"""CUDA graphs of the owned top-k (``dsa_indexer_cuda_graph``): captured once per input layout,
replayed on every later forward.

At short sequences a DSA layer's FP8 top-k is a dozen small kernels whose launches and checks
cost the host more than the device (``tools/host_profile.py``). :class:`_GraphedCalls` captures the
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

Every graph of a device shares one memory pool, and every graph reads its inputs from and
writes its result to static buffers shared by all graphs (one per position, shape, dtype and
device: the layers of a model share them), so a model's graphs cost one set of buffers and one
pool's working set, not one per layer. That is safe because replays run one at a time (under one
lock, on the current stream, as Megatron runs its layers) and each copies its inputs in and its
result out before the next one runs. A call made while the current stream is itself being
captured (Megatron's own CUDA graphs around the layer) runs eagerly, so the outer graph records
the kernels themselves.
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
from ..devices import _to_device

__all__ = ["AUTO_GRAPH_MAX_ROWS"]

# dsa_indexer_cuda_graph="auto" graphs a forward of at most this many indexer rows (B x S; T
# packed): below it the eager FP8 top-k waits for the host (docs/megatron.md, "CUDA graphs of the
# owned top-k"), above it the device is the bound and a graph saves nothing.
AUTO_GRAPH_MAX_ROWS = 8192
# A packed forward's graph is keyed by buckets, so that micro-batches of other sequence counts and
# lengths replay the same graph: cu_seqlens padded to a power-of-two entry count (empty sequences
# at the end), the length bound rounded up to a power of two of at least this.
_MIN_LENGTH_BUCKET = 256

# Graphs kept per layer (the least recently used dropped first): one per input layout and key.
_MAX_GRAPHS = 8

# The graphs alive per device: a new capture joins their pool (a pool lives while a graph of it
# does; the handle of one whose graphs are all gone cannot be reused).
_LIVE: dict[torch.device, weakref.WeakSet[torch.cuda.CUDAGraph]] = {}

# The static buffers every graph copies its inputs into and its result out of, by (role,
# position, shape, dtype, device), and the lock that serialises captures and replays.
# Held weakly: the graphs that read a buffer keep it alive, and it goes with the last of them.
_STATIC: weakref.WeakValueDictionary[
    tuple[str, int, torch.Size, torch.dtype, torch.device], torch.Tensor
] = weakref.WeakValueDictionary()
_LOCK = threading.RLock()


def _static(role: str, position: int, like: torch.Tensor) -> torch.Tensor:
    """The shared static buffer of ``role`` ("in" / "out") at ``position`` for tensors like
    ``like`` (made once, outside inference mode and outside any graph's pool)."""
    key = (role, position, like.shape, like.dtype, like.device)
    buffer = _STATIC.get(key)
    if buffer is None:
        with torch.inference_mode(False):
            buffer = _STATIC[key] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return buffer


def _graph_packing(layout: Any, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The packed lengths a graph of a THD forward reads, and its host length bound.

    ``layout``: the forward's :class:`~.layout.RankLayout` (``cu_seqlens`` and a host
    ``max_seqlen``), ``rows`` its packed rows. Returns ``(cu, max_len)``: int32 ``cu_seqlens`` on
    ``device`` padded to a power-of-two count by repeating its last entry (empty sequences), and
    ``max_seqlen`` rounded up to a power of two (at least 256) but below ``rows`` (a bound equal
    to the rows means one sequence covering them: Megatron's angles then follow the rows), or
    itself when it reaches ``rows``. Neither changes a pick: the empty sequences hold no row, the
    bound only sizes buffers and RoPE tables whose entries depend on the position alone.
    """
    cu = _to_device(layout.cu_seqlens, device, torch.int32)
    n = cu.numel()
    capacity = max(2, 1 << (n - 1).bit_length())
    if capacity > n:
        cu = torch.cat((cu, cu[-1:].expand(capacity - n)))
    true = int(layout.max_seqlen)
    if true >= rows:
        return cu, true
    return cu, min(max(_MIN_LENGTH_BUCKET, 1 << (true - 1).bit_length()), rows - 1)


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


def _flat(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for o in output for t in _flat(o)]


def _like(output: Any, flat: list[torch.Tensor]) -> Any:
    """``output``'s structure over the tensors ``flat`` (consumed from the front)."""
    if isinstance(output, torch.Tensor):
        return flat.pop(0)
    return type(output)(_like(o, flat) for o in output)


class _GraphedCalls:
    """One function of fixed-layout CUDA tensors, as CUDA graphs keyed by its inputs' layout.

    Calls of every instance are serialised (their graphs share static buffers and, per device, a
    memory pool); replays of one device must run on one stream, as Megatron runs its layers."""

    def __init__(self, max_graphs: int = _MAX_GRAPHS) -> None:
        self._graphs: dict[Hashable, _Graph] = {}
        self._max = max_graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def __deepcopy__(self, memo: dict) -> _GraphedCalls:
        """A copy of the module captures its own graphs (a graph reads its owner's storage)."""
        return _GraphedCalls(self._max)

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the pool)."""
        with _LOCK:
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
        with _LOCK:
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
        audit._record_scoring_calls(entry.calls)
        return output

    @staticmethod
    def _capture(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], keep) -> _Graph:
        """Two eager warm-up runs on a side stream (they compile every kernel and fill the
        caches; counted as the scoring calls they are), then the capture, whose last launches
        copy the result into the shared static outputs (the result's own memory goes back to the
        pool). Built outside inference mode, so the static buffers take copies in and out of it
        alike."""
        device = inputs[0].device
        with torch.inference_mode(False):
            static = tuple(_static("in", i, t) for i, t in enumerate(inputs))
            torch._foreach_copy_(static, inputs)
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
            with audit._captured_calls() as calls, capture:
                result = fn(*static)
                outs = [_static("out", i, t) for i, t in enumerate(_flat(result))]
                torch._foreach_copy_(outs, _flat(result))
            output = _like(result, outs)
            del result
        _LIVE.setdefault(device, weakref.WeakSet()).add(graph)
        return _Graph(graph, static, output, calls, tuple(keep))
