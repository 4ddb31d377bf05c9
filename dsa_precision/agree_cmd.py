"""``python -m dsa_precision agree --train A --infer B``: agreement of two saved top-k selections.

Each file holds one integer index tensor ``[..., k]`` (``-1`` = padding, indices unique within a
row), e.g. captured from an inference engine and from a training step on the same tokens:
``.pt`` (``torch.save`` of a tensor or of a dict of tensors) or ``.safetensors``. A file with
several tensors needs ``--key``. Metrics as :func:`dsa_precision.topk_agreement`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ._report import AGREEMENT_HEADERS, agreement_cells, format_table
from .agreement import topk_agreement
from .cli import CliError

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
        "--min-agreement",
        type=float,
        metavar="X",
        help="gate: exit 1 when the member agreement is below X (a fraction in [0, 1])",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    gate = args.min_agreement
    if gate is not None and not (0.0 <= gate <= 1.0):
        raise CliError(f"--min-agreement {gate}: give a fraction in [0, 1], e.g. 0.999")
    train = load_indices(args.train, flag="--train", key=args.key)
    infer = load_indices(args.infer, flag="--infer", key=args.key)
    if train.shape != infer.shape:
        raise CliError(
            f"shape mismatch: --train {tuple(train.shape)} vs --infer {tuple(infer.shape)}; "
            "compare selections of the same rows with the same k"
        )
    metrics = topk_agreement(train, infer).as_dict()
    passed = None if gate is None else metrics["member_agreement"] >= gate
    if args.json:
        out: dict[str, Any] = {
            "train": str(args.train),
            "infer": str(args.infer),
            "shape": list(train.shape),
            "configs": [{"name": args.train.name, **metrics}],
            "min_agreement": gate,
            "passed": passed,
        }
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"train {args.train} vs infer {args.infer}: shape {tuple(train.shape)}")
        print(
            f"  compared: {metrics['rows']} rows with a non-empty inference set, "
            f"{metrics['members']} inference picks"
        )
        print()
        print(
            format_table(
                ["train", *AGREEMENT_HEADERS], [[args.train.name, *agreement_cells(metrics)]]
            )
        )
    if passed is False:
        print(
            f"member agreement {metrics['member_agreement']:.6f} is below --min-agreement {gate:g}",
            file=sys.stderr,
        )
        return 1
    return 0
