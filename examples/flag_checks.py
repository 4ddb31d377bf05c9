"""The flag checks the examples share: a bad value ends the command with one line on stderr and
exit status 2 (argparse's ``p.error``), before anything is built or run, never a traceback.

Imported by the examples beside it (``toy_glm5_train.py``, ``replay_verify.py``,
``parallel_parity.py``, ``bridge_glm5.py``); ``logprob_mismatch.py`` has its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path

import torch


def flag(name: str) -> str:
    """The command-line spelling of an argument's attribute name: ``share_steps`` -> ``--share-steps``."""
    return "--" + name.replace("_", "-")


def check_counts(
    p: argparse.ArgumentParser, args: argparse.Namespace, lows: Mapping[str, int]
) -> None:
    """Every ``args.<name>`` of ``lows`` (``None``: not given, left alone) at least its low."""
    for name, low in lows.items():
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"{flag(name)} {value}: give a count >= {low}")


def check_lr(p: argparse.ArgumentParser, lr: float) -> None:
    if not (0 < lr and math.isfinite(lr)):
        p.error(f"--lr {lr}: give a positive finite learning rate")


def check_engine(p: argparse.ArgumentParser, engine: str) -> None:
    """``engine`` one of the package's engine profiles (what ``dsa_indexer_engine`` takes)."""
    from dsa_precision import ENGINE_PROFILES

    if engine not in ENGINE_PROFILES:
        p.error(f"--engine {engine!r}: choose one of {', '.join(sorted(ENGINE_PROFILES))}")


def check_device(p: argparse.ArgumentParser, device: str) -> str:
    """``device`` as the examples compare it: ``"cpu"``, or a CUDA device present here."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        p.error(f"--device {device!r}: give cpu or cuda (cuda:N)")
    if parsed.type == "cpu":
        return "cpu"  # "cpu:0" too: the examples test for the string "cpu"
    if parsed.type != "cuda":
        p.error(f"--device {device!r}: give cpu or cuda (cuda:N)")
    if not torch.cuda.is_available():
        p.error(f"--device {device}: no CUDA device here; run with --device cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        p.error(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"give cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def check_output(p: argparse.ArgumentParser, name: str, path: str | None) -> None:
    """An output file's path (``None``: not given): not a folder, in a folder that exists."""
    if path is not None and (Path(path).is_dir() or not Path(path).parent.is_dir()):
        p.error(f"{flag(name)} {path}: give a file path in an existing folder")


def missing_modules(*names: str) -> list[str]:
    """Those of the modules ``names`` that cannot be imported here (found by their spec)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a broken one
            found = False
        if not found:
            missing.append(name)
    return missing
