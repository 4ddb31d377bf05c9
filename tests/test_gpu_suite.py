"""The GPU step runs every GPU test (issue 49): the ``tests`` step of ``tools/gpu_session.sh``
collects every test marked ``gpu`` wherever it sits, without a collection error, and each of them
sees every fixture it requests. Checked here, with no GPU, by collecting what that step's pytest
command collects (``--collect-only``, in a subprocess, with ``tests/support/gpu_collection.py``
reporting the fixtures a test requests that nothing it can see defines: pytest itself says so
only when the test sets up, which a skipped test never does)."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .support.gpu_collection import REPORT

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "tools" / "gpu_session.sh"
# pytest options of the step's command that take a value (the value is no path).
_VALUED = {"-m", "-k", "-p", "-c", "-o", "--rootdir", "--deselect", "--ignore"}


def _gpu_step_command() -> list[str]:
    """The pytest arguments of the ``tests`` step of tools/gpu_session.sh."""
    step = re.search(r"^\s*tests\)[^\n]*\n(.*?);;", SESSION.read_text(), re.M | re.S)
    assert step, f"{SESSION.relative_to(ROOT)} has no `tests)` step"
    words = shlex.split(step.group(1).replace("\\\n", " "))
    assert "pytest" in words, step.group(1)
    return words[words.index("pytest") + 1 :]


def _paths(args: list[str]) -> list[str]:
    paths, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word in _VALUED:
            skip = True
        elif not word.startswith("-"):
            paths.append(word)
    return paths


def _is_gpu_mark(node: ast.AST) -> bool:
    """``pytest.mark.gpu`` / ``mark.gpu`` (called or not)."""
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "gpu"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    )


def _sources() -> list[Path]:
    """The repository's Python files (no hidden folder: .venv, .git, build bundles)."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info")]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return found


def _marked_gpu() -> tuple[set[str], set[str]]:
    """Where the repository marks tests ``gpu``, read from the source: the files that do (by a
    decorator, ``pytestmark`` or a ``pytest.param(..., marks=...)``), and the functions a
    decorator marks, as ``path::name``."""
    files, functions = set(), set()
    for path in _sources():
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), filename=str(rel))
        if not any(_is_gpu_mark(node) for node in ast.walk(tree)):
            continue
        files.add(rel.as_posix())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                _is_gpu_mark(d) for d in node.decorator_list
            ):
                functions.add(f"{rel.as_posix()}::{node.name}")
    return files, functions


@pytest.fixture(scope="module")
def gpu_collection(tmp_path_factory):
    """What the GPU step's pytest command collects: its output and the plugin's report."""
    args = _gpu_step_command()
    report = tmp_path_factory.mktemp("gpu_collection") / "report.json"
    env = {**os.environ, REPORT: str(report)}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", *args, "--collect-only", "-q"]
    cmd += ["-p", "tests.support.gpu_collection"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, f"{shlex.join(cmd)} exited {run.returncode}:\n{output}"
    return args, json.loads(report.read_text())


def test_the_gpu_step_runs_the_gpu_marker_over_every_test_folder():
    args = _gpu_step_command()
    assert "-m" in args and args[args.index("-m") + 1] == "gpu", args
    assert _paths(args) == ["tests"], f"the step collects {_paths(args)}, not the whole of tests/"


def test_the_gpu_step_collects_without_errors(gpu_collection):
    _, report = gpu_collection
    assert report["errors"] == []
    assert report["items"] and all(item["gpu"] for item in report["items"])


def test_every_test_marked_gpu_is_collected_by_the_gpu_step(gpu_collection):
    _, report = gpu_collection
    collected = {item["nodeid"] for item in report["items"]}
    files, functions = _marked_gpu()
    assert files and functions
    collected_files = {nodeid.split("::")[0] for nodeid in collected}
    outside = sorted(files - collected_files)
    assert not outside, f"tests marked gpu where the GPU step does not collect them: {outside}"

    def found(function: str) -> bool:
        path, name = function.split("::")
        return any(n.split("::")[0] == path and re.search(rf"::{name}(\[|$)", n) for n in collected)

    lost = [f for f in sorted(functions) if not found(f)]
    assert not lost, f"tests marked gpu that the GPU step does not collect: {lost}"


def test_every_gpu_test_sees_its_fixtures(gpu_collection):
    _, report = gpu_collection
    missing = {item["nodeid"]: item["missing_fixtures"] for item in report["items"]}
    missing = {nodeid: names for nodeid, names in missing.items() if names}
    assert not missing, f"gpu tests that request fixtures they cannot see: {missing}"
