"""``python -m dsa_precision agree --train A --infer B``: agreement of two saved top-k selections.

Each file holds one integer index tensor ``[..., k]`` (``-1`` = padding, indices unique within a
row), e.g. captured from an inference engine and from a training step on the same tokens:
``.pt`` (``torch.save`` of a tensor or of a dict of tensors) or ``.safetensors``. A file with
several tensors needs ``--key``. Replay files (``layer_NN`` tensors, as
:func:`dsa_precision.megatron.save_topk` writes them) are compared layer by layer. Metrics as
:func:`dsa_precision.topk_agreement`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..agreement import topk_agreement
from ..engines import ENGINE_PROFILES
from . import CliError
from .report import AGREEMENT_HEADERS, agreement_cells, format_table

__all__ = ["load_indices", "register"]

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_SUFFIXES = (".pt", ".pth", ".safetensors")


def _load_tensors(path: Path, flag: str) -> dict[str, torch.Tensor] | torch.Tensor:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise CliError(
            f"{flag} {path}: unknown file type {suffix or '(none)'!r}; use .pt or .safetensors"
        )
    if not path.is_file():
        raise CliError(f"{flag} {path}: no such file")
    if suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CliError(
                f"{flag} {path}: reading .safetensors needs the safetensors package "
                "(pip install 'dsa-precision[io]')"
            ) from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CliError(f"{flag} {path}: not a readable safetensors file ({exc})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors, or objects weights_only refuses
        msg = " ".join(str(exc).split())[:200]
        raise CliError(f"{flag} {path}: not a readable torch file ({msg})") from None
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    raise CliError(
        f"{flag} {path}: holds a {type(obj).__name__}; save a tensor or a dict of tensors"
    )


def _layers(path: Path, flag: str) -> dict[int, torch.Tensor] | None:
    """The per-layer tensors of a replay file, or ``None`` for a plain index file."""
    loaded = _load_tensors(path, flag)
    if not isinstance(loaded, dict) or not any(k.startswith("layer_") for k in loaded):
        return None
    layers = {}
    for key in loaded:
        if key.startswith("layer_"):
            layers[int(key.removeprefix("layer_"))] = _check_indices(loaded[key], path, flag)
    return layers


def load_indices(path: Path | str, *, flag: str = "file", key: str | None = None) -> torch.Tensor:
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
    return _check_indices(tensor, path, flag)


def _check_indices(tensor: torch.Tensor, path: Path, flag: str) -> torch.Tensor:
    if tensor.dtype not in _INT_DTYPES:
        raise CliError(
            f"{flag} {path}: dtype {str(tensor.dtype).removeprefix('torch.')}; top-k indices "
            "must be an integer tensor (int32 or int64, -1 = padding)"
        )
    if tensor.ndim == 0:
        raise CliError(f"{flag} {path}: a 0-d tensor; expected [..., k] indices")
    tensor = tensor.to(torch.int64)
    if tensor.numel() and int(tensor.min()) < -1:
        raise CliError(f"{flag} {path}: holds index {int(tensor.min())}; indices are >= 0, -1 pads")
    rows = tensor.reshape(-1, tensor.shape[-1]).sort(dim=-1).values
    if bool(((rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)).any()):
        raise CliError(f"{flag} {path}: a row repeats an index; top-k rows hold distinct keys")
    return tensor


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "agree",
        help="agreement of two saved top-k index tensors (training vs inference)",
        description=(
            "Load two top-k index tensors of the same shape [..., k] (-1 = padding) from .pt or "
            ".safetensors files and print their agreement, over the rows whose inference set is "
            "non-empty: rows identical (share of rows with the same set), member agreement "
            "(sum |T & I| / sum |I|) and flipped picks per row (|I - T|, mean and max)."
        ),
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
        help="gate: exit 1 when the member agreement is below X (a fraction in [0, 1])",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(func=main)


def _compare(
    train_path: Path, infer_path: Path, key: str | None
) -> tuple[list[tuple[str, dict]], list[int] | None]:
    """``([(name, TopkAgreement.as_dict())], shape)``: one row and the tensors' shape, or one row
    per layer (then "all" last) and ``None``."""
    train_layers, infer_layers = _layers(train_path, "--train"), _layers(infer_path, "--infer")
    if (train_layers is None) != (infer_layers is None):
        raise CliError(
            "--train and --infer must both be replay files (layer_NN tensors) or both index files"
        )
    if train_layers is None:
        train = load_indices(train_path, flag="--train", key=key)
        infer = load_indices(infer_path, flag="--infer", key=key)
        if train.shape != infer.shape:
            raise CliError(
                f"shape mismatch: --train {tuple(train.shape)} vs --infer {tuple(infer.shape)}; "
                "compare selections of the same rows with the same k"
            )
        return [(train_path.name, topk_agreement(train, infer).as_dict())], list(train.shape)
    if sorted(train_layers) != sorted(infer_layers):
        raise CliError(
            f"layers differ: --train has {sorted(train_layers)}, --infer {sorted(infer_layers)}"
        )
    rows, trains, infers = [], [], []
    for n in sorted(train_layers):
        train, infer = train_layers[n], infer_layers[n]
        if train.shape != infer.shape:
            raise CliError(
                f"layer {n}: shape mismatch {tuple(train.shape)} vs {tuple(infer.shape)}"
            )
        rows.append((f"layer {n}", topk_agreement(train, infer).as_dict()))
        trains.append(train.reshape(-1, train.shape[-1]))
        infers.append(infer.reshape(-1, infer.shape[-1]))
    if len({t.shape[-1] for t in trains}) == 1:
        rows.append(("all", topk_agreement(torch.cat(trains), torch.cat(infers)).as_dict()))
    return rows, None


def main(args: argparse.Namespace) -> int:
    gate = args.min_agreement
    if gate is not None and not (0.0 <= gate <= 1.0):
        raise CliError(f"--min-agreement {gate}: give a fraction in [0, 1], e.g. 0.999")
    results, shape = _compare(args.train, args.infer, args.key)
    overall = results[-1][1]
    passed = None if gate is None else overall["member_agreement"] >= gate
    engine = ENGINE_PROFILES[args.engine] if args.engine else None
    if args.json:
        out: dict[str, Any] = {
            "train": str(args.train),
            "infer": str(args.infer),
            "engine": None if engine is None else engine.name,
            **({"shape": shape} if shape is not None else {}),
            "configs": [{"name": name, **metrics} for name, metrics in results],
            "min_agreement": gate,
            "passed": passed,
        }
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
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
        table = [[name, *agreement_cells(metrics)] for name, metrics in results]
        print(format_table(["train", *AGREEMENT_HEADERS], table))
    if passed is False:
        print(
            f"member agreement {overall['member_agreement']:.6f} is below --min-agreement {gate:g}",
            file=sys.stderr,
        )
        return 1
    return 0
