"""``python -m dsa_precision bench`` on a machine without a GPU: help, a clear error, the table."""

import subprocess
import sys

import pytest
import torch

from dsa_precision.cli.bench import format_tables


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dsa_precision", "bench", *args], capture_output=True, text=True
    )


def test_help_documents_every_flag():
    out = _cli("--help")
    assert out.returncode == 0
    for flag in (
        "--seq",
        "--heads",
        "--reps",
        "--warmup",
        "--json",
        "--chunked-from",
        "--chunk-bytes",
        "--topk",
        "--rope-fp32",
        "--hadamard",
        "--torch-reference",
    ):
        assert flag in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_without_a_gpu_one_line_and_exit_2():
    out = _cli("--seq", "4096", "--heads", "64", "--reps", "20")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dsa-precision bench: error: bench needs a CUDA GPU; none is visible to this process."
    ]


def _result(seq, chunked):
    t = dict(prep_bf16=2.0, prep_fp8=0.3, e2e_bf16=9.0, e2e_fp8=4.5)
    out = {
        "seq": seq,
        "heads": 64,
        "batch": 1,
        "chunked": chunked,
        "times_ms": t,
        "peak_extra_mib": dict(e2e_bf16=2100.0, e2e_fp8=1600.0),
        "e2e_ratio": 2.0,
    }
    if not chunked:
        t |= dict(raw_score_bf16=4.6, score_bf16=4.7, raw_score_fp8=2.6, score_fp8=2.7,
                  raw_topk=1.2, raw_topk_val=1.25, topk=1.3, api_bf16=7.0,
                  api_fp8=4.0)  # fmt: skip
        out |= dict(
            overhead=dict(
                score_bf16=4.7 / 4.6, score_fp8=2.7 / 2.6, topk=1.3 / 1.2, topk_vs_val=1.3 / 1.25
            ),
            raw_e2e_ms=dict(bf16=7.8, fp8=4.1),
            e2e_bound=7.8 / 4.1,
            e2e_share_of_bound=2.0 / (7.8 / 4.1),
            api_ratio=7.0 / 4.0,
            host_us=dict(
                raw_score_fp8=60.0, score_fp8=90.0, raw_topk_val=70.0, topk=105.0, select_fp8=250.0
            ),
        )
    return out


def test_table_layout():
    report = {
        "device": "NVIDIA H200",
        "config": dict(batch=1, topk=2048, reps=20, rope_fp32=True, hadamard=True),
        "results": [_result(16384, False), _result(65536, True)],
    }
    lines = format_tables(report).splitlines()
    assert lines[0].startswith("NVIDIA H200: B=1 D=128 causal, top-k 2048")
    # The default path first: the backend 'auto' took and its FP8 time.
    assert lines[2].startswith("the default path (backend='auto')")
    rows = [line for line in lines if line.lstrip().startswith("16384")]
    assert rows[0].split("|")[1].split()[0] == "cudnn"
    kernels = rows[1]
    assert "4.600" in kernels and "1.02" in kernels and "1.08" in kernels  # raw, pkg, x
    assert kernels.split("|")[-1].split() == ["1.200", "1.250", "1.300", "1.08", "1.04"]
    host = rows[2]
    assert [part.split() for part in host.split("|")[1:]] == [
        ["60.0", "90.0", "1.50"], ["70.0", "105.0", "1.50"], ["250.0"], ["-", "-"]
    ]  # fmt: skip
    e2e = rows[3]
    assert "2.00" in e2e and "1.90" in e2e and "105 %" in e2e and "1.75" in e2e
    chunked = [line for line in lines if line.lstrip().startswith("65536")][1]
    assert "2100" in chunked and "1600" in chunked and chunked.count("-") >= 2


def test_json_carries_the_package_version(monkeypatch, capsys):
    """The report (measured on a GPU, stood in for here) is printed with the package version."""
    import json

    import dsa_precision
    from dsa_precision import cli
    from dsa_precision.cli import bench

    seen = []
    monkeypatch.setattr(
        bench, "run_bench", lambda cfg, *_, **__: seen.append(cfg) or {"results": []}
    )
    assert cli.main(["bench", "--seq", "4096", "--json"]) == 0
    assert seen[0].seqs == (4096,)
    assert json.loads(capsys.readouterr().out) == {
        "dsa_precision_version": dsa_precision.__version__,
        "results": [],
    }
