"""examples/bridge_glm5.py's flags: what cannot run (bad counts, a checkpoint or output folder
that is not there, no GPU, Megatron-Bridge missing) ends the command in one line and exit
status 2 before anything is imported or built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..support.configs import ROOT
from ..support.helpers import import_example

BAD_FLAGS = [
    (["--seq", "0"], "--seq 0: give a count >= 1"),
    (["--steps", "-1"], "--steps -1: give a count >= 0"),
    (["--lr", "inf"], "--lr inf: give a positive finite learning rate"),
    (["--engine", "tgi"], "--engine 'tgi': choose one of"),
    (["--hf", "{tmp}/GLM-5"], "--hf {tmp}/GLM-5: no such folder"),
    (["--hf", "./GLM-5"], "--hf ./GLM-5: no such folder"),
    (["--hf", "{tmp}/file"], "--hf {tmp}/file: a file; give a Hugging Face checkpoint's folder"),
    (["--save", "{tmp}/file"], "--save {tmp}/file: a file, not a folder"),
    (["--save", "{tmp}/no/out"], "--save {tmp}/no/out: its parent folder {tmp}/no does not exist"),
    (["--hf", "{tmp}"], "--hf {tmp}: no config.json; give a Hugging Face checkpoint's folder"),
    (["--hf", "{tmp}/garbage"], "--hf {tmp}/garbage: config.json cannot be read (Expecting property name"),
    (["--hf", "{tmp}/llama"], "config.json has model_type 'llama'; this example reads GLM-5"),
    ([], "no CUDA device here: the example trains on one GPU"),
]  # fmt: skip


@pytest.mark.parametrize(
    "argv, message", BAD_FLAGS, ids=[" ".join(a) or "cpu" for a, _ in BAD_FLAGS]
)
def test_bad_flags_are_one_line_errors(argv, message, capsys, monkeypatch, tmp_path):
    bridge = import_example("bridge_glm5")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    (tmp_path / "file").write_text("")
    for name, text in (("garbage", "{not json"), ("llama", '{"model_type": "llama"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    with pytest.raises(SystemExit) as exit_:
        bridge.parse([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in err, err


def test_missing_packages_are_named_and_good_flags_parse(capsys, monkeypatch, tmp_path):
    bridge = import_example("bridge_glm5")
    fc = import_example("flag_checks")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(fc, "missing_modules", lambda *names: ["megatron.bridge"])
    with pytest.raises(SystemExit) as exit_:
        bridge.parse(["--fp8"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and "megatron.bridge cannot be imported here" in err
    monkeypatch.setattr(fc, "missing_modules", lambda *names: [])
    args = bridge.parse(["--hf", "zai-org/GLM-5", "--save", str(tmp_path / "out"), "--steps", "0"])
    assert (args.hf, args.steps) == ("zai-org/GLM-5", 0)  # a Hub id, and a folder to be made


def test_a_bad_flag_on_the_command_line_prints_no_traceback():
    run = subprocess.run(
        [sys.executable, "examples/bridge_glm5.py", "--seq", "-1"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].endswith("--seq -1: give a count >= 1")
