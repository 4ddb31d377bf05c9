"""How far training's log-probs are from the rollout's, per token, in the terms RL reads them.

With ``delta = log p_train - log p_rollout`` per token (the log-softmax of each side's logits at
the next token, :func:`_token_logprobs`) over the tokens of a mask::

    |delta| mean, p99, max     over the tokens
    mean delta                 per sequence, then over sequences (-mean delta is the k1
                               estimate of KL(rollout || train) on rollout samples)
    k3 KL                      per sequence mean of exp(delta) - 1 - delta (>= 0, Schulman's
                               low-variance estimate of the same KL), then over sequences
    clipped(lo, hi)            share of tokens whose importance ratio exp(delta) leaves
                               [1 - lo, 1 + hi]: PPO's clip range, eps = 0.2 and 0.1, and the
                               asymmetric GRPO / DAPO range [1 - 0.2, 1 + 0.28] (CLIP_RANGES)

Pure torch, no Megatron: :func:`_logprob_mismatch_stats` takes the two sides' log-probs of the
same tokens (``dsa_precision.megatron.logprobs`` runs a Megatron model twice to get them). The
statistics are computed in float64 from the float32 log-probs, read with one host
synchronisation; when the two sides are equal token for token every figure is exactly 0. A
comparison of no token (an empty batch, a mask that selects nothing) is no match: its figures are
NaN and ``tokens`` is 0, as :func:`~dsa_precision.megatron.topk_metrics` reports a layer of no
rows. Every argument is checked where it enters (types, dtypes, shapes, the packed boundaries'
values): an error names the argument, its value and what to pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from .checks import _check_positive_int, _check_real, _check_tensor

__all__ = ["LogprobMismatch"]

# name -> (low, high): a token is clipped when exp(delta) < 1 - low or exp(delta) > 1 + high.
_CLIP_RANGES: Mapping[str, tuple[float, float]] = {
    "ppo_0.2": (0.2, 0.2),
    "ppo_0.1": (0.1, 0.1),
    "dapo_0.2_0.28": (0.2, 0.28),
}
# Bytes of float32 logits one chunk of token_logprobs holds at most.
_CHUNK_BYTES = 1 << 30
_TOKEN_DTYPES = (torch.int32, torch.int64)


def _check_cu_seqlens(cu_seqlens: object, total: int, device: torch.device) -> torch.Tensor:
    """int64 ``cu_seqlens`` on ``device``, checked in its own dtype: a 1-D int32 / int64 tensor
    of ``n + 1 >= 2`` cumulative lengths that starts at 0, never decreases and ends at ``total``
    (the packed tokens). Reads the values (on a device tensor one host synchronisation)."""
    cu = _check_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype not in _TOKEN_DTYPES or cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu_seqlens is a {cu.dtype} tensor of shape {tuple(cu.shape)}; pass the (n + 1,) "
            "int32 / int64 cumulative lengths of the packed sequences, [0, len_0, len_0 + len_1, "
            "...]."
        )
    cu = cu.to(torch.int64)  # exact from int32
    steps = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((steps < 0).any()) or int(cu[-1]) != total:
        values = cu.tolist()
        shown = f"{values[:16]}{'...' if len(values) > 16 else ''}"
        raise ValueError(
            f"cu_seqlens = {shown}: packed cumulative lengths start at 0, never decrease and end "
            f"at the {total} tokens; pass the boundaries of these tokens' sequences."
        )
    return cu.to(device)


def _token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_bytes: int = _CHUNK_BYTES
) -> torch.Tensor:
    """float32 ``[...]``: ``log_softmax(logits)[..., label]`` per token.

    Args:
        logits: ``[..., V]`` float (BF16, FP16, FP32 or FP64; upcast to at least float32) over
            the whole vocabulary (gather a vocabulary-parallel output first).
        labels: ``[...]`` integer, the next token of each position; values outside ``[0, V)``
            (e.g. ``-100`` of an ignored position) give 0, to be masked by the caller.
        chunk_bytes: the float32 logits upcast at once (rows of ``V`` values), 1 GiB by default.
    """
    logits, labels = _check_tensor("logits", logits), _check_tensor("labels", labels)
    if not logits.is_floating_point():
        raise TypeError(f"logits has dtype {logits.dtype}; pass the model's float logits.")
    if labels.dtype not in _TOKEN_DTYPES:
        raise TypeError(f"labels has dtype {labels.dtype}; pass int64 token ids.")
    if logits.ndim < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} and labels {tuple(labels.shape)}; logits "
            "must be labels' shape plus the vocabulary, [..., V]."
        )
    if logits.device != labels.device:
        raise ValueError(f"logits are on {logits.device}, labels on {labels.device}.")
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}: an empty vocabulary (V = 0) has no "
            "log-probs; pass the logits over the whole vocabulary, [..., V] with V >= 1."
        )
    chunk_bytes = _check_positive_int("chunk_bytes", chunk_bytes)
    flat = logits.reshape(-1, vocab)
    ids = labels.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    ids = torch.where(valid, ids, 0)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = max(1, chunk_bytes // (vocab * 4))
    out = []
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows].to(dtype)
        picked = chunk.gather(-1, ids[start : start + rows, None])[:, 0]
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    lp = torch.cat(out) if out else flat.new_zeros(0, dtype=dtype)
    return torch.where(valid, lp, 0.0).to(torch.float32).reshape(labels.shape)


def _shifted_labels(
    tokens: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, mask)`` of next-token prediction: ``labels[..., t] = tokens[..., t + 1]``,
    ``mask`` False where no next token exists (the last position of each sequence).

    Args:
        tokens: ``[b, s]`` (BSHD, a sequence per row) or, with ``cu_seqlens``, ``[T]`` /
            ``[1, T]`` packed sequences, integer token ids.
        cu_seqlens: ``(n + 1,)`` cumulative lengths of the packed sequences (THD).
    """
    tokens = _check_tensor("tokens", tokens)
    if tokens.dtype not in _TOKEN_DTYPES or tokens.ndim not in (1, 2):
        raise ValueError(
            f"tokens is a {tokens.dtype} tensor of shape {tuple(tokens.shape)}; pass [b, s] "
            "(or packed [T] / [1, T] with cu_seqlens) integer token ids."
        )
    if cu_seqlens is not None and tokens.ndim == 2 and tokens.shape[0] != 1:
        raise ValueError(
            f"tokens have shape {tuple(tokens.shape)} with cu_seqlens; packed tokens are [T] or "
            "[1, T] (without cu_seqlens, [b, s] is a sequence per row)."
        )
    labels = torch.roll(tokens, -1, dims=-1)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    if cu_seqlens is None:
        if tokens.shape[-1]:  # no token, no label to leave out
            mask[..., -1] = False
        return labels, mask
    ends = _check_cu_seqlens(cu_seqlens, tokens.numel(), tokens.device)[1:] - 1
    flat = mask.reshape(-1)
    flat[ends[ends >= 0]] = False  # empty sequences end before they start: nothing to mask
    return labels, mask


@dataclasses.dataclass(frozen=True)
class LogprobMismatch:
    """:func:`_logprob_mismatch_stats` of one pair of runs, as Python numbers (module docstring)."""

    tokens: int  # tokens compared (the mask's); 0: every float figure below is NaN
    tokens_differing: int  # of which delta != 0
    sequences: int  # sequences with at least one compared token
    abs_mean: float  # mean |delta| over the tokens
    abs_p99: float  # 99th percentile of |delta| (linear interpolation, as numpy's default)
    abs_max: float  # max |delta|
    delta_mean: float  # mean over sequences of the sequence's mean delta
    kl_k3: float  # mean over sequences of the sequence's mean of exp(delta) - 1 - delta
    kl_k3_max_sequence: float  # the largest sequence's k3 estimate
    clipped: Mapping[str, float]  # CLIP_RANGES name -> share of tokens outside the range

    def as_dict(self) -> dict[str, object]:
        """The fields as JSON-ready Python values."""
        out = dataclasses.asdict(self)
        out["clipped"] = dict(self.clipped)
        return out


def _sequence_sums(values: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """float64 ``(n,)``: the sum of ``values`` ``(T,)`` float64 over each packed sequence (a
    cumulative sum, read at the boundaries: no accumulation by index)."""
    cs = torch.cat((values.new_zeros(1), values.cumsum(0)))
    return cs[cu[1:]] - cs[cu[:-1]]


def _quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of a sorted 1-D float64 tensor (numpy's linear interpolation; NaN of
    no value)."""
    n = sorted_values.numel()
    if n == 0:
        return sorted_values.new_full((), math.nan)
    pos = q * (n - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def _check_clip_ranges(clip_ranges: object) -> dict[str, tuple[float, float]]:
    """``clip_ranges`` as ``{name: (low, high)}`` of Python floats, checked: a mapping of string
    names to pairs of finite reals with ``0 <= low < 1`` and ``high >= 0``; a name of
    :data:`_CLIP_RANGES` keeps its bounds (the tables' columns are named by them)."""
    if not isinstance(clip_ranges, Mapping):
        raise TypeError(
            f"clip_ranges is a {type(clip_ranges).__name__}; pass a mapping name -> (low, high), "
            "e.g. dsa_precision.logprobs.CLIP_RANGES or {'ppo_0.3': (0.3, 0.3)}."
        )
    out = {}
    for name, bounds in clip_ranges.items():
        if not isinstance(name, str):
            raise TypeError(
                f"clip_ranges has the key {name!r} ({type(name).__name__}); name each range with "
                "a string."
            )
        where = f"clip_ranges[{name!r}]"
        if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
            raise TypeError(
                f"{where} = {bounds!r}; a range is a pair (low, high) of numbers, the ratio's "
                "bounds being 1 - low and 1 + high."
            )
        low, high = _check_real(f"{where} low", bounds[0]), _check_real(f"{where} high", bounds[1])
        if not (0.0 <= low < 1.0 and high >= 0.0):
            raise ValueError(
                f"{where} = ({low}, {high}); a range is (low, high) with 0 <= low < 1 and "
                "high >= 0, the ratio's bounds being 1 - low and 1 + high."
            )
        if name in _CLIP_RANGES and (low, high) != _CLIP_RANGES[name]:
            raise ValueError(
                f"{where} = ({low}, {high}), but {name!r} is CLIP_RANGES' {_CLIP_RANGES[name]} "
                "(the tables name its column by those bounds); give your range another name."
            )
        out[name] = (low, high)
    return out


def _logprob_mismatch_stats(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    clip_ranges: Mapping[str, tuple[float, float]] = _CLIP_RANGES,
) -> LogprobMismatch:
    """The mismatch statistics (module docstring) of ``delta = train - rollout``.

    Args:
        train_logprobs, rollout_logprobs: float ``[..., s]`` log-probs of the same tokens (e.g.
            :func:`_token_logprobs`); BSHD: each row of the last dimension is a sequence.
        mask: bool, their shape: the tokens to compare (``None``: all). A mask, never row
            indices: an integer or float tensor is refused (``mask.bool()`` of a 0/1 mask).
        cu_seqlens: ``(n + 1,)`` int32 / int64 cumulative lengths when the tokens are packed
            sequences (THD), over the flattened tokens: from 0, never decreasing, to their count.
        clip_ranges: name -> ``(low, high)``: a token is clipped when its ratio ``exp(delta)`` is
            below ``1 - low`` or above ``1 + high`` (default :data:`_CLIP_RANGES`).

    Returns:
        :class:`LogprobMismatch`; with no compared token (``tokens == 0``) its float figures
        are NaN: nothing was compared, which is no match.

    Raises:
        TypeError, ValueError: shapes, dtypes, devices, packed boundaries, a non-finite compared
            log-prob (named with its first token) or a clip range that is not a pair with
            ``0 <= low < 1``, ``high >= 0``.
    """
    train = _check_tensor("train_logprobs", train_logprobs)
    rollout = _check_tensor("rollout_logprobs", rollout_logprobs)
    for name, t in (("train_logprobs", train), ("rollout_logprobs", rollout)):
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; pass float log-probs.")
    if train.shape != rollout.shape or train.ndim == 0:
        raise ValueError(
            f"train_logprobs has shape {tuple(train.shape)} but rollout_logprobs "
            f"{tuple(rollout.shape)}; pass the log-probs of the same tokens, [..., s]."
        )
    if train.device != rollout.device:
        raise ValueError(
            f"train_logprobs are on {train.device}, rollout_logprobs on {rollout.device}."
        )
    if mask is None:
        mask = torch.ones_like(train, dtype=torch.bool)
    mask = _check_tensor("mask", mask)
    if mask.dtype != torch.bool or mask.shape != train.shape:
        raise ValueError(
            f"mask is a {mask.dtype} tensor of shape {tuple(mask.shape)}; pass a bool mask of "
            f"the log-probs' shape {tuple(train.shape)} (True: compare the token; a 0/1 mask as "
            "mask.bool(); not token indices)."
        )
    clip_ranges = _check_clip_ranges(clip_ranges)
    cu = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, train.numel(), train.device)
    mask = mask.to(train.device)
    delta = train.double() - rollout.double()
    bad = mask & ~torch.isfinite(delta)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{int(bad.sum())} compared tokens have a non-finite log-prob (the first at index "
            f"{at}: train {float(train[at])}, rollout {float(rollout[at])}); log-softmax of "
            "finite logits is finite: check the logits, or mask the token out."
        )
    delta = torch.where(mask, delta, 0.0)
    k3 = torch.expm1(delta) - delta  # exp(delta) - 1 - delta, without the cancellation
    if cu is None:
        shape = (math.prod(train.shape[:-1]), train.shape[-1])  # a sequence per row
        per_seq = mask.reshape(shape).sum(-1).double()
        seq_delta = delta.reshape(shape).sum(-1)
        seq_k3 = k3.reshape(shape).sum(-1)
    else:
        per_seq = _sequence_sums(mask.reshape(-1).double(), cu)
        seq_delta = _sequence_sums(delta.reshape(-1), cu)
        seq_k3 = _sequence_sums(k3.reshape(-1), cu)
    counted = per_seq > 0
    n_seq = counted.sum()
    denominator = per_seq.clamp_min(1)
    seq_mean_delta = torch.where(counted, seq_delta / denominator, 0.0)
    seq_mean_k3 = torch.where(counted, seq_k3 / denominator, 0.0)
    magnitudes = delta.abs()[mask].sort().values
    n_tok = magnitudes.numel()
    ratio = torch.exp(delta)
    nan = delta.new_full((), math.nan)  # no compared token: no figure, never a match
    clip_shares = []
    for low, high in clip_ranges.values():
        outside = mask & ((ratio < 1.0 - low) | (ratio > 1.0 + high))
        clip_shares.append(outside.sum().double() / n_tok if n_tok else nan)
    values = torch.stack(
        [
            (magnitudes > 0).sum().double(),
            n_seq.double(),
            magnitudes.mean() if n_tok else nan,
            _quantile(magnitudes, 0.99),
            magnitudes[-1] if n_tok else nan,
            seq_mean_delta.sum() / n_seq if n_tok else nan,  # n_tok > 0: n_seq > 0
            seq_mean_k3.sum() / n_seq if n_tok else nan,
            seq_mean_k3.max() if n_tok else nan,  # k3 >= 0: uncounted sequences' 0 is no max
            *clip_shares,
        ]
    ).tolist()  # the one host synchronisation
    differing, sequences, mean, p99, top, d_mean, k3_mean, k3_max, *clips = values
    return LogprobMismatch(
        tokens=n_tok,
        tokens_differing=int(differing),
        sequences=int(sequences),
        abs_mean=mean,
        abs_p99=p99,
        abs_max=top,
        delta_mean=d_mean,
        kl_k3=k3_mean,
        kl_k3_max_sequence=k3_max,
        clipped=dict(zip(clip_ranges, clips, strict=True)),
    )


# Columns of a log-prob mismatch table, from a LogprobMismatch (the default clip ranges).
_LOGPROB_HEADERS = ("|dlogp| mean", "p99", "max", "mean dlogp", "k3 KL", "clip 0.2",
                   "clip 0.1", "clip .2/.28", "tokens dlogp!=0")  # fmt: skip
_LOGPROB_LEGEND = (
    "dlogp = log p_train - log p_rollout per token (log-softmax at the next token); "
    "|dlogp| mean, p99, max over the tokens;",
    "mean dlogp, k3 KL: per sequence, mean of dlogp and of exp(dlogp) - 1 - dlogp, then over "
    "sequences (-mean dlogp: the k1 KL estimate);",
    "clip 0.2, 0.1, .2/.28: share of tokens whose ratio exp(dlogp) leaves [0.8, 1.2], "
    "[0.9, 1.1], [0.8, 1.28] (PPO eps 0.2 / 0.1, GRPO / DAPO);",
    "tokens dlogp!=0: tokens whose log-prob differs at all, of the tokens compared.",
)


_CLIP_HEADERS = dict(zip(_CLIP_RANGES, _LOGPROB_HEADERS[5:8], strict=True))


def _logprob_headers(names: Sequence[str] = tuple(_CLIP_RANGES)) -> tuple[str, ...]:
    """The columns of a log-prob mismatch table whose clip ranges are ``names`` (those of
    :data:`_CLIP_RANGES`: :data:`_LOGPROB_HEADERS`; another: ``clip <name>``)."""
    clips = (_CLIP_HEADERS.get(n, f"clip {n}") for n in names)
    return (*_LOGPROB_HEADERS[:5], *clips, _LOGPROB_HEADERS[-1])


def _number(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _logprob_cells(m: LogprobMismatch, names: Sequence[str] | None = None) -> list[str]:
    """The :func:`_logprob_headers` cells of one :class:`LogprobMismatch`; ``names``: its clip
    ranges, in the headers' order (default: all of them, in its order)."""
    names = tuple(m.clipped) if names is None else tuple(names)
    missing = [n for n in names if n not in m.clipped]
    if missing:
        raise ValueError(
            f"the statistics have no clip range {missing[0]!r} (they have {sorted(m.clipped)}); "
            "pass names of the clip_ranges they were computed with."
        )
    return [
        _number(m.abs_mean),
        _number(m.abs_p99),
        _number(m.abs_max),
        _number(m.delta_mean),
        _number(m.kl_k3),
        *(f"{100 * m.clipped[n]:.2f} %" for n in names),
        f"{m.tokens_differing}/{m.tokens}",
    ]
