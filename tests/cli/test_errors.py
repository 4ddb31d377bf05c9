"""No user error prints a traceback: bad arguments of every command, through ``cli.main``.

A user error ends in one of two ways: an argparse error (usage line, ``error:`` line, exit status
2) for a flag value that cannot be parsed, or a :class:`~dsa_precision.cli.CliError` (one line,
exit status 2) for a value that parses but cannot be honoured. Anything else escaping
``cli.main`` is a traceback, and fails the test.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from dsa_precision import cli
from dsa_precision.cli import demo

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks errors on a CPU machine")

ARGPARSE = "argparse"  # expected: usage + "error:" line, SystemExit(2)
ONE_LINE = "one line"  # expected: "dsa-precision CMD: error: ..." and exit status 2

CASES = [
    # demo
    (["demo", "--seed", "-1"], ARGPARSE, "--seed: -1 is outside [0, 2**64 - 1]"),
    (["demo", "--seed", str(2**64)], ARGPARSE, "is outside [0, 2**64 - 1]"),
    (["demo", "--seed", "x"], ARGPARSE, "--seed: 'x' is not an integer"),
    (["demo", "--seq", "0"], ARGPARSE, "--seq: 0 must be at least 1"),
    (["demo", "--topk", "abc"], ARGPARSE, "--topk: 'abc' is not an integer"),
    (["demo", "--heads", "48"], ARGPARSE, "--heads: invalid choice"),
    (["demo", "--engine", "nope"], ARGPARSE, "--engine: invalid choice"),
    (["demo", "--device", "tpu"], ARGPARSE, "--device: invalid choice"),
    (["demo", "--seq", "64", "--topk", "64"], ONE_LINE, "--topk 64 must be below"),
    (["demo", "--seq", "130", "--topk", "128"], ONE_LINE, "fewer than 32 rows measures nothing"),
    (["demo", "--seq", "64", "--topk", "8", "--plot", "x.txt"], ONE_LINE, "cannot write .txt"),
    (["demo", "--plot", "/nonexistent-dir/x.png"], ONE_LINE, "does not exist"),
    (["demo", "--engine", "sglang-unfused"], ONE_LINE, "--hadamard"),
    (["demo", "--engine", "sglang-fused"], ONE_LINE, "rope_interleaved"),
    (["demo", "--backend", "deepgemm"], ONE_LINE, "runs on --device cuda"),
    pytest.param(["demo", "--device", "cuda"], ONE_LINE, "CUDA is not available", marks=NO_GPU),
    # agree
    (["agree", "--train", "a.pt"], ARGPARSE, "the following arguments are required: --infer"),
    (["agree", "--train", "a.pt", "--infer", "b.pt", "--min-agreement", "x"], ARGPARSE,
     "--min-agreement: invalid float value"),
    (["agree", "--train", "a.pt", "--infer", "b.pt", "--min-agreement", "2"], ONE_LINE,
     "fraction in [0, 1]"),
    (["agree", "--train", "a.pt", "--infer", "b.pt", "--engine", "x"], ARGPARSE, "invalid choice"),
    (["agree", "--train", "a.pt", "--infer", "b.pt"], ONE_LINE, "--train a.pt: no such file"),
    (["agree", "--train", "a.npy", "--infer", "b.pt"], ONE_LINE, "unknown file type '.npy'"),
    # bench
    (["bench", "--seq", "abc"], ARGPARSE, "--seq: invalid int value"),
    (["bench", "--seed", "-5"], ARGPARSE, "--seed: -5 is outside"),
    (["bench", "--rope-fp32", "1"], ARGPARSE, "unrecognized arguments: 1"),
    pytest.param(["bench", "--seq", "0"], ONE_LINE, "needs a CUDA GPU", marks=NO_GPU),
    # no command
    ([], ARGPARSE, "the following arguments are required: {demo,agree,bench}"),
    (["train"], ARGPARSE, "invalid choice: 'train'"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "kind", "message"), CASES, ids=lambda x: None)
def test_user_errors_print_no_traceback(monkeypatch, tmp_path, argv, kind, message):
    monkeypatch.chdir(tmp_path)  # relative file names resolve to nothing
    monkeypatch.setattr(demo, "_run_demo", _no_run)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code
            assert kind == ARGPARSE, err.getvalue()
    err = err.getvalue()
    assert code == 2 and out.getvalue() == "" and "Traceback" not in err
    assert message in err, err
    if kind == ARGPARSE:
        assert err.startswith("usage: dsa-precision") and err.splitlines()[-1].count("error:") == 1
    else:
        assert err.count("\n") == 1 and err.startswith(f"dsa-precision {argv[0]}: error: "), err


def _no_run(**kwargs):
    raise AssertionError("the demo ran although its arguments are bad")


@pytest.mark.parametrize("command", ["demo", "agree", "bench"])
def test_help_is_plain_text(command, capsys):
    """The descriptions come from module docstrings: no reStructuredText reaches the terminal."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: dsa-precision {command}")
    for markup in ("`", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in text, (markup, [line for line in text.splitlines() if markup in line])
    assert not re.search(r"\*\*[a-z]", text), "**bold**"


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ("``indexer_topk`` and ``-inf``", "indexer_topk and -inf"),
        (":func:`~dsa_precision.indexer_scores`", "indexer_scores"),
        (":func:`dsa_precision.topk_agreement`", "dsa_precision.topk_agreement"),
        (":mod:`.synthetic`, :class:`CliError`", "synthetic, CliError"),
        (":meth:`dsa_precision.picks.TokenLayout.validate_indices`",
         "dsa_precision.picks.TokenLayout.validate_indices"),
        ("**kernels vs package**: x", "kernels vs package: x"),
    ],
)  # fmt: skip
def test_plain_text(text, plain):
    assert cli.plain_text(text) == plain
