"""The indexer's share of RL's train/inference log-prob mismatch: :func:`logprob_mismatch`.

Two forwards of the same weights on the same tokens: the rollout's, the engine's picks handed in
(a model built with ``dsa_indexer_topk_source="replay"``, :func:`~.replay.engine_topk`), and the
model's own, every layer computing its picks as configured (:func:`~.record.record_topk` records
them). Everything but the indexer is the same code, so ``delta = log p_train - log p_rollout``
per token is what the indexer contributes, and when every layer picks the engine's keys it is
exactly 0 on every token. The report holds the statistics of :mod:`dsa_precision.logprobs`
(|delta|, the KL estimates, the importance ratios' clip fractions), each layer's agreement with
the engine (:func:`dsa_precision.topk_agreement`) and where the rows and the log-probs differ
(their count and first tokens, as ``(sequence, position)``).

Both forwards run without gradients, with the models in eval mode (no dropout) and back in their
own mode after. A diagnostic: several host synchronisations, the logits of the whole batch held.
A model is a ``torch.nn.Module`` or Megatron's list of its chunks (virtual pipeline parallelism;
then ``forward`` runs them). Every argument is checked where it enters, before a forward runs:
tokens, labels (a negative label, the ``-100`` of an ignored position, is not compared; one past
the vocabulary is refused), ``loss_mask`` (a bool mask, never token indices), the picks' layout
and ``engine_rows`` (a bool mask of their rows). A report of no compared token has NaN figures
(no match) and says so in :meth:`LogprobReport.differences`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..agreement import _agreement_and_identical_rows, topk_agreement
from ..checks import _check_bool, _check_int_fits, _check_tensor, _describe
from ..logprobs import (
    _CLIP_RANGES,
    _LOGPROB_LEGEND,
    LogprobMismatch,
    _check_clip_ranges,
    _logprob_cells,
    _logprob_headers,
    _logprob_mismatch_stats,
    _shifted_labels,
    _token_logprobs,
)
from ..picks import TokenLayout, TopkPicks
from .record import record_topk
from .replay import engine_topk

__all__ = [
    "Forward",
    "LayerAgreement",
    "LogprobReport",
    "Model",
    "Where",
    "format_reports",
    "logprob_mismatch",
    "replay_logprobs",
]

# A model, or Megatron's list of its chunks (virtual pipeline parallelism).
Model = torch.nn.Module | Sequence[torch.nn.Module]
# forward(model) -> logits [*tokens.shape, V] (or [1, T, V] for packed [T] tokens).
Forward = Callable[[Any], torch.Tensor]
Where = tuple[int, int]  # (sequence, position in it)

_AGREEMENT = ("rows identical", "member agreement", "rows differ")


@dataclasses.dataclass(frozen=True)
class LayerAgreement:
    """One DSA layer's own picks against the engine's, on the tokens of the report."""

    layer: int  # Megatron's 1-based layer number
    agreement: Mapping[str, float | int]  # TopkAgreement.as_dict()
    rows_differing: int  # token rows whose set of keys is not the engine's (of the rows the
    # engine ran, TopkPicks.engine_rows, with a non-empty set: topk_agreement's rows)
    first_differing: tuple[Where, ...]  # the first of them, (sequence, position)
    # A "verify" model's differing rows by cause (topk_metrics: "tie_rows", its own boundary
    # tied, which no precision decides; "precision_rows", strict, so the engine's set is no top-k
    # of its scores: precision, an invalid set, or, past the first layer, inputs an earlier
    # layer's differing picks moved); None for a "compute" model.
    causes: Mapping[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready Python values."""
        return {
            "layer": self.layer,
            **dict(self.agreement),
            "rows_differing": self.rows_differing,
            "first_differing": [list(w) for w in self.first_differing],
            **({} if self.causes is None else {"causes": dict(self.causes)}),
        }


@dataclasses.dataclass(frozen=True)
class LogprobReport:
    """What :func:`logprob_mismatch` measured for one model (module docstring).

    ``delta`` and ``mask`` are tensors of the tokens' shape (float64 ``log p_train -
    log p_rollout``, 0 outside the mask; bool, the compared tokens), for plots; the rest are
    Python values (:meth:`as_dict`)."""

    name: str
    logprobs: LogprobMismatch
    layers: tuple[LayerAgreement, ...]
    picks: Mapping[str, float | int]  # TopkAgreement.as_dict() over every layer's rows
    first_logprob_differing: tuple[Where, ...]  # the first tokens with delta != 0
    delta: torch.Tensor = dataclasses.field(repr=False)
    mask: torch.Tensor = dataclasses.field(repr=False)

    @property
    def picks_identical(self) -> bool:
        """Whether every layer picked the engine's keys on every row."""
        return all(layer.rows_differing == 0 for layer in self.layers)

    def as_dict(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON-ready Python values."""
        return {
            "name": self.name,
            "logprobs": self.logprobs.as_dict(),
            "picks": dict(self.picks),
            "picks_identical": self.picks_identical,
            "layers": [layer.as_dict() for layer in self.layers],
            "first_logprob_differing": [list(w) for w in self.first_logprob_differing],
        }

    def table(self) -> str:
        """Per layer its agreement with the engine, then ``all``: every layer's rows and the
        log-prob statistics (a property of the whole model, so ``-`` on the layers' lines)."""
        headers = _logprob_headers(tuple(self.logprobs.clipped))
        blank = ["-"] * len(headers)
        rows = [
            [f"layer {layer.layer}", *_agreement_cells(layer.agreement, layer.rows_differing),
             *blank]
            for layer in self.layers
        ]  # fmt: skip
        differing = sum(layer.rows_differing for layer in self.layers)
        rows.append(["all", *_agreement_cells(self.picks, differing),
                     *_logprob_cells(self.logprobs)])  # fmt: skip
        return _format_table([self.name, *_AGREEMENT, *headers], rows)

    def differences(self) -> list[str]:
        """Where the picks and the log-probs differ, one line each (nothing when the picks are
        the engine's everywhere and no log-prob differs)."""
        lines = []
        if not self.logprobs.tokens:
            lines.append(
                f"{self.name}: no token compared (the mask selects none): the log-prob figures "
                "are NaN, no match; pass labels / loss_mask that select the tokens to compare"
            )
        for layer in self.layers:
            if layer.rows_differing:
                rows = int(layer.agreement["rows"])
                causes = ""
                if layer.causes is not None:
                    causes = (
                        f" ({layer.causes['tie_rows']} at a tie of its own scores, "
                        f"{layer.causes['precision_rows']} strict: precision, an invalid set, or "
                        "inputs an earlier layer moved)"
                    )
                lines.append(
                    f"{self.name}: layer {layer.layer}: {layer.rows_differing} of {rows} rows "
                    f"differ from the engine's picks{causes}, first at "
                    f"{_where(layer.first_differing)}"
                )
        if self.logprobs.tokens_differing:
            lines.append(
                f"{self.name}: log p differs on {self.logprobs.tokens_differing} of "
                f"{self.logprobs.tokens} tokens, first at {_where(self.first_logprob_differing)}"
            )
        return lines


def _where(places: Sequence[Where]) -> str:
    return ", ".join(f"{s}:{p}" for s, p in places) + " (sequence:position)"


def _agreement_cells(agreement: Mapping[str, float | int], differing: int) -> list[str]:
    return [
        f"{100 * agreement['rows_identical']:.2f} %",
        f"{100 * agreement['member_agreement']:.4f} %",
        str(differing),
    ]


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces between columns."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((cells[0].ljust(widths[0]), *rest)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def format_reports(reports: Sequence[LogprobReport], *, legend: bool = True) -> str:
    """One line per report (its name, every layer's agreement with the engine, the log-prob
    statistics), then the lines of :meth:`LogprobReport.differences` and, with ``legend``,
    what the columns mean. The reports share their clip ranges (one column each)."""
    if isinstance(reports, LogprobReport) or not all(isinstance(r, LogprobReport) for r in reports):
        raise TypeError(
            f"reports is {_describe(reports)}; pass a sequence of LogprobReport "
            "(logprob_mismatch's results)."
        )
    names = tuple(reports[0].logprobs.clipped) if reports else tuple(_CLIP_RANGES)
    for r in reports:
        if tuple(r.logprobs.clipped) != names:
            raise ValueError(
                f"report {r.name!r} has the clip ranges {list(r.logprobs.clipped)}, the first "
                f"{list(names)}; format reports measured with the same clip_ranges together."
            )
    rows = []
    for r in reports:
        differing = sum(layer.rows_differing for layer in r.layers)
        rows.append([r.name, *_agreement_cells(r.picks, differing), *_logprob_cells(r.logprobs)])
    text = [_format_table(["config", *_AGREEMENT, *_logprob_headers(names)], rows)]
    text += [line for r in reports for line in r.differences()]
    if legend:
        text += [
            "rows identical, member agreement: each layer's own picks against the engine's "
            "(dsa_precision.topk_agreement), over every layer's rows; rows differ: their count;",
            *_LOGPROB_LEGEND,
        ]
        custom = [n for n in names if n not in _CLIP_RANGES]
        if custom:
            text.append(
                f"clip {', '.join(custom)}: share of tokens whose ratio leaves [1 - low, 1 + high] "
                "of clip_ranges[name]."
            )
    return "\n".join(text)


# ------------------------------------------------------------------------------------ running


def _chunks(model: object, name: str) -> list[torch.nn.Module]:
    """The model's chunks: ``[model]``, or Megatron's list of model chunks (virtual pipeline
    parallelism) as given."""
    if isinstance(model, torch.nn.Module):
        return [model]
    if (
        isinstance(model, (list, tuple))
        and model
        and all(isinstance(m, torch.nn.Module) for m in model)
    ):
        return list(model)
    raise TypeError(
        f"{name} is {_describe(model)}; pass the model (a torch.nn.Module) or Megatron's list "
        "of its model chunks (virtual pipeline parallelism)."
    )


def _dsa_layers(model: Model, name: str) -> list[Any]:
    """The model's dsa-precision DSA layers (``PrecisionDSAttention``), found by the top-k
    source they were built with, as :func:`~.monitor.topk_metrics` finds them by their monitor."""
    modules: Iterator[Any] = (m for chunk in _chunks(model, name) for m in chunk.modules())
    layers = [m for m in modules if isinstance(getattr(m, "topk_source", None), str)]
    if not layers:
        raise ValueError(
            f"{name} has no dsa-precision DSA layer (PrecisionDSAttention); build its layer spec "
            "with dsa_precision.megatron.get_gpt_dsa_precision_block_spec or with_dsa_precision."
        )
    return layers


def _check_replaying(replay_model: Model) -> None:
    sources = {layer.topk_source for layer in _dsa_layers(replay_model, "replay_model")}
    if sources != {"replay"}:
        raise ValueError(
            f"replay_model's DSA layers have dsa_indexer_topk_source {sorted(sources)}; the "
            "rollout's run attends to the engine's picks: build it from "
            "dataclasses.replace(config, dsa_indexer_topk_source='replay') and load the same "
            "weights."
        )


def _check_computing(model: Model) -> None:
    replaying = [
        layer.layer_number for layer in _dsa_layers(model, "model") if layer.topk_source == "replay"
    ]
    if replaying:
        raise ValueError(
            f"model's DSA layers {replaying} replay the engine's picks "
            "(dsa_indexer_topk_source='replay'): compared with the rollout's run they would "
            "measure nothing; pass the model that computes its own picks ('compute' or 'verify')."
        )


def _check_tied_rows(model: Model, tied_rows: object) -> None:
    """``tied_rows`` exactly when the model's layers replay the engine's tied rows."""
    sources = {layer.topk_source for layer in _dsa_layers(model, "model")}
    wants = "replay_ties" in sources
    if tied_rows is None and wants:
        raise ValueError(
            "model's DSA layers use dsa_indexer_topk_source='replay_ties': pass tied_rows=, the "
            "engine's tied rows of these tokens (dsa_precision.capture.pack_tie_rows)."
        )
    if tied_rows is not None and not wants:
        raise ValueError(
            f"tied_rows= is read by layers with dsa_indexer_topk_source='replay_ties'; model's "
            f"DSA layers use {sorted(sources)}: nothing would read them."
        )
    if tied_rows is not None and (not isinstance(tied_rows, TopkPicks) or tied_rows.sent is None):
        raise TypeError(
            f"tied_rows is {_describe(tied_rows)}; pass pack_tie_rows' TopkPicks (the engine's "
            "tied rows and every row's digest)."
        )


def _named_parameters(model: Model, name: str) -> dict[str, torch.Tensor]:
    chunks = _chunks(model, name)
    if len(chunks) == 1:
        return dict(chunks[0].named_parameters())
    return {f"{i}.{k}": v for i, chunk in enumerate(chunks) for k, v in chunk.named_parameters()}


def _check_same_weights(model: Model, replay_model: Model) -> None:
    ours = _named_parameters(model, "model")
    theirs = _named_parameters(replay_model, "replay_model")
    if ours.keys() != theirs.keys():
        missing = sorted(ours.keys() ^ theirs.keys())
        raise ValueError(
            f"model and replay_model have different parameters ({missing[:3]}...); build both "
            "from one config (replay_model with dsa_indexer_topk_source='replay')."
        )
    for key, value in ours.items():
        other = theirs[key]
        if value.shape != other.shape or not torch.equal(value, other.to(value.device)):
            raise ValueError(
                f"replay_model's parameter {key!r} differs from model's: the comparison needs the "
                "same weights (replay_model.load_state_dict(model.state_dict()))."
            )


def _check_tokens(tokens: object) -> torch.Tensor:
    tokens = _check_tensor("tokens", tokens)
    if tokens.dtype not in (torch.int32, torch.int64) or tokens.ndim not in (1, 2):
        raise ValueError(
            f"tokens is a {tokens.dtype} tensor of shape {tuple(tokens.shape)}; pass the int64 "
            "token ids, [b, s] (BSHD) or packed [T] / [1, T]."
        )
    return tokens


def _layout_of(picks: TopkPicks | Mapping[int, torch.Tensor], tokens: torch.Tensor) -> TopkPicks:
    if not isinstance(picks, TopkPicks):
        if not isinstance(picks, Mapping) or tokens.ndim != 2:
            raise TypeError(
                f"picks is a {type(picks).__name__}; pass a TopkPicks (load_picks, "
                "load_engine_output, record_topk's .picks) or {layer: (T, k)} with [b, s] tokens."
            )
        picks = TopkPicks(dict(picks), TokenLayout(seq_len=tokens.shape[-1]))
    layout = picks.layout
    if layout is None:
        raise ValueError(
            "picks have no token layout; pass TopkPicks(..., layout=TokenLayout(seq_len=...) or "
            "TokenLayout(cu_seqlens=...))."
        )
    if layout.seq_len is not None:
        if tokens.ndim != 2 or tokens.shape[1] != layout.seq_len:
            raise ValueError(
                f"tokens have shape {tuple(tokens.shape)} but the picks seq_len={layout.seq_len}; "
                f"pass the [batch, {layout.seq_len}] tokens the picks were made on."
            )
    else:
        assert layout.cu_seqlens is not None  # THD
        total = int(layout.cu_seqlens[-1])
        if not (tokens.ndim == 1 or (tokens.ndim == 2 and tokens.shape[0] == 1)) or (
            tokens.numel() != total
        ):
            raise ValueError(
                f"tokens have shape {tuple(tokens.shape)} but the picks pack {total} tokens "
                f"(cu_seqlens); pass the packed [{total}] or [1, {total}] tokens."
            )
        layout.validate("picks' cu_seqlens")  # values on a device too: start 0, never decrease
    rows = picks.engine_rows
    if rows is not None and (
        not isinstance(rows, torch.Tensor)
        or rows.dtype != torch.bool
        or tuple(rows.shape) != (tokens.numel(),)
    ):
        raise ValueError(
            f"picks.engine_rows is {_describe(rows)}; pass a ({tokens.numel()},) bool mask of the "
            "token rows the engine computed (True: compared), not row indices."
        )
    return picks


def _default_forward(tokens: torch.Tensor, layout: TokenLayout, chunks: int) -> Forward:
    if layout.cu_seqlens is not None:
        raise ValueError(
            "packed (THD) picks: pass forward=lambda model: model(tokens, position_ids, None, "
            "packed_seq_params=PackedSeqParams(qkv_format='thd', ...)), the logits [1, T, V]."
        )
    if chunks > 1:
        raise ValueError(
            f"the model is {chunks} model chunks (virtual pipeline parallelism): pass "
            "forward=<a function of the chunks running your pipeline schedule forward only>, "
            "returning the logits [b, s, V]."
        )
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).expand(b, s)

    def forward(model: Model) -> torch.Tensor:
        (chunk,) = _chunks(model, "model")
        return chunk(tokens, positions, None)  # GPTModel: logits [b, s, V] without labels

    return forward


def _labels_and_mask(
    tokens: torch.Tensor,
    layout: TokenLayout,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if labels is None:
        labels, mask = _shifted_labels(tokens, cu_seqlens=layout.cu_seqlens)
    else:
        labels = _check_tensor("labels", labels)
        if labels.dtype not in (torch.int32, torch.int64) or labels.shape != tokens.shape:
            raise ValueError(
                f"labels is a {labels.dtype} tensor of shape {tuple(labels.shape)}, tokens "
                f"{tuple(tokens.shape)}; pass one int64 label (the next token) per token, "
                "negative (-100) where no log-prob is compared."
            )
        labels = labels.to(tokens.device)
        mask = labels >= 0  # the ignore_index convention (-100): not compared
    if loss_mask is not None:
        loss_mask = _check_tensor("loss_mask", loss_mask)
        if loss_mask.dtype != torch.bool or loss_mask.shape != tokens.shape:
            raise ValueError(
                f"loss_mask is a {loss_mask.dtype} tensor of shape {tuple(loss_mask.shape)}, "
                f"tokens {tuple(tokens.shape)}; pass a bool mask of the tokens' shape (True: "
                "compare its log-prob; Megatron's 0/1 float loss_mask as loss_mask.bool()), not "
                "token indices."
            )
        mask = mask & loss_mask.to(mask.device)
    return labels, mask


class _Eval:
    """The models in eval mode (no dropout) for the block, each back in its own mode after."""

    def __init__(self, *models: Model) -> None:
        self.models = [chunk for m in models for chunk in _chunks(m, "model")]
        self.modes = [m.training for m in self.models]

    def __enter__(self) -> None:
        for m in self.models:
            m.eval()

    def __exit__(self, *exc: object) -> None:
        for m, mode in zip(self.models, self.modes, strict=True):
            m.train(mode)


def _logprobs_of(
    model: Model,
    forward: Forward,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    logits = forward(model)
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        raise TypeError(
            f"forward returned {type(logits).__name__}; it must return the logits [b, s, V]."
        )
    if logits.shape[:-1] != labels.shape:
        if logits.shape[:-1] == (1, *labels.shape):  # packed [T] tokens, logits [1, T, V]
            logits = logits[0]
        else:
            raise ValueError(
                f"forward returned logits of shape {tuple(logits.shape)} for tokens of shape "
                f"{tuple(tokens.shape)}; return [*tokens.shape, V] over the whole vocabulary "
                "(gather a vocabulary-parallel output)."
            )
    labels = labels.to(logits.device)
    vocab = logits.shape[-1]
    past = labels >= vocab
    if mask is not None:
        past &= mask.to(logits.device)
    if bool(past.any()):
        at = tuple(int(i) for i in past.nonzero()[0])
        raise ValueError(
            f"labels[{', '.join(map(str, at))}] = {int(labels[at])} is past the vocabulary of the "
            f"logits ({vocab} entries); pass token ids in [0, {vocab}), a negative label (-100) "
            "where no log-prob is compared."
        )
    return _token_logprobs(logits, labels)


def replay_logprobs(
    replay_model: Model,
    tokens: torch.Tensor,
    picks: TopkPicks | Mapping[int, torch.Tensor],
    *,
    labels: torch.Tensor | None = None,
    forward: Forward | None = None,
) -> torch.Tensor:
    """float32, the tokens' shape: the log-probs of the rollout's run, ``replay_model`` (built
    with ``dsa_indexer_topk_source="replay"``) attending to ``picks`` (the engine's), at
    ``labels`` (default: the next token; 0 where there is none). Arguments as
    :func:`logprob_mismatch`'s; 0 where a label is negative (not compared)."""
    tokens = _check_tokens(tokens)
    picks = _layout_of(picks, tokens)
    assert picks.layout is not None  # _layout_of checked
    _check_replaying(replay_model)
    labels, mask = _labels_and_mask(tokens, picks.layout, labels, None)
    forward = forward or _default_forward(
        tokens, picks.layout, len(_chunks(replay_model, "replay_model"))
    )
    with torch.no_grad(), _Eval(replay_model), engine_topk(picks):
        return _logprobs_of(replay_model, forward, tokens, labels, mask)


def _places(rows: torch.Tensor, layout: TokenLayout, limit: int) -> tuple[Where, ...]:
    """``(sequence, position)`` of the first ``limit`` token rows of ``rows`` (packed or
    batch-major row numbers, ascending)."""
    first = rows[:limit].tolist()
    if layout.seq_len is not None:
        return tuple((r // layout.seq_len, r % layout.seq_len) for r in first)
    assert layout.cu_seqlens is not None  # THD
    starts = layout.cu_seqlens.tolist()
    places = []
    for r in first:
        seq = next(i for i in range(len(starts) - 1) if starts[i] <= r < starts[i + 1])
        places.append((seq, r - starts[seq]))
    return tuple(places)


def _layer_agreements(
    own: TopkPicks,
    engine: TopkPicks,
    layout: TokenLayout,
    first_tokens: int,
    causes: Mapping[int, Mapping[str, int]] | None = None,
) -> tuple[tuple[LayerAgreement, ...], dict[str, float | int]]:
    if own.tokens is not None:
        raise NotImplementedError(
            "logprob_mismatch: the model's layers hold only some token rows (context "
            "parallelism); run it on one rank holding every token of the sequences."
        )
    layers, pooled_own, pooled_engine = [], [], []
    for n, mine in sorted(own.indices.items()):
        if n not in engine.indices:
            raise ValueError(
                f"the engine's picks hold no layer {n} (they have {sorted(engine.indices)}); "
                "pass the picks of every top-k-computing DSA layer."
            )
        theirs = engine.indices[n].to(device=mine.device, dtype=torch.int64)
        mine = mine.to(torch.int64)
        if theirs.shape[0] != mine.shape[0] or theirs.shape[1] > mine.shape[1]:
            raise ValueError(
                f"layer {n}: the engine's picks are {tuple(theirs.shape)}, the model's own "
                f"{tuple(mine.shape)}; pass one row per token and at most dsa_indexer_topk keys."
            )
        theirs = torch.nn.functional.pad(theirs, (0, mine.shape[1] - theirs.shape[1]), value=-1)
        rows = torch.arange(mine.shape[0], device=mine.device)
        if engine.engine_rows is not None:  # rows the engine never ran (a sequence's last
            computed = engine.engine_rows.to(mine.device)  # token) are not compared
            rows, mine, theirs = rows[computed], mine[computed], theirs[computed]
        agreement, same = _agreement_and_identical_rows(mine, theirs)
        # A row whose engine set is empty is not compared (topk_agreement's rows, verify's).
        differing = rows[~same & (theirs >= 0).any(-1)]
        layers.append(
            LayerAgreement(
                layer=n,
                agreement=agreement.as_dict(),
                rows_differing=int(differing.numel()),
                first_differing=_places(differing, layout, first_tokens),
                causes=None if causes is None else causes.get(n),
            )
        )
        pooled_own.append(mine)
        pooled_engine.append(theirs)
    if not layers:
        raise ValueError(
            "the model's forward recorded no DSA layer's picks; is it a model with DSA layers "
            "that compute their top-k?"
        )
    pooled = topk_agreement(torch.cat(pooled_own), torch.cat(pooled_engine)).as_dict()
    return tuple(layers), pooled


def logprob_mismatch(
    model: Model,
    tokens: torch.Tensor,
    picks: TopkPicks | Mapping[int, torch.Tensor],
    *,
    replay_model: Model | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    forward: Forward | None = None,
    name: str = "model",
    first_tokens: int = 8,
    check_weights: bool = True,
    clip_ranges: Mapping[str, tuple[float, float]] = _CLIP_RANGES,
    tied_rows: TopkPicks | None = None,
) -> LogprobReport:
    """The log-prob mismatch of ``model``'s own picks against the engine's ``picks`` (module
    docstring).

    Args:
        model: the model under test, its DSA layers computing their picks (``"compute"`` or
            ``"verify"``), built with the dsa-precision specs; or Megatron's list of its model
            chunks (virtual pipeline parallelism, with a ``forward`` that runs them). A
            ``"verify"`` model is handed ``picks`` for its forward and each layer's differing
            rows come with their cause (:attr:`LayerAgreement.causes`; its counters are reset).
        tokens: int64 ``[b, s]`` (BSHD) or, for packed picks (``cu_seqlens``), ``[T]`` /
            ``[1, T]``: the tokens the engine's picks were made on, rows in their order.
        picks: the engine's picks of those tokens: a :class:`~dsa_precision.picks.TopkPicks`
            (``load_picks``, ``load_engine_output``) or ``{layer: (T, k)}`` for ``[b, s]`` tokens.
        replay_model: the same model and weights built with ``dsa_indexer_topk_source=
            "replay"``: the rollout's run. Or, instead,
        rollout_logprobs: float ``[tokens' shape]`` log-probs of the rollout's run already
            computed (:func:`replay_logprobs`; or the engine's own, and then ``delta`` holds more
            than the indexer's share).
        labels: int64, the tokens' shape: the token each position's log-prob is read at
            (default: the next token, the last position of each sequence left out); a negative
            label (``-100``, Megatron's and HF's ignore index) is not compared.
        loss_mask: bool, the tokens' shape: the tokens to compare (e.g. the response tokens); a
            mask, never token indices (a float 0/1 mask as ``loss_mask.bool()``).
        forward: ``forward(model) -> logits [*tokens.shape, V]``; default ``model(tokens,
            positions, None)`` (BSHD; packed tokens need one building ``PackedSeqParams``).
        name: the report's label (a configuration's name).
        first_tokens: how many differing rows and tokens each report names.
        check_weights: refuse a ``replay_model`` whose parameters differ from ``model``'s.
        clip_ranges: the importance ratio's ranges (:data:`dsa_precision.logprobs._CLIP_RANGES`).
        tied_rows: for a ``model`` whose DSA layers use ``dsa_indexer_topk_source=
            "replay_ties"`` (and only then): the engine's tied rows of these tokens
            (:func:`~dsa_precision.capture.pack_tie_rows`), handed to its own forward.

    Returns:
        :class:`LogprobReport`; with no compared token its log-prob figures are NaN.
    """
    tokens = _check_tokens(tokens)
    if not isinstance(name, str):
        raise TypeError(f"name is {_describe(name)}; pass the report's label, a str.")
    first_tokens = _check_int_fits("first_tokens", first_tokens, high=None)
    check_weights = _check_bool("check_weights", check_weights)
    clip_ranges = _check_clip_ranges(clip_ranges)
    if forward is not None and not callable(forward):
        raise TypeError(f"forward is {_describe(forward)}; pass forward(model) -> logits.")
    picks = _layout_of(picks, tokens)
    layout = picks.layout
    assert layout is not None  # _layout_of checked
    if (replay_model is None) == (rollout_logprobs is None):
        raise ValueError(
            "logprob_mismatch compares with the rollout's run: pass replay_model (the model "
            "built with dsa_indexer_topk_source='replay') or rollout_logprobs, exactly one."
        )
    _check_computing(model)
    _check_tied_rows(model, tied_rows)
    if replay_model is not None:
        _check_replaying(replay_model)
        if check_weights:
            _check_same_weights(model, replay_model)
    forward = forward or _default_forward(tokens, layout, len(_chunks(model, "model")))
    labels, mask = _labels_and_mask(tokens, layout, labels, loss_mask)
    if rollout_logprobs is None:
        assert replay_model is not None  # exactly one of the two
        rollout_logprobs = replay_logprobs(
            replay_model, tokens, picks, labels=labels, forward=forward
        )
    else:
        rollout_logprobs = _check_tensor("rollout_logprobs", rollout_logprobs)
        if not rollout_logprobs.is_floating_point() or rollout_logprobs.shape != tokens.shape:
            raise ValueError(
                f"rollout_logprobs is a {rollout_logprobs.dtype} tensor of shape "
                f"{tuple(rollout_logprobs.shape)}, tokens {tuple(tokens.shape)}; pass one float "
                "log-prob per token (replay_logprobs')."
            )
    dsa_layers = _dsa_layers(model, "model")
    # verify compares each layer's own picks with the engine's as it runs: by cause
    monitors = (
        {layer.layer_number: layer.topk_monitor for layer in dsa_layers}
        if {layer.topk_source for layer in dsa_layers} == {"verify"}
        else None
    )
    if tied_rows is not None:
        handed: Any = engine_topk(tied_rows)
    elif monitors is not None:
        for monitor in monitors.values():
            monitor.reset()  # the counters of this forward alone
        handed = engine_topk(picks)
    else:
        handed = contextlib.nullcontext()
    with torch.no_grad(), _Eval(model), record_topk() as recorder, handed:
        train = _logprobs_of(model, forward, tokens, labels, mask)
    causes = None if monitors is None else {n: m.causes() for n, m in monitors.items()}
    layers, pooled = _layer_agreements(recorder.picks, picks, layout, first_tokens, causes)
    rollout = rollout_logprobs.to(train.device)
    mask = mask.to(train.device)
    stats = _logprob_mismatch_stats(
        train, rollout, mask=mask, cu_seqlens=layout.cu_seqlens, clip_ranges=clip_ranges
    )
    delta = torch.where(mask, train.double() - rollout.double(), 0.0)
    differing = (delta.reshape(-1) != 0).nonzero()[:, 0]
    return LogprobReport(
        name=name,
        logprobs=stats,
        layers=layers,
        picks=pooled,
        first_logprob_differing=_places(differing, layout, first_tokens),
        delta=delta,
        mask=mask,
    )
