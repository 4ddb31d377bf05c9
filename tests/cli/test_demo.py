"""``dsa-precision demo``: run in-process at small sizes and check what it reports.

The inference side (``dsa_precision.cli.engine_model``) is an independent model of each engine
profile; the training side is the package. With ``rope_fp32+fp8`` the package must reproduce every
profile's picks on the CPU (both sides exact), and the baseline must not.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import pathlib
import re
import sys

import pytest
import torch

from dsa_precision import ENGINE_PROFILES, cli
from dsa_precision.cli import demo
from dsa_precision.cli.synthetic import synthetic_indexer_inputs

SEQ, TOPK = 512, 64
NAMES = ["baseline", "rope_fp32", "fp8", "rope_fp32+fp8"]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo_json():
    code, out, err = run_cli("demo", "--seq", str(SEQ), "--topk", str(TOPK), "--json")
    assert code == 0, err
    return json.loads(out)  # stdout holds exactly one JSON object


def test_json_structure(demo_json):
    assert [c["name"] for c in demo_json["configs"]] == NAMES
    assert (demo_json["seq_len"], demo_json["topk"], demo_json["n_heads"]) == (SEQ, TOPK, 32)
    assert demo_json["training_backend"] == "torch" and demo_json["first_row"] == TOPK
    inference = demo_json["inference"]
    assert (inference["engine"], inference["scores"]) == ("vllm", "exact")
    assert inference["operands"].endswith("not the engine's kernels: they run on CUDA")
    for c in demo_json["configs"]:
        for key in ("member_agreement", "rows_identical"):
            assert 0.0 <= c[key] <= 1.0
        # Rows before position TOPK keep every visible key on both sides and are not compared.
        assert c["rows"] == SEQ - TOPK and c["members"] == (SEQ - TOPK) * TOPK
        # Every compared row has TOPK picks, so the flips are exactly the missing members.
        assert c["flipped_mean"] == pytest.approx((1 - c["member_agreement"]) * TOPK)
        assert c["rows_identical"] <= c["member_agreement"]
        assert c["boundary_margin"] > 0 and c["score_error"] >= 0


def _model_flags(engine) -> list[str]:
    flags = ["--hadamard"] if engine.hadamard else []
    return flags + (["--rope-interleaved"] if engine.rope_interleaved else [])


@pytest.mark.parametrize("name", sorted(ENGINE_PROFILES))
def test_rope_fp32_fp8_reproduces_every_engine_and_baseline_does_not(name):
    engine = ENGINE_PROFILES[name]
    code, out, err = run_cli(
        "demo", "--seq", "384", "--topk", "48", "--engine", name, *_model_flags(engine), "--json"
    )
    assert code == 0, err
    result = json.loads(out)
    by_name = {c["name"]: c for c in result["configs"]}
    both = by_name["rope_fp32+fp8"]
    assert both["rows_identical"] == 1.0 and both["score_error"] == 0.0, name
    assert both["boundary_margin"] == result["inference_boundary_margin"]
    base = by_name["baseline"]
    assert base["rows_identical"] < 1.0 and base["score_error"] > 0, name


def test_engines_that_round_to_bf16_are_matched_by_fp8_alone():
    """LMDeploy keeps LayerNorm and RoPE in BF16 arithmetic: Megatron's BF16 preprocessing with
    the engine's FP8 rules reproduces it; vLLM (FP32 preprocessing) needs rope_fp32 too."""
    rows = {}
    for name in ("lmdeploy", "vllm"):
        code, out, err = run_cli("demo", "--seq", "384", "--topk", "48", "--engine", name, "--json")
        assert code == 0, err
        rows[name] = {c["name"]: c["rows_identical"] for c in json.loads(out)["configs"]}
    assert rows["lmdeploy"]["fp8"] == 1.0
    assert rows["vllm"]["fp8"] < 1.0 and rows["vllm"]["rope_fp32+fp8"] == 1.0


def test_the_inference_side_shares_no_numerics_code_with_the_training_side():
    from dsa_precision.cli import engine_model

    source = pathlib.Path(engine_model.__file__).read_text()
    modules = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    forbidden = {
        "preprocess", "rope", "exact_math", "quantize", "operands", "prepare", "preprocess_kernel",
        "rows", "scoring", "select", "topk", "kernels", "demo_operands",
    }  # fmt: skip
    assert not {m.rsplit(".", 1)[-1] for m in modules} & forbidden, modules


def test_without_conformance_the_demo_runs_the_engine_model_and_says_why(monkeypatch, demo_json):
    """A pip install has no ``conformance/`` (the engine oracles stay in the source checkout): the
    inference side is the engine model, the numbers are the same, and the report says why."""
    monkeypatch.setitem(sys.modules, "conformance", None)
    monkeypatch.setitem(sys.modules, "conformance.inference", None)
    code, out, err = run_cli("demo", "--seq", str(SEQ), "--topk", str(TOPK), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["inference"]["operands"] == (
        "an independent model of its operands (dsa_precision.cli.engine_model); not the engine's "
        "kernels: they run from a source checkout (conformance/)"
    )
    assert result["configs"] == demo_json["configs"]


def test_text_output_says_which_side_is_which(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "agreement.png"
    code, out, err = run_cli("demo", "--seq", "128", "--topk", "16", "--plot", str(png))
    assert code == 0, err
    for name in ["inference", *NAMES]:
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "an independent model of its operands" in out and "compared: 112 query rows" in out
    assert "both sides use exact arithmetic here" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq", "64", "--topk", "64"], "--topk 64 must be below"),
        (["--seq", "64", "--topk", "8", "--plot", "/nonexistent-dir/x.png"], "does not exist"),
        (["--engine", "sglang-unfused"], "applies the Hadamard rotation.*--hadamard=False"),
        (["--backend", "cudnn"], "--backend cudnn runs on --device cuda"),
    ],
)
def test_errors_are_one_line(argv, message):
    code, out, err = run_cli("demo", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_json_carries_the_package_version(demo_json):
    import dsa_precision

    assert demo_json["dsa_precision_version"] == dsa_precision.__version__


def test_footer_defines_every_column():
    code, out, err = run_cli("demo", "--seq", "96", "--topk", "16")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config "))
    columns = [c for c in lines[header].split("  ") if c.strip()][1:]
    assert len(columns) == 6, columns
    footer = "\n".join(lines[header + 1 :])
    for column in columns:
        column = column.strip()
        assert re.search(rf"(^|, ){re.escape(column)}[:,]", footer, re.M), column


def _no_run(**kwargs):
    raise AssertionError("the demo ran before its arguments were checked")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("x.txt", r"matplotlib cannot write \.txt files; name a file ending in one of .*\.png"),
        ("x", "matplotlib cannot write a file name without a suffix"),
    ],
)
def test_plot_format_is_checked_before_the_demo_runs(monkeypatch, tmp_path, name, message):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(demo, "_run_demo", _no_run)
    code, out, err = run_cli("demo", "--seq", "64", "--topk", "8", "--plot", str(tmp_path / name))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert re.search(message, err), err


def test_plot_other_matplotlib_formats(tmp_path):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "agreement.svg"
    code, _, err = run_cli("demo", "--seq", "64", "--topk", "8", "--plot", str(svg))
    assert code == 0, err
    assert svg.read_text().lstrip().startswith("<?xml")


def test_too_few_compared_rows_are_refused(monkeypatch):
    monkeypatch.setattr(demo, "_run_demo", _no_run)
    code, out, err = run_cli("demo", "--seq", "130", "--topk", "128")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "leaves 2 query rows with more visible keys than topk (positions 128..129" in err
    assert f"use --seq >= {128 + demo._MIN_COMPARED_ROWS} or a smaller --topk" in err


@pytest.mark.parametrize("seed", ["-1", str(2**64), "1.5"])
def test_seed_out_of_range_is_an_argparse_error(monkeypatch, capsys, seed):
    monkeypatch.setattr(demo, "_run_demo", _no_run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--seed", seed])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dsa-precision demo") and "Traceback" not in err
    assert "argument --seed: " in err and seed in err, err


def test_largest_seed_runs():
    code, out, err = run_cli("demo", "--seq", "64", "--topk", "8", "--seed", str(2**64 - 1),
                             "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["seed"] == 2**64 - 1


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    code, _, err = run_cli("demo", "--seq", "64", "--topk", "8", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "--plot needs matplotlib" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_unavailable():
    code, _, err = run_cli("demo", "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err


def test_synthetic_inputs_are_deterministic():
    a = synthetic_indexer_inputs(96, seed=3)
    b = synthetic_indexer_inputs(96, seed=3)
    c = synthetic_indexer_inputs(96, seed=4)
    assert a.q.shape == (96, 1, 32, 128) and a.k.shape == (96, 1, 128) and a.w.shape == (96, 1, 32)
    assert a.q.dtype == a.k.dtype == a.w.dtype == a.k_norm.weight.dtype == torch.bfloat16
    assert a.freqs.shape == (96, 1, 1, 64) and a.freqs.dtype == torch.float32
    for name in ("q", "k", "w", "freqs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.q, c.q)


def test_cudnn_path_with_recording_fake(monkeypatch):
    """The --device cuda training path (backend="cudnn") on the CPU, through the recording fake of
    cudnn.DSA: every training scoring and top-k call reaches the kernel API, none falls back."""
    from dsa_precision import reset_scoring_calls, scoring_calls

    from ..support import fake_cudnn

    fake = fake_cudnn.install(monkeypatch)
    reset_scoring_calls()
    run = demo._run_demo(seq_len=96, topk=16, backend="cudnn")
    assert run.backend == "cudnn" and run.inference_kernel == "exact"
    assert scoring_calls(backend="torch") == 0 and scoring_calls(backend="cudnn") == 4
    # baseline, rope_fp32, fp8, rope_fp32+fp8
    assert [c["precision"] for c in fake.forward_calls] == ["bf16", "bf16", "fp8", "fp8"]
    assert len(fake.topk_calls) == 4
