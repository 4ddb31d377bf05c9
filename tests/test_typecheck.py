"""The package type-checks: mypy, with the project's configuration (``[tool.mypy]`` of
pyproject.toml: strict on the public API), reports no error. CPU only; deselect with
``-m "not typecheck"``."""

import importlib.util
import subprocess
import sys

import pytest

from .support.configs import ROOT

pytestmark = [
    pytest.mark.typecheck,
    pytest.mark.skipif(
        importlib.util.find_spec("mypy") is None,
        reason="mypy is not installed (pip install -e '.[test]')",
    ),
]


def test_mypy_passes_with_the_project_config():
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
