"""The Makefile finds a Python >= 3.12 on any machine, or says how to name one (``make python``
prints what ``make demo`` / ``make test`` would use)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")
OLD = "#!/bin/sh\nexit 1\n"  # a python3 that fails the version check, as Python 3.11 would


def _tools(tmp_path: Path, **scripts: str) -> Path:
    """A PATH holding only make and the given tools (str: a shell script; Path: a link)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").symlink_to(MAKE)
    for name, body in scripts.items():
        if isinstance(body, Path):
            (bin_dir / name).symlink_to(body)
        else:
            (bin_dir / name).write_text(body)
            (bin_dir / name).chmod(0o755)
    return bin_dir


def _make_python(path: Path, **env: str) -> subprocess.CompletedProcess:
    env = {"PATH": str(path), "HOME": str(path.parent), **env}
    return subprocess.run(
        [MAKE, "-s", "-C", str(ROOT), "python"], env=env, capture_output=True, text=True
    )


def test_no_machine_specific_path():
    assert "/root/" not in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("name", ["python3.12", "python3.13", "python3"])
def test_the_first_python_312_on_path(tmp_path, name):
    tools = {"python3": OLD, name: Path(sys.executable)}
    out = _make_python(_tools(tmp_path, **tools))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "bin" / name)


def test_pyenv_versions_when_none_is_on_path(tmp_path):
    root = tmp_path / "pyenv"
    (root / "versions" / "3.12.9" / "bin").mkdir(parents=True)
    (root / "versions" / "3.12.9" / "bin" / "python3").symlink_to(sys.executable)
    # pyenv which fails as it does when the version is installed but not selected
    pyenv = f'#!/bin/sh\n[ "$1" = root ] && {{ echo {root}; exit 0; }}\nexit 127\n'
    out = _make_python(_tools(tmp_path, python3=OLD, pyenv=pyenv))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{root}/versions/3.12.9/bin/python3"


def test_none_found_says_to_set_python(tmp_path):
    out = _make_python(_tools(tmp_path, python3=OLD))
    assert out.returncode == 2 and out.stdout == ""
    assert "no Python >= 3.12 found" in out.stderr
    assert "PYTHON=/path/to/python3.12 make python" in out.stderr


def test_an_explicit_python_is_checked(tmp_path):
    tools = _tools(tmp_path, python3=OLD)
    out = _make_python(tools, PYTHON=str(tools / "python3"))
    assert out.returncode == 2 and "is not a Python >= 3.12" in out.stderr
    out = _make_python(tools, PYTHON=sys.executable)
    assert out.returncode == 0 and out.stdout.strip() == sys.executable
