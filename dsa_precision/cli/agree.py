"""``python -m dsa_precision agree --train A --infer B``: agreement of two saved top-k selections.

Each file holds one integer index tensor ``[..., k]`` (the index rule of
:mod:`dsa_precision.agreement`: keys ``>= 0``, ``-1`` = padding, no key twice in a row), e.g.
captured from an inference engine and from a training step on the same tokens: ``.pt``
(``torch.save`` of a tensor or of a dict of tensors) or ``.safetensors``. A file with several
tensors needs ``--key``. Replay files (``layer_NN`` tensors ``(T, k)``, plus ``cu_seqlens`` or
``seq_len``, as :func:`dsa_precision.capture.save_picks` writes them) are compared layer by
layer; their picks are checked against their token layout
(:meth:`dsa_precision.picks.TokenLayout.validate_indices`: causal, sequence-relative).
Every file is checked before anything is compared; a selection that compares no row (every row
padding) is an error.

Metrics (:func:`dsa_precision.topk_agreement`), over the rows whose inference set ``I`` is
non-empty (``T``: training's set): rows identical (share of rows with ``T == I``), member
agreement (``sum |T & I| / sum |I|``), flipped picks per row (``|I - T|``, mean and max).

``--scores S`` (training's float scores of the same rows: one ``[..., S_k]`` tensor for an index
file, ``layer_NN`` tensors ``(T, S_k)`` for replay files; keys a row cannot see hold ``-inf``, as
``indexer_scores`` returns them) also tells each differing row apart
(:func:`dsa_precision.classify_rows`): a tie (inference's set is a valid top-k of training's
scores: no precision can reproduce its choice), a precision difference, or an invalid set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..agreement import _validate_index_rows, topk_agreement
from ..capture.files import (
    ENGINE_FORMATS,
    _integer_indices,
    _picks_from_tensors,
    load_engine_output,
    read_tensors,
)
from ..engines import ENGINE_PROFILES
from ..picks import TokenLayout, TopkPicks
from . import CliError, print_json
from .report import _AGREEMENT_HEADERS, _AGREEMENT_LEGEND, _agreement_cells, _format_table

__all__ = ["register"]

# The differing rows' causes (with --scores), TopkAgreement's names.
_CAUSES = ("tie_rows", "precision_rows", "invalid_rows")
_CAUSES_LEGEND = (
    "tie, precision, invalid: differing rows where inference's set is a valid top-k of training's "
    "scores (a tie no precision reproduces), is not one, or breaks the index rule."
)


def _cli(flag: str, exc: Exception) -> CliError:
    """A loader's one-line error, as ``agree`` reports it (the flag first, no trailing period)."""
    return CliError(f"{flag} {' '.join(str(exc).split()).rstrip('.')}")


def _load_tensors(path: Path, flag: str) -> dict[str, torch.Tensor] | torch.Tensor:
    try:
        return read_tensors(path)
    except ValueError as exc:
        raise _cli(flag, exc) from None


def _replay(path: Path, flag: str) -> TopkPicks | None:
    """The layers and layout of a replay file, or ``None`` for a plain index file."""
    loaded = _load_tensors(path, flag)
    if not isinstance(loaded, dict):
        return None
    try:
        return _picks_from_tensors(loaded, str(path))
    except ValueError as exc:
        raise _cli(flag, exc) from None


def _validated(tensor: torch.Tensor, where: str, layout: TokenLayout | None) -> torch.Tensor:
    """The data check: the replay layout's (causal, sequence-relative keys) when there is one,
    else the index rule of :mod:`dsa_precision.agreement`."""
    try:
        if layout is None:
            _validate_index_rows(where, tensor)
        else:
            layout.validate_indices(where, tensor)
    except (TypeError, ValueError) as exc:
        raise CliError(" ".join(str(exc).split()).rstrip(".")) from None
    return tensor


def _load_indices(path: Path | str, *, flag: str = "file", key: str | None = None) -> torch.Tensor:
    """Load one top-k index tensor from ``path``, as ``int64`` on the CPU.

    Args:
        path: a ``.pt``/``.pth`` or ``.safetensors`` file holding a tensor or a dict of tensors.
        flag: how to name the file in error messages (``--train`` / ``--infer``).
        key: which tensor of a dict; required when there are several.

    Raises:
        CliError: one line naming the file and the problem.
    """
    path = Path(path)
    loaded = _load_tensors(path, flag)
    if isinstance(loaded, dict):
        if key is not None:
            if key not in loaded:
                raise CliError(
                    f"{flag} {path}: no tensor named {key!r}; it holds {', '.join(sorted(loaded))}"
                )
            tensor = loaded[key]
        elif len(loaded) == 1:
            tensor = next(iter(loaded.values()))
        elif not loaded:
            raise CliError(f"{flag} {path}: holds no tensor")
        else:
            raise CliError(
                f"{flag} {path}: holds {len(loaded)} tensors ({', '.join(sorted(loaded))}); "
                "pick one with --key"
            )
    else:
        tensor = loaded
    where = f"{flag} {path}"
    try:
        tensor = _integer_indices(tensor, where)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return _validated(tensor, where, None)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "agree",
        help="agreement of two saved top-k index tensors (training vs inference)",
        description=__doc__,
    )
    p.add_argument("--train", required=True, type=Path, metavar="A", help="training top-k file")
    p.add_argument("--infer", required=True, type=Path, metavar="B", help="inference top-k file")
    p.add_argument("--key", help="tensor name, for files holding several tensors")
    p.add_argument(
        "--engine",
        choices=sorted(ENGINE_PROFILES),
        help="the engine profile that produced --infer (recorded in the report)",
    )
    p.add_argument(
        "--min-agreement",
        type=float,
        metavar="X",
        help="gate: exit 1 when the member agreement of any layer (of the file, for a plain "
        "index file) is below X, a fraction in [0, 1]; the failing layers are named on stderr",
    )
    p.add_argument(
        "--infer-format",
        choices=ENGINE_FORMATS,
        help="--infer is an engine's own output (.json / .jsonl responses: SGLang's "
        "return_indexer_topk, vLLM's indexer top-k), read through dsa_precision.capture; --train "
        "is then a replay file of the same packed requests",
    )
    p.add_argument(
        "--scores",
        type=Path,
        metavar="S",
        help="training's scores of the same rows (a [..., S_k] tensor, or layer_NN tensors for "
        "replay files; -inf where a row sees no key): each differing row is then counted as a "
        "tie, a precision difference or an invalid inference set",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(func=_main)


def _engine_output(path: Path, engine: str) -> TopkPicks:
    """The picks of an engine's saved responses, packed as a replay file (capture adapters)."""
    try:
        return load_engine_output(path, engine=engine)
    except (OSError, TypeError, ValueError) as exc:
        raise CliError(f"--infer {path} (--infer-format {engine}): {exc}") from None


def _same_layout(a: TokenLayout, b: TokenLayout) -> bool:
    if a.seq_len is not None or b.seq_len is not None:
        return a.seq_len == b.seq_len
    assert a.cu_seqlens is not None and b.cu_seqlens is not None  # THD: both given
    return torch.equal(a.cu_seqlens.to(torch.int64), b.cu_seqlens.to(torch.int64))


def _describe_layout(layout: TokenLayout) -> str:
    if layout.seq_len is not None:
        return f"seq_len={layout.seq_len}"
    assert layout.cu_seqlens is not None  # THD
    cu = layout.cu_seqlens.tolist()
    return f"cu_seqlens={cu[:8]}{'...' if len(cu) > 8 else ''}"


def _pooled(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The agreement over the union of the rows of several ``TopkAgreement.as_dict()``."""
    rows = sum(m["rows"] for m in metrics)
    members = sum(m["members"] for m in metrics)
    common = sum(round(m["member_agreement"] * m["members"]) for m in metrics)
    identical = sum(round(m["rows_identical"] * m["rows"]) for m in metrics)
    flipped = sum(round(m["flipped_mean"] * m["rows"]) for m in metrics)
    return {
        "member_agreement": common / members if members else 1.0,
        "rows_identical": identical / rows if rows else 1.0,
        "flipped_mean": flipped / max(rows, 1),
        "flipped_max": max(m["flipped_max"] for m in metrics),
        "rows": rows,
        "members": members,
        "broken_rows": sum(m.get("broken_rows", 0) for m in metrics),
        **{
            cause: sum(m[cause] for m in metrics)
            for cause in _CAUSES
            if all(cause in m for m in metrics)
        },
    }


def _scores(path: Path | None, key: str | None, names: list[str]) -> dict[str, torch.Tensor]:
    """``--scores``: name -> float scores (``names``: ``[""]`` for an index file's one tensor,
    else the ``layer_NN`` names of replay files), each checked to be a floating tensor."""
    if path is None:
        return {}
    loaded = _load_tensors(path, "--scores")
    if not isinstance(loaded, dict):
        loaded = {"": loaded}
    elif names == [""]:
        if key is None and len(loaded) != 1:
            raise CliError(f"--scores {path} holds {sorted(loaded)}; pass --key to pick one")
        loaded = {"": loaded[key if key is not None else next(iter(loaded))]}
    out = {}
    for name in names:
        where = f"--scores {path}" + (f" {name}" if name else "")
        if name not in loaded:
            raise CliError(f"{where}: missing; give training's scores of every compared layer")
        t = loaded[name]
        if not t.is_floating_point():
            raise CliError(f"{where}: dtype {t.dtype}; give float scores (-inf for unseen keys)")
        out[name] = t
    return out


def _agreement(
    train: torch.Tensor, infer: torch.Tensor, scores: torch.Tensor | None, where: str
) -> dict[str, Any]:
    """``topk_agreement`` of one selection (with ``scores``: its differing rows' causes)."""
    if scores is not None and scores.shape[:-1] != train.shape[:-1]:
        raise CliError(
            f"{where}: scores of shape {tuple(scores.shape)} for picks of shape "
            f"{tuple(train.shape)}; give one row of scores [S_k] per row of picks"
        )
    return topk_agreement(train, infer, scores=scores).as_dict()


def _compare(
    train_path: Path,
    infer_path: Path,
    key: str | None,
    infer_format: str | None = None,
    scores_path: Path | None = None,
) -> tuple[list[tuple[str, dict]], list[int] | None]:
    """``([(name, TopkAgreement.as_dict())], shape)``: one row and the tensors' shape, or one row
    per layer (then "all" last) and ``None``. Every compared selection has at least one row."""
    train_replay = _replay(train_path, "--train")
    infer_replay: TopkPicks | None
    if infer_format is not None:
        infer_replay = _engine_output(infer_path, infer_format)
        if train_replay is None:
            raise CliError(
                f"--infer-format {infer_format}: --train {train_path} must be a replay file "
                "(layer_NN tensors with cu_seqlens, e.g. dsa_precision.capture.save_picks) of the "
                "same packed requests"
            )
    else:
        infer_replay = _replay(infer_path, "--infer")
    if (train_replay is None) != (infer_replay is None):
        raise CliError(
            "--train and --infer must both be replay files (layer_NN tensors) or both index files"
        )
    if train_replay is None:
        train = _load_indices(train_path, flag="--train", key=key)
        infer = _load_indices(infer_path, flag="--infer", key=key)
        if train.shape != infer.shape:
            raise CliError(
                f"shape mismatch: --train {tuple(train.shape)} vs --infer {tuple(infer.shape)}; "
                "compare selections of the same rows with the same k"
            )
        given = _scores(scores_path, key, [""]).get("")
        metrics = _agreement(train, infer, given, f"--scores {scores_path}")
        return [(train_path.name, _nonempty(metrics, f"--infer {infer_path}"))], list(train.shape)
    if key is not None:
        raise CliError(
            f"--key {key}: replay files (layer_NN tensors) are compared layer by layer, every "
            "layer; --key picks the tensor of a plain index file"
        )
    assert infer_replay is not None  # both replay files (checked above)
    if sorted(train_replay.indices) != sorted(infer_replay.indices):
        raise CliError(
            f"layers differ: --train has {sorted(train_replay.indices)}, "
            f"--infer {sorted(infer_replay.indices)}"
        )
    # Each file's picks against its own layout (the other's when it has none), then the layouts.
    train_layout = train_replay.layout or infer_replay.layout
    infer_layout = infer_replay.layout or train_replay.layout
    layers = {}
    for n in sorted(train_replay.indices):
        train = _validated(train_replay.indices[n], f"--train {train_path} layer {n}", train_layout)
        infer = _validated(infer_replay.indices[n], f"--infer {infer_path} layer {n}", infer_layout)
        if train.shape != infer.shape:
            raise CliError(
                f"layer {n}: shape mismatch --train {tuple(train.shape)} vs --infer "
                f"{tuple(infer.shape)}"
            )
        layers[n] = train, infer
    if (
        train_layout is not None
        and infer_layout is not None  # it is whenever train_layout is
        and not _same_layout(train_layout, infer_layout)
    ):
        raise CliError(
            f"--train has {_describe_layout(train_layout)}, --infer "
            f"{_describe_layout(infer_layout)}; the two files must hold picks of the same tokens"
        )
    layer_scores = _scores(scores_path, None, [f"layer_{n:02d}" for n in layers])
    rows = []
    for n, (train, infer) in layers.items():
        name = f"layer_{n:02d}"
        metrics = _agreement(train, infer, layer_scores.get(name), f"--scores {scores_path} {name}")
        rows.append((f"layer {n}", _nonempty(metrics, f"--infer {infer_path} layer {n}")))
    rows.append(("all", _pooled([m for _, m in rows])))
    return rows, None


def _nonempty(metrics: dict[str, Any], where: str) -> dict[str, Any]:
    if metrics["rows"] == 0:
        raise CliError(
            f"{where}: every row is -1 padding, so nothing is compared; save the engine's picks "
            "(at least one key in a row)"
        )
    return metrics


def _main(args: argparse.Namespace) -> int:
    gate = args.min_agreement
    if gate is not None and not (0.0 <= gate <= 1.0):
        raise CliError(f"--min-agreement {gate}: give a fraction in [0, 1], e.g. 0.999")
    results, shape = _compare(args.train, args.infer, args.key, args.infer_format, args.scores)
    overall = results[-1][1]
    # The gate covers every compared selection: each layer (and the pooled "all" row).
    failed = [] if gate is None else [n for n, m in results if m["member_agreement"] < gate]
    passed = None if gate is None else not failed
    engine = ENGINE_PROFILES[args.engine] if args.engine else None
    if args.json:
        print_json(
            {
                "train": str(args.train),
                "infer": str(args.infer),
                "engine": None if engine is None else engine.name,
                **({"shape": shape} if shape is not None else {}),
                "configs": [{"name": name, **metrics} for name, metrics in results],
                "min_agreement": gate,
                "passed": passed,
                "failed": None if gate is None else failed,
            }
        )
    else:
        where = f": shape {tuple(shape)}" if shape is not None else ", layer by layer"
        print(f"train {args.train} vs infer {args.infer}{where}")
        if engine is not None:
            print(f"  inference engine: {engine.name} ({engine.summary})")
        print(
            f"  compared: {overall['rows']} rows with a non-empty inference set, "
            f"{overall['members']} inference picks"
        )
        print()
        causes = [c for c in _CAUSES if c in overall]
        table = [
            [name, *_agreement_cells(metrics), *(str(metrics[c]) for c in causes)]
            for name, metrics in results
        ]
        headers = ["train", *_AGREEMENT_HEADERS, *(c.removesuffix("_rows") for c in causes)]
        print(_format_table(headers, table))
        print()
        print("\n".join(_AGREEMENT_LEGEND))
        if causes:
            print(_CAUSES_LEGEND)
    metrics = dict(results)
    for name in failed:
        print(
            f"{name}: member agreement {metrics[name]['member_agreement']:.6f} is below "
            f"--min-agreement {gate:g}",
            file=sys.stderr,
        )
    return 1 if failed else 0
