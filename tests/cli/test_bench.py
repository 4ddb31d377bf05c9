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
        "--thd",
        "--thd-seq",
        "--thd-weights",
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
        bench, "_run_bench", lambda cfg, *_, **__: seen.append(cfg) or {"results": []}
    )
    assert cli.main(["bench", "--seq", "4096", "--json"]) == 0
    assert seen[0].seqs == (4096,)
    assert json.loads(capsys.readouterr().out) == {
        "dsa_precision_version": dsa_precision.__version__,
        "results": [],
    }


def _thd_row(seq, chunked):
    lens = [seq * w // 10 for w in (4, 1, 3)]
    t = dict(raw_select_dg=2.0, select_dg=2.1, raw_select_cudnn=2.5, select_cudnn=2.55)
    out = {
        "seq": seq, "heads": 64, "lens": [*lens, seq - sum(lens)], "chunks": 1 if not chunked
        else 3, "chunked": chunked, "default_backend": "deepgemm", "times_ms": t,
        "picks_equal_raw": {"cudnn": True, "deepgemm": not chunked},
        "overhead": dict(select_dg=2.1 / 2.0, select_cudnn=2.55 / 2.5),
    }  # fmt: skip
    if not chunked:
        t |= dict(raw_score_dg=0.4, raw_score_dg_clean=0.5, score_dg=0.44, score_dg_window=0.41,
                  raw_score_cudnn=0.6, score_cudnn=0.6)  # fmt: skip
        out["overhead"] |= dict(score_dg=0.44 / 0.4, score_dg_clean=0.44 / 0.5,
                                score_dg_window=0.41 / 0.4, score_cudnn=1.0)  # fmt: skip
        out["host_us"] = dict(raw_score_dg=40.0, score_dg=75.5, score_dg_window=50.5,
                              raw_score_cudnn=60.0, score_cudnn=80.0)  # fmt: skip
    return out


def test_thd_tables_put_the_default_backend_first():
    report = {
        "device": "NVIDIA H200",
        "config": dict(
            batch=1,
            topk=2048,
            reps=20,
            rope_fp32=True,
            hadamard=False,
            chunked_from=32768,
            long_reps=5,
        ),
        "thd": [_thd_row(8192, False), _thd_row(65536, True)],
    }
    lines = format_tables(report).splitlines()
    select = lines.index(next(x for x in lines if x.startswith("packed THD, FP8: indexer_select")))
    assert "default path (backend='auto') first" in lines[select]
    header = lines[select + 1].split("|")
    assert header[1].split() == ["default", "select"] and header[2].split()[0] == "dg"
    small, large = lines[select + 2], lines[select + 3]
    assert [p.split() for p in small.split("|")] == [
        ["8192", "64", "3276", "1"], ["deepgemm", "2.100"], ["2.000", "2.100", "1.05"],
        ["2.500", "2.550", "1.02"], ["yes/yes"],
    ]  # fmt: skip
    assert large.split("|")[0].split() == ["65536", "64", "26214", "3"]
    assert large.split("|")[-1].split() == ["NO/yes"]  # a mismatch is shown, not hidden
    assert "T=8192: 3276, 819, 2457, 1640" in lines[select + 4]
    assert "T >= 32768: selection only, median of 5 reps" in lines[select + 4]
    score = lines.index(next(x for x in lines if x.startswith("packed THD, FP8: indexer_scores")))
    rows = [x for x in lines[score:] if x.lstrip().startswith(("8192", "65536"))]
    assert len(rows) == 1  # the long packing is timed selected only
    assert [p.split() for p in rows[0].split("|")] == [
        ["8192", "64"], ["0.400", "0.500", "0.440", "1.10", "0.88", "0.410", "1.02"],
        ["0.600", "0.600", "1.00"], ["40.0", "75.5", "50.5", "60.0", "80.0"],
    ]  # fmt: skip
