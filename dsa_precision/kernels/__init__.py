"""Triton kernels. Importing this package imports nothing; each kernel module imports Triton.

- :mod:`.preprocess_quantize`: the indexer's RoPE -> (Hadamard) -> E4M3/UE8M0 quantization (and
  the key LayerNorm of the ``rope_fp32`` path) in one pass, bit-identical to the torch reference,
  under one :class:`~.rules.PreprocessRules`. Use it through
  :func:`dsa_precision.prepare_indexer_operands` and :func:`dsa_precision.prepare_scoring_operands`,
  which decide when it applies (:mod:`dsa_precision.preprocess_kernel`).
- :mod:`.topk_picks`: the cuDNN top-k's ``-inf`` / NaN picks set to ``-1`` in one pass
  (:func:`dsa_precision.indexer_topk` calls it).
- :mod:`.mask_tails`: ``-inf`` into the unwritten tails of DeepGEMM's compressed logits.
- :mod:`.digest`: the 64-bit digest of each top-k row in one pass
  (:func:`dsa_precision.capture.digest_rows` calls it on CUDA).
- :mod:`.tie_rows`: per row, the keys of its window scoring at least a threshold, in one pass
  (:func:`dsa_precision.capture.engine_tie_rows` calls it on CUDA).
- :mod:`.varlen_windows`: each packed (THD) row's key window (DeepGEMM's ``ks`` / ``ke``, the
  top-k's lengths) in one launch (:func:`dsa_precision.rows._varlen_windows` calls it on CUDA).
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["interpreting", "triton_unavailable_reason"]


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run in its CPU interpreter (set before import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_unavailable_reason() -> str | None:
    """Why the package's Triton kernels cannot run here, or ``None`` if they import."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        from . import preprocess_quantize, topk_picks  # noqa: F401
    except Exception as exc:  # a broken Triton install
        return f"the Triton kernels do not import ({exc})"
    return None
