"""examples/replay_verify.py on the CPU (tiny model): the engine side is its own model (the
precision fields of a built model are frozen), verify against the engine's rules agrees fully."""

import os
import subprocess
import sys

import pytest

from ..support.configs import ROOT
from ..support.helpers import free_port


def test_replay_verify_example_runs_and_agrees_on_the_cpu(tmp_path):
    pytest.importorskip("megatron.core")
    paths = os.pathsep.join([str(ROOT), str(ROOT / "examples")])
    env = dict(os.environ, PYTHONPATH=paths, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = tmp_path / "replay.json"
    args = ["--tiny", "--device", "cpu", "--steps", "2", "--seq", "64", "--topk", "32"]
    run = subprocess.run(
        [sys.executable, "examples/replay_verify.py", *args, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert out.exists() and "verify_vs_rope_fp32_fp8" in out.read_text()
