"""Picks on disk: replay files (:func:`save_picks` / :func:`load_picks`) and the engines' saved
responses (:func:`load_engine_output`), each read into a :class:`~dsa_precision.picks.TopkPicks`.

A replay file is a ``.pt`` or ``.safetensors`` dict of ``layer_NN`` -> ``(T, k)`` integer tensors
plus ``cu_seqlens`` (THD) or ``seq_len`` (BSHD); ``dsa-precision agree`` compares two of them, or
one with an engine's output, layer by layer. Reading checks host facts only (file type, tensor
names, dtypes, shapes, the layout); the causal range of the picks is
:meth:`~dsa_precision.picks.TokenLayout.validate_indices`'. Errors are ``ValueError`` naming the
file. Needs no Megatron.
"""

from __future__ import annotations

import json
import numbers
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..picks import TokenLayout, TopkPicks
from .pack import _int_at_least
from .sglang import from_sglang
from .vllm import decode_vllm_indexer_topk, from_vllm

__all__ = [
    "ENGINE_FORMATS",
    "load_engine_output",
    "load_picks",
    "read_tensors",
    "readable_file",
    "save_picks",
]

ENGINE_FORMATS = ("sglang", "vllm")
_TENSOR_SUFFIXES = (".pt", ".pth", ".safetensors")
# Integer dtypes a saved selection may hold (read as int64).
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_LAYER = re.compile(r"layer_(\d+)")
_LAYOUT_KEYS = ("cu_seqlens", "seq_len")


# ------------------------------------------------------------------------------ replay files


def _layer_entry(layer: object, picks: object) -> tuple[int, torch.Tensor]:
    """``(layer number, picks)`` of one entry of ``TopkPicks.indices`` to save: a 1-based
    integer key (NumPy integers taken as ints) and an integer tensor."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 1:
        raise ValueError(
            f"save_picks: the layer key {layer!r} ({type(layer).__name__}) is not a layer "
            "number; a replay file names each layer layer_NN by Megatron's 1-based layer number, "
            "so key the picks by ints >= 1."
        )
    if not isinstance(picks, torch.Tensor) or picks.dtype not in _INT_DTYPES:
        raise TypeError(
            f"save_picks: layer {int(layer)} holds {type(picks).__name__}"
            f"{' ' + str(picks.dtype) if isinstance(picks, torch.Tensor) else ''}; pass (T, k) "
            "integer picks."
        )
    return int(layer), picks


def save_picks(path: str | Path, picks: TopkPicks) -> None:
    """Write ``picks`` as a replay file (``.safetensors`` by suffix, else ``torch.save``):
    ``layer_NN`` -> ``(T, k)`` tensors, plus ``cu_seqlens`` or ``seq_len`` when it has a layout.
    Its folder must exist; ``ValueError`` naming the path when it cannot be written."""
    if not isinstance(picks, TopkPicks):
        raise TypeError(
            f"save_picks takes a TopkPicks (record_topk's .picks, the capture adapters' result), "
            f"got {type(picks).__name__}."
        )
    if picks.sent is not None:
        raise ValueError(
            "save_picks: these picks hold the engine's tied rows only (pack_tie_rows), not a "
            "replay file's every row; store the engine's frames instead (TieRows.to_bytes per "
            "request and layer, TieRows.from_bytes to read them back)."
        )
    entries = sorted((_layer_entry(n, t) for n, t in picks.indices.items()), key=lambda e: e[0])
    tensors = {f"layer_{n:02d}": t.detach().cpu().contiguous() for n, t in entries}
    if picks.cu_seqlens is not None:
        tensors["cu_seqlens"] = picks.cu_seqlens.detach().cpu().to(torch.int64)
    if picks.seq_len is not None:
        tensors["seq_len"] = torch.tensor([picks.seq_len], dtype=torch.int64)
    path = Path(path)
    if path.suffix.lower() not in _TENSOR_SUFFIXES:
        raise ValueError(f"{path}: save picks as .pt, .pth or .safetensors, got {path.suffix!r}.")
    if path.is_dir():
        raise ValueError(f"{path}: a directory; pass the path of the file to write.")
    if not path.parent.is_dir():
        raise ValueError(
            f"{path}: the folder {path.parent} does not exist; create it first (mkdir -p)."
        )
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(path))
        else:
            torch.save(tensors, path)
    except Exception as exc:  # OSError, torch's RuntimeError, safetensors' own error type
        msg = " ".join(str(exc).split())[:200]
        raise ValueError(f"{path}: cannot be written ({msg}).") from None


def read_tensors(path: str | Path) -> dict[str, torch.Tensor] | torch.Tensor:
    """The tensor, or the dict of tensors, saved in ``path`` (``.pt`` / ``.pth`` through
    ``torch.load(weights_only=True)``, or ``.safetensors``), on the CPU."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _TENSOR_SUFFIXES:
        raise ValueError(
            f"{path}: unknown file type {suffix or '(none)'!r}; use .pt or .safetensors"
        )
    readable_file(path, "a .pt or .safetensors file of picks")
    if suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(
                f"{path}: reading .safetensors needs the safetensors package "
                "(pip install 'dsa-precision[io]')"
            ) from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors, or objects weights_only refuses
        msg = " ".join(str(exc).split())[:200]
        raise ValueError(f"{path}: not a readable torch file ({msg})") from None
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in obj:
            if not isinstance(key, str):
                raise ValueError(
                    f"{path}: key {key!r} ({type(key).__name__}) is not a string; name "
                    "the tensors with strings (layer_NN in a replay file)"
                )
        return obj
    raise ValueError(f"{path}: holds a {type(obj).__name__}; save a tensor or a dict of tensors")


def _integer_indices(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """Host-side facts of a saved selection: an integer tensor ``[..., k]``, k >= 1; as int64."""
    if tensor.dtype not in _INT_DTYPES:
        raise ValueError(
            f"{where}: dtype {str(tensor.dtype).removeprefix('torch.')}; top-k indices "
            "must be an integer tensor (int32 or int64, -1 = padding)"
        )
    if tensor.ndim == 0:
        raise ValueError(f"{where}: a 0-d tensor; expected [..., k] indices")
    if tensor.shape[-1] == 0:
        raise ValueError(
            f"{where}: shape {tuple(tensor.shape)} has k = 0 slots per row; a top-k selection "
            "holds at least one (-1 pads a row with fewer keys)"
        )
    return tensor.to(torch.int64)


def _layout(loaded: Mapping[str, torch.Tensor], where: str) -> TokenLayout | None:
    if not any(key in loaded for key in _LAYOUT_KEYS):
        return None
    seq_len = loaded.get("seq_len")
    tokens = None
    if seq_len is not None:
        if seq_len.numel() != 1 or seq_len.dtype not in _INT_DTYPES:
            raise ValueError(
                f"{where}: seq_len is a {str(seq_len.dtype).removeprefix('torch.')} tensor of "
                f"shape {tuple(seq_len.shape)}; save one integer (tokens per sequence)"
            )
        tokens = int(seq_len.reshape(()))
    try:
        return TokenLayout(cu_seqlens=loaded.get("cu_seqlens"), seq_len=tokens)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _picks_from_tensors(loaded: Mapping[str, torch.Tensor], where: str) -> TopkPicks | None:
    """The picks of a replay file's tensors (``layer_NN`` int64, and the layout when it has one),
    or ``None`` when they are not a replay file (no ``layer_NN`` tensor); ``where`` names the
    file in errors."""
    if not any(k.startswith("layer_") for k in loaded):
        return None
    layers: dict[int, torch.Tensor] = {}
    names: dict[int, str] = {}
    for key, tensor in loaded.items():
        if key in _LAYOUT_KEYS:
            continue
        match = _LAYER.fullmatch(key)
        if match is None:
            raise ValueError(
                f"{where}: entry {key!r} is not a layer_NN tensor (NN the layer number) nor "
                f"{' / '.join(_LAYOUT_KEYS)}; a replay file holds only those"
            )
        n = int(match.group(1))
        if n in layers:
            raise ValueError(
                f"{where}: {names[n]!r} and {key!r} both name layer {n}; save each layer once"
            )
        layers[n], names[n] = _integer_indices(tensor, f"{where} layer {n}"), key
    return TopkPicks(layers, _layout(loaded, where))


def load_picks(path: str | Path) -> TopkPicks:
    """The picks of a replay file (:func:`save_picks`'s format), host facts checked."""
    loaded = read_tensors(path)
    picks = _picks_from_tensors(loaded, str(path)) if isinstance(loaded, dict) else None
    if picks is None:
        raise ValueError(
            f"{path}: not a replay file (it holds no layer_NN tensor); save_picks writes them"
        )
    return picks


# ----------------------------------------------------------------------- engines' responses


def readable_file(path: Path, what: str) -> None:
    """``ValueError`` naming why ``path`` cannot be read as a file: missing, a directory, a
    symlink loop or a dangling link, not a regular file, or unreadable."""
    try:
        info = path.stat()
    except FileNotFoundError:
        broken = path.is_symlink()
        raise ValueError(
            f"{path}: {'a dangling symlink' if broken else 'no such file'} ({what})."
        ) from None
    except OSError as exc:  # ELOOP, EACCES on a parent, ...
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path}: a directory, not a file ({what}).")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file ({what}).")


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, response)`` of every saved response: ``where`` names it in errors (``line N``
    of a ``.jsonl``, ``response i`` of a ``.json`` list)."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise ValueError(
            f"{path}: engine outputs are .json or .jsonl responses, got {path.suffix!r}."
        )
    readable_file(path, "saved engine responses")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    records: list[tuple[str, object]] = []
    if suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number}: not JSON ({exc.msg}).") from None
    else:
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})."
            ) from None
        if isinstance(loaded, list):
            records = [(f"response {i}", r) for i, r in enumerate(loaded)]
        elif isinstance(loaded, dict) and ("meta_info" in loaded or "choices" in loaded
                                           or "indexer_topk" in loaded):  # fmt: skip
            records = [("response 0", loaded)]
        elif isinstance(loaded, dict):
            raise ValueError(
                f"{path}: a JSON object with keys {sorted(loaded)[:5]} is not a response (no "
                "meta_info / choices); save one response, or a list of them in packing order."
            )
        else:
            raise ValueError(
                f"{path}: holds a JSON {type(loaded).__name__}; save a response or a list of them."
            )
    if not records:
        raise ValueError(f"{path}: holds no response.")
    for where, record in records:
        if not isinstance(record, dict):
            raise ValueError(
                f"{path} {where}: a JSON {type(record).__name__}, not a response object."
            )
    return records  # type: ignore[return-value]


def _vllm_request(path: Path, where: str, record: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    name = f"{path} {where}"
    body = record
    if "choices" in record:
        choices = record["choices"]
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ValueError(f"{name}: expected one choice object (n=1) per response.")
        body = choices[0]
    usage = record.get("usage", record)
    if not isinstance(usage, Mapping) or "indexer_topk" not in body:
        raise ValueError(
            f"{name}: needs indexer_topk (base64 .npy) and usage.prompt_tokens / "
            "completion_tokens; serve with --enable-return-indexer-topk."
        )
    try:
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    except KeyError:
        raise ValueError(f"{name}: usage needs prompt_tokens and completion_tokens.") from None
    tokens = _int_at_least(f"{name} usage.prompt_tokens", prompt, low=0) + _int_at_least(
        f"{name} usage.completion_tokens", completion, low=0
    )
    return decode_vllm_indexer_topk(body["indexer_topk"], name=f"{name} indexer_topk"), tokens


def load_engine_output(path: str | Path, *, engine: str, **kw: Any) -> TopkPicks:
    """The engine's per-layer picks of the responses saved in ``path``, packed in file order.

    Args:
        path: ``.json`` (one response or a list) or ``.jsonl`` (one per line). ``sglang``:
            ``/generate`` responses with ``meta_info.indexer_topk``; ``vllm``: OpenAI responses
            whose choice carries ``indexer_topk`` (PR 49555), with ``usage``.
        engine: ``"sglang"`` or ``"vllm"``.
        kw: :func:`~dsa_precision.capture.pack_requests` options (``shared``, ``layer_numbers``,
            ``last_row``, ``first_rows``, ``validate``...).

    Returns:
        :class:`~dsa_precision.picks.TopkPicks` (``{layer_number: (T, k) int32}``, packed
        ``cu_seqlens``).
    """
    if engine not in ENGINE_FORMATS:
        raise ValueError(f"engine={engine!r}: use one of {ENGINE_FORMATS}.")
    path = Path(path)
    records = _records(path)
    if engine == "sglang":  # the requests named by where they are in the file
        responses = {where: record for where, record in records}
        try:
            return from_sglang(responses, **kw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
    rows, lens = {}, {}
    for where, record in records:
        rows[where], lens[where] = _vllm_request(path, where, record)
    try:
        return from_vllm(rows, lens, **kw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
