"""``dsa-precision agree``: saved index tensors in, the agreement metrics out."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa_precision import cli, topk_agreement

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def selections(rows: int = 40, sk: int = 300, k: int = 32, seed: int = 0):
    """Inference picks and training picks that differ in a few members, int32, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    infer = torch.stack([torch.randperm(sk, generator=g)[:k] for _ in range(rows)])
    train = infer.clone()
    swap = torch.rand(rows, k, generator=g) < 0.05
    train[swap] = sk + torch.arange(int(swap.sum()))  # keys inference did not pick
    train[::7] = infer[::7]
    infer[3, k // 2 :] = train[3, k // 2 :] = -1  # a short row
    infer[5] = -1  # an empty inference row: not counted
    return train.to(torch.int32).view(2, rows // 2, k), infer.to(torch.int32).view(2, rows // 2, k)


def test_pt_and_safetensors_match_topk_agreement(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    train, infer = selections()
    torch.save(train, tmp_path / "train.pt")
    safetensors.save_file({"indices": infer.to(torch.int64)}, tmp_path / "infer.safetensors")
    code, out, err = run_cli(
        "agree",
        "--train",
        tmp_path / "train.pt",
        "--infer",
        tmp_path / "infer.safetensors",
        "--json",
    )
    assert code == 0, err
    got = json.loads(out)
    want = topk_agreement(train, infer).as_dict()
    assert got["shape"] == [2, 20, 32]
    assert got["configs"] == [{"name": "train.pt", **want}]
    assert got["passed"] is None
    assert 0 < want["member_agreement"] < 1 and want["rows"] == 39


def test_text_output_and_dict_key(tmp_path):
    train, infer = selections(seed=1)
    torch.save({"layer0": train, "layer1": infer}, tmp_path / "train.pt")
    torch.save(infer, tmp_path / "infer.pt")
    code, out, err = run_cli(
        "agree",
        "--train",
        tmp_path / "train.pt",
        "--infer",
        tmp_path / "infer.pt",
        "--key",
        "layer0",
    )
    # --key also applies to the infer file, which holds a plain tensor: used as is.
    assert code == 0, err
    want = topk_agreement(train, infer).as_dict()
    assert f"{100 * want['member_agreement']:.4f} %" in out
    assert f"{want['rows']} rows" in out


def test_min_agreement_gate(tmp_path):
    train, infer = selections(seed=2)
    torch.save(train, tmp_path / "t.pt")
    torch.save(infer, tmp_path / "i.pt")
    agreement = topk_agreement(train, infer).as_dict()["member_agreement"]
    base = ("agree", "--train", tmp_path / "t.pt", "--infer", tmp_path / "i.pt")
    assert run_cli(*base, "--min-agreement", agreement)[0] == 0
    code, _, err = run_cli(*base, "--min-agreement", min(1.0, agreement + 1e-3), "--json")
    assert code == 1 and "below --min-agreement" in err


def _bad_cases(tmp_path: Path) -> dict[str, tuple[list, str]]:
    good = tmp_path / "good.pt"
    torch.save(torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32), good)
    files = {
        "short.pt": torch.tensor([[0, 1, 2]]),
        "float.pt": torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, -1.0]]),
        "dup.pt": torch.tensor([[0, 0, 2], [3, 4, -1]]),
        "two.pt": {"a": torch.tensor([[0, 1, 2]]), "b": torch.tensor([[0, 1, 2]])},
        "obj.pt": [1, 2, 3],
    }
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    (tmp_path / "x.npy").write_bytes(b"")
    return {
        "missing": (["--infer", tmp_path / "missing.pt"], "no such file"),
        "shape": (["--infer", tmp_path / "short.pt"], "shape mismatch"),
        "float": (["--infer", tmp_path / "float.pt"], "must be an integer tensor"),
        "duplicate": (["--infer", tmp_path / "dup.pt"], "repeats an index"),
        "several": (["--infer", tmp_path / "two.pt"], "pick one with --key"),
        "object": (["--infer", tmp_path / "obj.pt"], "save a tensor"),
        "corrupt": (["--infer", tmp_path / "junk.pt"], "not a readable torch file"),
        "extension": (["--infer", tmp_path / "x.npy"], "unknown file type"),
        "gate": (["--infer", good, "--min-agreement", "1.5"], "fraction in [0, 1]"),
    }, good


@pytest.mark.parametrize(
    "case",
    ["missing", "shape", "float", "duplicate", "several", "object", "corrupt", "extension", "gate"],
)
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    cases, good = _bad_cases(tmp_path)
    extra, message = cases[case]
    code, out, err = run_cli("agree", "--train", good, *extra)
    assert code == 2 and out == ""
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("dsa-precision agree: error: ")


def test_module_help_in_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "dsa_precision", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: dsa-precision")
    for command in ("demo", "agree", "bench"):
        assert command in proc.stdout


@pytest.mark.parametrize("command", ["demo", "agree"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: dsa-precision {command}")


def test_errors_from_a_subprocess_have_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dsa_precision", "agree", "--train", "a.pt", "--infer", "b.pt"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "dsa-precision agree: error: --train a.pt: no such file"


def test_replay_files_are_compared_layer_by_layer(tmp_path):
    from dsa_precision.megatron.replay import save_topk

    train1, infer1 = selections(seed=1)
    train2, infer2 = selections(seed=2)
    flat = {n: t.reshape(-1, t.shape[-1]) for n, t in ((1, train1), (2, train2))}
    save_topk(tmp_path / "train.pt", flat, seq_len=20)
    save_topk(
        tmp_path / "infer.pt", {1: infer1.reshape(40, -1), 2: infer2.reshape(40, -1)}, seq_len=20
    )
    code, out, err = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt",
        "--engine", "vllm", "--json",
    )  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["engine"] == "vllm" and [c["name"] for c in got["configs"]] == [
        "layer 1", "layer 2", "all",
    ]  # fmt: skip
    assert (
        got["configs"][0]["member_agreement"]
        == topk_agreement(train1, infer1).as_dict()["member_agreement"]
    )
    both = topk_agreement(torch.cat([train1, train2]), torch.cat([infer1, infer2])).as_dict()
    assert got["configs"][-1] == {"name": "all", **both}
    code, out, _ = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt"
    )
    assert (
        code == 0
        and "layer by layer" in out
        and any(line.startswith("layer 2") for line in out.splitlines())
    )


def test_a_replay_file_against_a_plain_file_is_refused(tmp_path):
    from dsa_precision.megatron.replay import save_topk

    train, infer = selections()
    save_topk(tmp_path / "train.pt", {1: train.reshape(40, -1)}, seq_len=20)
    torch.save(infer, tmp_path / "infer.pt")
    code, _, err = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt"
    )
    assert code == 2 and "both be replay files" in err and err.count("\n") == 1
