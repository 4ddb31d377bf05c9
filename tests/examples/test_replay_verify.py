"""examples/replay_verify.py on the CPU (tiny model): the engine side is its own model (the
precision fields of a built model are frozen), verify against the engine's rules agrees fully."""

import os
import subprocess
import sys

import pytest

from ..support.configs import ROOT
from ..support.helpers import free_port, import_example


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


BAD_FLAGS = [
    (["--steps", "0"], "--steps 0: give a count >= 1"),
    (["--seq", "-8"], "--seq -8: give a count >= 1"),
    (["--topk", "0"], "--topk 0: give a count >= 1"),
    (["--batch", "0"], "--batch 0: give a count >= 1"),
    (["--lr", "nan"], "--lr nan: give a positive finite learning rate"),
    (["--engine", "trt"], "--engine 'trt': choose one of"),
    (["--device", "cuda:0"], "--device cuda:0: no CUDA device here; run with --device cpu"),
    (["--device", "gpu"], "--device 'gpu': give cpu or cuda"),
    (["--out", "{tmp}/missing/replay.json"], "give a file path in an existing folder"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_errors(argv, message, capsys, monkeypatch, tmp_path):
    rv = import_example("replay_verify")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        rv.parse(["--tiny", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err
    args = rv.parse(["--tiny", "--device", "cpu", "--out", str(tmp_path / "replay.json")])
    assert (args.device, args.steps) == ("cpu", 50)  # good flags still parse


def test_a_bad_flag_on_the_command_line_prints_no_traceback():
    run = subprocess.run(
        [sys.executable, "examples/replay_verify.py", "--tiny", "--device", "cpu", "--topk", "0"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].endswith("--topk 0: give a count >= 1")
