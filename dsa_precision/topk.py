"""Top-k key selection from indexer scores.

Selection rule (deterministic mode, both backends): among the valid keys of a row -- index below
the row's ``seq_len``, score neither ``-inf`` nor NaN -- take the ``k`` largest scores, ties
toward the lower key index, scores ordered as cuDNN's radix top-k orders them: by their float32
bit pattern, so ``+0.0`` ranks above ``-0.0`` (exact zeros are common: a key whose heads are all
ReLU-zero scores exactly 0). Each row's selected keys come back in ascending order; slots that
select nothing hold ``-1`` (after the selected keys whenever the row's ``-inf`` scores lie past
its valid keys, as for causal scores).

A NaN score (what non-finite operands produce) is never selected. The torch backend excludes NaN
before ranking; cuDNN's kernel ranks NaN unspecified, so a NaN it picks is replaced by ``-1`` and
that row selects fewer keys. Both hold without a host synchronisation; ``validate=True`` (or the
scoring functions' ``validate=True``) rejects such input up front instead.
"""

from __future__ import annotations

from typing import Literal

import torch

from .backends import cudnn
from .checks import (
    _INT32_MAX,
    _as_int32_tensor,
    _check_bool,
    _check_float_dtype,
    _check_int_tensor,
    _check_positive_int,
    _check_tensor,
)
from .config import _TOPK_BACKENDS
from .kernels import triton_unavailable_reason
from .rows import WindowScores

__all__ = ["indexer_topk"]

_SCORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows per torch-path chunk are bounded so the int64 sort keys stay under this many bytes.
_TORCH_TOPK_CHUNK_BYTES = 1 << 28


def _ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """Map float32 scores to int64 keys whose integer order is the float order (``-0 < +0``)."""
    bits = scores.to(torch.float32).view(torch.int32).to(torch.int64)
    # Negative floats: flip the magnitude bits so larger magnitude sorts lower.
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _torch_topk(
    scores: torch.Tensor, k: int, seq_lens: torch.Tensor, deterministic: bool
) -> torch.Tensor:
    """The reference: ``(rows, min(k, S_k))`` int64, valid keys ascending, then ``-1``."""
    sk = scores.shape[-1]
    keys_valid = torch.arange(sk, device=scores.device) < seq_lens.unsqueeze(-1)
    keys_valid &= (scores != float("-inf")) & ~torch.isnan(scores)
    if deterministic:
        # One int64 per score: the ordered float key in the high 32 bits, the reversed key index
        # in the low 32, so torch.topk's largest-first order breaks ties toward lower indices.
        low = (2**32 - 1) - torch.arange(sk, device=scores.device, dtype=torch.int64)
        ranked = (_ordered_keys(scores) << 32) + low
        ranked = ranked.masked_fill_(~keys_valid, torch.iinfo(torch.int64).min)
    else:
        ranked = scores.to(torch.float32).masked_fill(~keys_valid, float("-inf"))
    picked = ranked.topk(min(k, sk), dim=-1, sorted=False).indices
    keyed = torch.where(keys_valid.gather(-1, picked), picked, sk).sort(dim=-1).values
    return keyed.masked_fill_(keyed == sk, -1)


def _cudnn_topk(
    scores: torch.Tensor, k: int, seq_lens: torch.Tensor, deterministic: bool
) -> torch.Tensor:
    """cuDNN's radix top-k (the only call of that kernel): ``(rows, min(k, S_k))`` int32.

    Run through cuDNN's ``IndexerTopK`` plan (:func:`dsa_precision.backends.cudnn._topk_plan`) into
    buffers allocated here, as ``indexer_top_k_wrapper`` would run it, without the wrapper's
    per-call staging and cache key: ``scores`` are bound contiguous and 32-byte aligned (a copy
    otherwise, as the wrapper makes), ``seq_lens`` contiguous. Deterministic mode returns each
    row's keys ascending. A pick whose score is ``-inf`` or NaN (short rows, masked or
    non-finite keys) becomes ``-1``: one pass over the picks' scores
    (:mod:`dsa_precision.kernels.topk_picks`).
    """
    rows, sk = scores.shape
    top_k = min(k, sk)
    if not scores.is_contiguous() or scores.data_ptr() % cudnn._TOPK_INPUT_ALIGN:
        scores = scores.clone(memory_format=torch.contiguous_format)
    seq_lens = seq_lens.contiguous()
    device = scores.device
    with cudnn._device_scope(device):
        plan = cudnn._topk_plan(scores, seq_lens, top_k, deterministic)
        indices = torch.empty((rows, top_k), dtype=torch.int32, device=device)
        values = torch.empty((rows, top_k), dtype=scores.dtype, device=device)
        workspace = torch.empty(plan.scratch_workspace_bytes(), dtype=torch.uint8, device=device)
        plan.execute(scores, seq_lens, out_indices=indices, out_values=values, workspace=workspace)
    if indices.is_cuda and values.dtype == torch.float32 and triton_unavailable_reason() is None:
        from .kernels.topk_picks import drop_invalid_picks

        return drop_invalid_picks(indices, values)
    return indices.masked_fill_(~(values > float("-inf")), -1)  # (the kernel reads float32)


def _resolve_topk_backend(
    backend: str, *, device: torch.device, k: int, dtype: torch.dtype
) -> Literal["cudnn", "torch"]:
    """``"cudnn"`` or ``"torch"``; an explicit ``"cudnn"`` that cannot run raises."""
    if backend not in _TOPK_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a top-k backend; use one of {_TOPK_BACKENDS}."
        )
    if backend == "torch":
        return "torch"
    reason = cudnn._topk_reason(device, k, dtype)
    if reason is None:
        return "cudnn"
    if backend == "cudnn":
        raise RuntimeError(
            f"backend='cudnn' cannot run this top-k: {reason}. Use backend='torch' or 'auto'."
        )
    return "torch"


def indexer_topk(
    scores: torch.Tensor | WindowScores,
    k: int,
    *,
    seq_lens: torch.Tensor | None = None,
    deterministic: bool = True,
    backend: Literal["auto", "cudnn", "torch"] = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """Select the top-``k`` keys of every score row (see the module docstring for the rule).

    Arguments:
        scores: ``(..., S_k)`` float32 (or bf16/fp16) scores, ``-inf`` at masked keys, e.g.
            ``(B, S_q, S_k)`` from :func:`dsa_precision.indexer_scores`; or the
            :class:`~dsa_precision.rows.WindowScores` of ``clean=False``, read in place up to
            its lengths (then ``seq_lens`` stays ``None``).
        k: keys per row, ``k >= 1``.
        seq_lens: optional ``scores.shape[:-1]`` integer tensor in ``[0, S_k]``: keys
            ``>= seq_lens`` are not valid, and the kernel never reads them (for causal scores,
            :func:`dsa_precision.rows.causal_key_counts`). Without it every key is read.
        deterministic: ties break toward the lower key index (default). ``False`` lets ties
            resolve arbitrarily (cuDNN's faster mode; the order within a row is then arbitrary).
        backend: ``"cudnn"`` (SM90 radix top-k, ``k <= 2048``), ``"torch"`` or ``"auto"``.
            Both select exactly the same set in deterministic mode.
        validate: check that ``seq_lens`` lies in ``[0, S_k]``, in its own dtype before the
            int32 cast (a host synchronisation).

    Returns:
        int32 ``(..., k)``: each row's selected key indices in ascending order, ``-1`` in the
        slots that select nothing.
    """
    deterministic = _check_bool("deterministic", deterministic)
    validate = _check_bool("validate", validate)
    name, limit = "seq_lens", "S_k"
    if isinstance(scores, WindowScores):
        if seq_lens is not None:
            raise ValueError(
                "seq_lens: WindowScores carry each row's length; pass seq_lens=None with them."
            )
        lead, sk = scores.lengths.shape, scores.scores.shape[-1]
        flat = scores.rows_in_place()  # (rows, row stride): DeepGEMM's buffer, no copy
        seq_lens, name, limit = scores.lengths, "WindowScores.lengths", "columns"
        k = _check_positive_int("k", k, high=_INT32_MAX)
    else:
        scores = _check_tensor("scores", scores)
        _check_float_dtype("scores", scores, _SCORE_DTYPES)
        if scores.ndim < 1:
            raise ValueError("scores must have a key dimension, got a 0-d tensor.")
        k = _check_positive_int("k", k, high=_INT32_MAX)
        lead, sk = scores.shape[:-1], scores.shape[-1]
        flat = scores if scores.ndim == 2 else scores.reshape(lead.numel(), sk)  # rows of keys
        if seq_lens is not None:
            _check_int_tensor("seq_lens", seq_lens, ndim=_check_tensor("seq_lens", seq_lens).ndim)
            if seq_lens.shape != lead:
                raise ValueError(
                    f"seq_lens has shape {tuple(seq_lens.shape)}; expected one length per score "
                    f"row, {tuple(lead)}."
                )
            if seq_lens.device != scores.device:
                raise ValueError(
                    f"seq_lens is on {seq_lens.device} but scores on {scores.device}; move it."
                )
    if seq_lens is None:
        lens = torch.full((flat.shape[0],), sk, dtype=torch.int32, device=flat.device)
    else:
        lens = _as_int32_tensor(
            name,
            seq_lens,
            device=flat.device,
            validate=validate,
            high=sk,
            fix=f"each row's valid keys lie in [0, {limit}={sk}]",
        ).reshape(-1)
    backend = _resolve_topk_backend(
        backend, device=flat.device, k=min(k, max(sk, 1)), dtype=flat.dtype
    )
    picked = _select_rows(flat, k, lens, deterministic, backend)
    return picked if len(lead) == 1 else picked.reshape(*lead, k)


def _select_rows(
    scores: torch.Tensor, k: int, seq_lens: torch.Tensor, deterministic: bool, backend: str
) -> torch.Tensor:
    """:func:`indexer_topk` of score rows once its arguments are checked (for
    :mod:`dsa_precision.select`, which checks them once per call, not once per chunk):
    ``scores`` ``(rows, S_k)`` of a score dtype, ``seq_lens`` int32 ``(rows,)`` in ``[0, S_k]`` on
    their device, ``k`` a positive int, ``backend`` resolved (:func:`_resolve_topk_backend`).
    Returns int32 ``(rows, k)``."""
    rows, sk = scores.shape
    if rows == 0 or sk == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    if backend == "cudnn":
        picked = _cudnn_topk(scores, k, seq_lens, deterministic)
    else:
        step = max(1, _TORCH_TOPK_CHUNK_BYTES // (16 * sk))
        picked = torch.cat(
            [
                _torch_topk(scores[r : r + step], k, seq_lens[r : r + step], deterministic)
                for r in range(0, rows, step)
            ]
        ).to(torch.int32)
    if picked.shape[-1] < k:
        picked = torch.nn.functional.pad(picked, (0, k - picked.shape[-1]), value=-1)
    return picked
