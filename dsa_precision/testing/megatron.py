"""megatron-core's model-parallel code on a machine without GPU, Transformer Engine or Apex: for
tests and CPU launchers only.

Sequence parallelism: Megatron's torch norm refuses ``sequence_parallel`` without TE or Apex;
:class:`SequenceParallelTorchNorm` is the same torch RMSNorm / LayerNorm with its parameters
marked ``sequence_parallel`` (what Megatron's fused norms do), and :func:`local_sp_backend` the
package's local DSA spec provider with it.

Devices: megatron-core asks for a GPU in a few places that a CPU run of the DSA path reaches:

- ``RotaryEmbedding`` places its buffers on ``torch.cuda.current_device()`` whatever
  ``use_cpu_initialization`` says;
- ``get_pos_emb_on_this_cp_rank`` (context parallelism) builds its index as a pinned CPU tensor
  moved with ``.cuda()``;
- sequence parallelism forks the CUDA RNG tracker around the embedding's dropout.

:func:`megatron_on_cpu` answers them on the CPU for the duration of a block, and restores what it
changed on exit. The first two are torch's own attributes (no megatron-core attribute is
replaced); the third uses Megatron's own public switch, ``initialize_rng_tracker(
inference_rng_tracker=True)``, whose tracker forks nothing (dropout must be 0). The library never
does any of this: a Megatron run on a GPU needs none of it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

__all__ = ["SequenceParallelTorchNorm", "local_sp_backend", "megatron_on_cpu"]


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) for sequence parallelism
    without Transformer Engine or Apex: a norm is row-wise, so it needs nothing of SP but what
    Megatron's fused norms do -- mark its parameters ``sequence_parallel`` so that their
    gradients, computed on a slice of the sequence, are summed over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def local_sp_backend():
    """:class:`dsa_precision.megatron.LocalDSASpecProvider` whose norms take sequence
    parallelism (:class:`SequenceParallelTorchNorm`)."""
    from ..megatron import LocalDSASpecProvider

    class Provider(LocalDSASpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual=False):
            return SequenceParallelTorchNorm

    return Provider()


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """For the block: ``torch.cuda.current_device()`` is ``"cpu"``, ``torch.tensor(...,
    pin_memory=True)`` does not pin, ``Tensor.cuda()`` leaves a tensor where it is, and
    Megatron's CUDA RNG tracker is its inference tracker (``fork`` does nothing). On exit torch's
    attributes are restored and Megatron's tracker is reset to a fresh default one (Megatron
    keeps one global tracker; it had no CUDA states to keep on a CPU)."""
    from megatron.core.tensor_parallel import random as mp_random

    saved = (torch.cuda.current_device, torch.tensor, torch.Tensor.cuda)
    make_tensor = torch.tensor

    def unpinned_tensor(*args, pin_memory: bool = False, **kwargs):
        return make_tensor(*args, **kwargs)

    def stay(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self

    # Monkeypatched for the block: torch's stubs declare these as fixed functions (ignores).
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.tensor = unpinned_tensor
    torch.Tensor.cuda = stay  # type: ignore[method-assign,assignment]
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        torch.cuda.current_device, torch.tensor, torch.Tensor.cuda = saved  # type: ignore[method-assign]
        mp_random.initialize_rng_tracker(force_reset=True)
