"""Runs ``tests/interpreter`` (the Triton kernels in Triton's CPU interpreter) in a subprocess:
the interpreter must be selected by ``TRITON_INTERPRET=1`` before Triton is first imported."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_in_the_triton_interpreter():
    # The child picks its own rendezvous port: this process may hold the one it chose.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreter"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout.splitlines()[-1]
