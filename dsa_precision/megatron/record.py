"""Training's own picks, recorded in the engines' layout: :func:`record_topk`.

Inside the block every DSA layer records the picks it attends to (replayed, or the package's
selection); a layer on Megatron's own BF16 path records the package's BF16 selection of the same
operands (one more scoring pass; Megatron's own picks can differ from it only at exact ties).
The result is a :class:`~dsa_precision.picks.TopkPicks`, e.g. for
:func:`dsa_precision.capture.save_picks` and ``dsa-precision agree``, or to hand back in with
:func:`~.replay.engine_topk`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from ..picks import TokenLayout, TopkPicks

__all__ = ["TopkRecorder", "record_topk"]


class TopkRecorder:
    """What :func:`record_topk` yields: each layer's picks of the forwards inside the block (a
    later forward of a layer replaces its earlier one); :attr:`picks` reads them."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._layout: TokenLayout | None = None

    def record(
        self,
        layer_number: int,
        indices: torch.Tensor,
        tokens: torch.Tensor | None,
        layout: TokenLayout,
    ) -> None:
        """One layer's ``(rows, k)`` sequence-relative picks; ``tokens``: each row's global
        token when the rank holds only some rows of the micro-batch (``None``: every token, in
        order); ``layout``: the layer's own token layout."""
        if self._layout is not None and not _same_layout(self._layout, layout):
            raise RuntimeError(
                f"record_topk: DSA layer {layer_number} runs another token layout than the layers "
                "recorded before it in this block; record one micro-batch per block."
            )
        self._layout = layout
        self._layers[layer_number] = (indices, tokens)

    @property
    def picks(self) -> TopkPicks:
        """Every recorded layer's picks, rows in token order (a rank holding only some rows:
        its rows, with :attr:`TopkPicks.tokens`); empty before any layer ran."""
        indices: dict[int, torch.Tensor] = {}
        tokens = None
        for n, (idx, rows) in sorted(self._layers.items()):
            if rows is None:
                indices[n] = idx
                continue
            order = rows.argsort(stable=True)  # on the device: no synchronisation
            indices[n], tokens = idx[order], rows[order]
        return TopkPicks(indices, self._layout, tokens=tokens)


def _same_layout(a: TokenLayout, b: TokenLayout) -> bool:
    if a.seq_len is not None or b.seq_len is not None:
        return a.seq_len == b.seq_len
    assert a.cu_seqlens is not None and b.cu_seqlens is not None  # THD: both given
    return a.cu_seqlens is b.cu_seqlens or a.cu_seqlens.shape == b.cu_seqlens.shape


_RECORDER: contextvars.ContextVar[TopkRecorder | None] = contextvars.ContextVar(
    "dsa_precision_record_topk", default=None
)


@contextlib.contextmanager
def record_topk() -> Iterator[TopkRecorder]:
    """Record every DSA layer's top-k during the block (see the module docstring); read
    ``recorder.picks`` after it."""
    recorder = TopkRecorder()
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def _current_recorder() -> TopkRecorder | None:
    """The recorder of the :func:`record_topk` block now running, or ``None``."""
    return _RECORDER.get()
