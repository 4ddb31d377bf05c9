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

from ..support.configs import ROOT


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
        "neg.pt": torch.tensor([[0, 1, 2], [3, -2, -1]]),
        "k0.pt": torch.zeros(2, 0, dtype=torch.int64),
        "pads.pt": torch.full((2, 3), -1),
        "intkey.pt": {1: torch.tensor([[0, 1, 2], [3, 4, -1]])},
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
        "duplicate": (["--infer", tmp_path / "dup.pt"], "row 0 of 2 (shape (2, 3)) is [0, 0, 2]"),
        "negative": (["--infer", tmp_path / "neg.pt"], "row 1 of 2 (shape (2, 3)) is [3, -2, -1]"),
        "k0": (["--infer", tmp_path / "k0.pt"], "k = 0 slots per row"),
        "nothing": (["--infer", tmp_path / "pads.pt"], "every row is -1 padding"),
        "int key": (["--infer", tmp_path / "intkey.pt"], "key 1 (int) is not a string"),
        "several": (["--infer", tmp_path / "two.pt"], "pick one with --key"),
        "object": (["--infer", tmp_path / "obj.pt"], "save a tensor"),
        "corrupt": (["--infer", tmp_path / "junk.pt"], "not a readable torch file"),
        "extension": (["--infer", tmp_path / "x.npy"], "unknown file type"),
        "gate": (["--infer", good, "--min-agreement", "1.5"], "fraction in [0, 1]"),
    }, good


@pytest.mark.parametrize(
    "case",
    ["missing", "shape", "float", "duplicate", "negative", "k0", "nothing", "int key", "several",
     "object", "corrupt", "extension", "gate"],
)  # fmt: skip
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
    assert proc.stderr.strip() == (
        "dsa-precision agree: error: --train a.pt: no such file (a .pt or .safetensors file of "
        "picks)"
    )


def causal_selections(batch: int = 2, seq_len: int = 20, k: int = 8, seed: int = 0):
    """Replay-layout picks ``(batch * seq_len, k)`` int32: token ``p`` of a sequence picks
    ``min(k, p + 1)`` keys in ``[0, p]``; training swaps a few for keys inference did not pick."""
    g = torch.Generator().manual_seed(seed)
    infer = torch.full((batch * seq_len, k), -1, dtype=torch.int32)
    train = infer.clone()
    for row in range(batch * seq_len):
        p = row % seq_len
        keys = torch.randperm(p + 1, generator=g)
        n = min(k, p + 1)
        infer[row, :n] = train[row, :n] = keys[:n]
        if p + 1 > n and torch.rand((), generator=g) < 0.5:
            train[row, 0] = keys[n]  # one flipped pick
    return train, infer


def save_replay(path: Path, layers: dict, **layout) -> Path:
    """A replay file as ``save_picks`` writes it, built by hand."""
    tensors = {f"layer_{n:02d}": t for n, t in layers.items()} if layers else {}
    tensors |= {
        k: v if isinstance(v, torch.Tensor) else torch.tensor([v]) for k, v in layout.items()
    }
    torch.save(tensors, path)
    return path


def test_replay_files_are_compared_layer_by_layer(tmp_path):
    from dsa_precision.capture import TokenLayout, TopkPicks, save_picks

    train1, infer1 = causal_selections(seed=1)
    train2, infer2 = causal_selections(seed=2)
    layout = TokenLayout(seq_len=20)
    save_picks(tmp_path / "train.pt", TopkPicks({1: train1, 2: train2}, layout))
    save_picks(tmp_path / "infer.pt", TopkPicks({1: infer1, 2: infer2}, layout))
    code, out, err = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt",
        "--engine", "vllm", "--json",
    )  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["engine"] == "vllm" and [c["name"] for c in got["configs"]] == [
        "layer 1", "layer 2", "all",
    ]  # fmt: skip
    assert got["configs"][0] == {"name": "layer 1", **topk_agreement(train1, infer1).as_dict()}
    both = topk_agreement(torch.cat([train1, train2]), torch.cat([infer1, infer2])).as_dict()
    assert got["configs"][-1] == {"name": "all", **both}
    assert 0 < both["member_agreement"] < 1
    code, out, _ = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt"
    )
    assert (
        code == 0
        and "layer by layer" in out
        and any(line.startswith("layer 2") for line in out.splitlines())
    )


def test_gate_covers_every_layer_whatever_its_k(tmp_path):
    """Layer 1 (k = 8) at 0 %, layer 2 (k = 4) at 100 %: the gate fails and names layer 1."""
    _, infer1 = causal_selections(k=8, seed=3)
    train2, infer2 = causal_selections(k=4, seed=4)
    train1 = torch.full_like(infer1, -1)  # training picked nothing: 0 % of inference's picks
    train = save_replay(tmp_path / "t.pt", {1: train1, 2: infer2}, seq_len=20)
    infer = save_replay(tmp_path / "i.pt", {1: infer1, 2: infer2}, seq_len=20)
    code, out, err = run_cli("agree", "--train", train, "--infer", infer, "--min-agreement", 0.5)
    assert code == 1, (out, err)
    members1, members2 = int((infer1 >= 0).sum()), int((infer2 >= 0).sum())
    pooled = members2 / (members1 + members2)
    assert pooled < 0.5
    assert err.splitlines() == [
        "layer 1: member agreement 0.000000 is below --min-agreement 0.5",
        f"all: member agreement {pooled:.6f} is below --min-agreement 0.5",
    ]
    code, out, err = run_cli(
        "agree", "--train", train, "--infer", infer, "--min-agreement", 0.5, "--json"
    )
    got = json.loads(out)
    assert code == 1 and got["passed"] is False and got["failed"] == ["layer 1", "all"]
    assert got["configs"][-1] == {
        "name": "all", "member_agreement": pooled, "rows_identical": 0.5, "flipped_mean":
        members1 / 80, "flipped_max": 8, "rows": 80, "members": members1 + members2,
        "broken_rows": 0,
    }  # fmt: skip
    # Both layers above the gate: it passes.
    save_replay(train, {1: infer1, 2: train2}, seq_len=20)
    code, out, err = run_cli(
        "agree", "--train", train, "--infer", infer, "--min-agreement", 0.5, "--json"
    )
    assert code == 0 and json.loads(out)["failed"] == [], err


def _bad_replays(tmp_path: Path) -> dict[str, tuple[Path, Path, str]]:
    train, _ = causal_selections(seed=5)
    good = save_replay(tmp_path / "good.pt", {1: train, 2: train}, seq_len=20)
    late = train.clone()
    late[23, 0] = 4  # token 23 is position 3 of sequence 1: key 4 is in its future
    bad = {
        "causal": ({1: train, 2: late}, dict(seq_len=20), "layer 2: row 23 (position 3"),
        "rows": ({1: train, 2: train}, dict(cu_seqlens=torch.tensor([0, 20, 30])),
                 "40 token rows but cu_seqlens ends at 30"),
        "cu_seqlens": ({1: train, 2: train}, dict(cu_seqlens=torch.tensor([0, 25, 20, 40])),
                       "it must start at 0 and never decrease"),
        "layout": ({1: train, 2: train}, dict(seq_len=40), "--train has seq_len=20, --infer "
                   "seq_len=40; the two files must hold picks of the same tokens"),
        "seq_len": ({1: train, 2: train}, dict(seq_len=torch.tensor([2.5])),
                    "seq_len is a float32 tensor"),
        "nothing": ({1: train, 2: torch.full_like(train, -1)}, dict(seq_len=20),
                    "layer 2: every row is -1 padding, so nothing is compared"),
    }  # fmt: skip
    cases = {
        name: (good, save_replay(tmp_path / f"{name}.pt", layers, **layout), message)
        for name, (layers, layout, message) in bad.items()
    }
    for name, tensors, message in [
        ("same layer", {"layer_01": train, "layer_1": train, "seq_len": torch.tensor([20])},
         "'layer_01' and 'layer_1' both name layer 1"),
        ("layer name", {"layer_01": train, "layer_x": train},
         "entry 'layer_x' is not a layer_NN tensor"),
        ("entry", {"layer_01": train, "layer_02": train, "seqlen": torch.tensor([20])},
         "entry 'seqlen' is not a layer_NN tensor (NN the layer number) nor cu_seqlens / seq_len"),
    ]:  # fmt: skip
        torch.save(tensors, tmp_path / f"{name}.pt")
        cases[name] = (good, tmp_path / f"{name}.pt", message)
    return cases


BAD_REPLAYS = ["causal", "rows", "cu_seqlens", "layout", "seq_len", "nothing", "same layer",
               "layer name", "entry", "key"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_REPLAYS)
def test_bad_replay_files_are_one_line_exit_2(tmp_path, case):
    if case == "key":  # an explicit request a replay file cannot honour
        good, _, _ = _bad_replays(tmp_path)["causal"]
        bad, extra, message = good, ["--key", "layer_01"], "--key layer_01: replay files"
    else:
        (good, bad, message), extra = _bad_replays(tmp_path)[case], []
    code, out, err = run_cli("agree", "--train", good, "--infer", bad, *extra)
    assert code == 2 and out == ""
    assert err.startswith("dsa-precision agree: error: --") and err.count("\n") == 1, err
    assert message in err, err


def test_json_carries_the_package_version(tmp_path):
    import dsa_precision

    train, infer = causal_selections()
    torch.save(train, tmp_path / "t.pt")
    torch.save(infer, tmp_path / "i.pt")
    code, out, err = run_cli("agree", "--train", tmp_path / "t.pt", "--infer", tmp_path / "i.pt",
                             "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["dsa_precision_version"] == dsa_precision.__version__


def test_a_replay_file_against_a_plain_file_is_refused(tmp_path):
    from dsa_precision.capture import TokenLayout, TopkPicks, save_picks

    train, infer = causal_selections()
    save_picks(tmp_path / "train.pt", TopkPicks({1: train}, TokenLayout(seq_len=20)))
    torch.save(infer, tmp_path / "infer.pt")
    code, _, err = run_cli(
        "agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt"
    )
    assert code == 2 and "both be replay files" in err and err.count("\n") == 1


# A planted tie, a precision difference and an invalid set (keys 0-3 of four rows, top-2): row 0
# agrees; row 1's scores tie at the boundary (keys 1 and 2: inference's {0, 2} is a top-2 too);
# row 2's do not (inference took key 2 below key 1); row 3's inference set takes key 3, which the
# row does not see (-inf).
CAUSE_SCORES = torch.tensor(
    [[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, -torch.inf]]
)
CAUSE_TRAIN = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]], dtype=torch.int32)
CAUSE_INFER = torch.tensor([[0, 1], [0, 2], [0, 2], [0, 3]], dtype=torch.int32)


def test_scores_tell_each_differing_row_apart(tmp_path):
    torch.save(CAUSE_TRAIN, tmp_path / "train.pt")
    torch.save(CAUSE_INFER, tmp_path / "infer.pt")
    torch.save(CAUSE_SCORES, tmp_path / "scores.pt")
    argv = ("agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt")
    code, out, err = run_cli(*argv, "--scores", tmp_path / "scores.pt", "--json")
    assert code == 0, err
    got = json.loads(out)["configs"][0]
    assert (got["tie_rows"], got["precision_rows"], got["invalid_rows"]) == (1, 1, 1)
    assert got["rows_identical"] == 0.25
    code, out, _ = run_cli(*argv, "--scores", tmp_path / "scores.pt")
    header = next(line for line in out.splitlines() if "rows identical" in line)
    assert code == 0 and header.split()[-3:] == ["tie", "precision", "invalid"]
    code, out, _ = run_cli(*argv, "--json")  # without scores: no causes
    assert code == 0 and "tie_rows" not in json.loads(out)["configs"][0]


def test_scores_of_replay_files_are_read_per_layer_and_pooled(tmp_path):
    from dsa_precision.capture import TokenLayout, TopkPicks, save_picks

    # One sequence of 8 tokens: rows 0-3 pick key 0 on both sides, rows 4-6 are CAUSE's rows 0-2
    # (a replay file's picks are causal, so its invalid row is left out: row 7 agrees).
    layout = TokenLayout(seq_len=8)
    first = torch.tensor([[0, -1]] * 4, dtype=torch.int32)
    train = torch.cat([first, CAUSE_TRAIN])
    infer = torch.cat([first, CAUSE_INFER[:3], CAUSE_TRAIN[3:]])
    scores = torch.full((8, 8), -torch.inf)
    scores[:4, 0] = 1.0
    scores[4:, :4] = CAUSE_SCORES.nan_to_num(neginf=0.0)
    save_picks(tmp_path / "train.pt", TopkPicks({1: train, 2: train}, layout))
    save_picks(tmp_path / "infer.pt", TopkPicks({1: infer, 2: train}, layout))
    torch.save({"layer_01": scores, "layer_02": scores}, tmp_path / "scores.pt")
    argv = ("agree", "--train", tmp_path / "train.pt", "--infer", tmp_path / "infer.pt")
    code, out, err = run_cli(*argv, "--scores", tmp_path / "scores.pt", "--json")
    assert code == 0, err
    by = {c["name"]: c for c in json.loads(out)["configs"]}
    assert (by["layer 1"]["tie_rows"], by["layer 1"]["precision_rows"]) == (1, 1)
    assert (by["layer 2"]["tie_rows"], by["layer 2"]["precision_rows"]) == (0, 0)
    assert (by["all"]["tie_rows"], by["all"]["precision_rows"], by["all"]["invalid_rows"]) == (
        1, 1, 0,
    )  # fmt: skip
    torch.save({"layer_01": scores}, tmp_path / "one.pt")
    code, _, err = run_cli(*argv, "--scores", tmp_path / "one.pt")
    assert code == 2 and "layer_02: missing" in err
    torch.save({"layer_01": scores, "layer_02": scores[:2]}, tmp_path / "short.pt")
    code, _, err = run_cli(*argv, "--scores", tmp_path / "short.pt")
    assert code == 2 and "scores of shape (2, 8) for picks of shape (8, 2)" in err
    torch.save({"layer_01": train, "layer_02": train}, tmp_path / "ints.pt")
    code, _, err = run_cli(*argv, "--scores", tmp_path / "ints.pt")
    assert code == 2 and "give float scores" in err
