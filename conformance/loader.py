"""Loading an engine's files unmodified, with stand-ins for the engine imports they make.

The oracles (:mod:`.engine_kernels`, :mod:`.sglang_unfused`, :mod:`.legacy_q`) run the engines'
own sources from the roots of :data:`ENV_VAR` (``DSA_ENGINE_KERNELS``: one or more folders,
``os.pathsep`` separated, holding the wheels' relative paths; docs/gpu-validation.md has the
recipe). :func:`load_module` executes one file as a module while stand-in modules answer its
imports; :class:`EngineKernelRun` is what an oracle returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from dsa_precision.cli.engine_model import EngineOperands

__all__ = [
    "ENV_VAR",
    "EngineKernelRun",
    "load_module",
    "package",
    "roots",
    "scoped_modules",
    "sha256",
]

ENV_VAR = "DSA_ENGINE_KERNELS"


def roots(root: str | os.PathLike | None = None) -> list[Path]:
    """The roots of the engines' files: ``root`` or :data:`ENV_VAR`, split at ``os.pathsep``."""
    value = os.fspath(root) if root is not None else os.environ.get(ENV_VAR, "")
    return [Path(p) for p in value.split(os.pathsep) if p]


def sha256(path: Path) -> str:
    """The SHA-256 of the file's bytes, hexadecimal."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def scoped_modules(stubs: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """``sys.modules`` with ``stubs`` in place for the duration; everything restored after."""
    saved = {name: sys.modules.get(name) for name in stubs}
    added_before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in set(sys.modules) - added_before:
            if name.split(".")[0] in {n.split(".")[0] for n in stubs}:
                del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_module(
    path: Path, name: str, stubs: Mapping[str, types.ModuleType] | None = None
) -> types.ModuleType:
    """Execute the file ``path`` as module ``name`` with ``stubs`` importable meanwhile.

    The module keeps its own globals (its kernels see the stand-ins they imported); neither it nor
    the stand-ins stay in ``sys.modules``. ``name`` may be dotted: its parents must be among ``stubs``
    (packages, so that the file's relative imports resolve against them).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    with scoped_modules(dict(stubs or {})):
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            sys.modules.pop(name, None)
    return module


def package(name: str, path: Path | None = None, **attrs: object) -> types.ModuleType:
    """A package module ``name`` (``__path__``: ``path``, else empty) holding ``attrs``."""
    module = types.ModuleType(name)
    module.__path__ = [os.fspath(path)] if path is not None else []
    module.__dict__.update(attrs)
    return module


@dataclasses.dataclass(frozen=True)
class EngineKernelRun:
    """The operands one engine kernel built, and what ran."""

    operands: EngineOperands
    engine: str  # "vllm" | "lmdeploy" | "sglang"
    source: str  # release and file hash, e.g. "vllm 0.33.0 (sha256 23be4ed95ae4)"
    # float32 keys before quantization, when the kernel writes them (vLLM's index_k_out).
    k_float: torch.Tensor | None = None
