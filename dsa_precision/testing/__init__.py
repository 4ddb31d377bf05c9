"""Test utilities: bit-exact replay checks for the package's kernel paths (and yours)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

__all__ = ["assert_replays_bit_exact"]


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{i}]")
    elif hasattr(value, "__dataclass_fields__"):
        for key in value.__dataclass_fields__:
            yield from _flatten(getattr(value, key), f"{prefix}.{key}")
    else:
        yield prefix, value


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view with the tensor's exact bit pattern (NaN payloads included)."""
    t = t.detach().contiguous()
    if t.is_floating_point() or t.is_complex():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.view(ints[t.element_size()]) if t.numel() else t.view(torch.uint8)
    return t


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = (_bits(a) != _bits(b)).reshape(a.shape)
    index = tuple(int(i) for i in diff.nonzero()[0])
    return f"first differing index {index}: {a[index].item()!r} vs {b[index].item()!r}"


@contextlib.contextmanager
def _busy_side_stream(device: torch.device) -> Iterator[None]:
    """Keep another CUDA stream busy (large matmuls) while the block runs."""
    stream = torch.cuda.Stream(device=device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
    try:
        yield
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)


def assert_replays_bit_exact(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    replays: int = 3,
    backward: bool = False,
    contention: bool = False,
    what: str = "",
) -> Any:
    """Run ``fn(*inputs)`` ``replays`` times on fresh clones and require identical bits.

    Every tensor in the output (nested tuples / lists / dicts / dataclasses) is compared with
    the first run bit for bit (NaN-aware: identical NaN payloads compare equal); with
    ``backward=True`` so are the gradients of the floating-point inputs that require grad, after
    ``sum(out.float().sum())`` of the floating-point outputs is back-propagated. ``contention``
    keeps another CUDA stream busy during each replay. Non-tensor outputs must compare equal.

    Raises ``AssertionError`` naming ``what``, the output (or input gradient) and the first
    differing index. Returns the first run's output.
    """
    first = None
    first_grads: list[torch.Tensor | None] = []
    for replay in range(replays):
        args = [
            x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs
        ]
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        busy = (
            _busy_side_stream(device)
            if contention and device is not None and device.type == "cuda"
            else contextlib.nullcontext()
        )
        with busy:
            out = fn(*args)
            grads: list[torch.Tensor | None] = []
            if backward:
                leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                total = cast(  # a tensor: some output is differentiable when backward is asked
                    torch.Tensor,
                    sum(
                        t.float().sum()
                        for _, t in _flatten(out, "out")
                        if isinstance(t, torch.Tensor) and t.requires_grad
                    ),
                )
                grads = list(torch.autograd.grad(total, leaves, allow_unused=True))
        if replay == 0:
            first, first_grads = out, grads
            continue
        label = f"{what}: " if what else ""
        for (name, a), (_, b) in zip(_flatten(first, "out"), _flatten(out, "out"), strict=True):
            if isinstance(a, torch.Tensor):
                if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bits(a), _bits(b)):
                    raise AssertionError(
                        f"{label}replay {replay} differs from replay 0 at {name}: "
                        f"{_first_difference(a, b)}"
                    )
            elif a != b:
                raise AssertionError(f"{label}replay {replay} differs at {name}: {a!r} vs {b!r}")
        for i, (a, b) in enumerate(zip(first_grads, grads, strict=True)):
            if (a is None) != (b is None) or (
                a is not None and b is not None and not torch.equal(_bits(a), _bits(b))
            ):
                raise AssertionError(
                    f"{label}replay {replay} differs from replay 0 at grad of input {i}: "
                    f"{_first_difference(a, b) if a is not None and b is not None else 'None'}"
                )
    return first
