"""``python -m dsa_precision bench`` on a machine without a GPU: help, a clear error, the table."""

import subprocess
import sys

import pytest
import torch

from dsa_precision.bench import format_tables


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
        "--ceilings",
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
    return {
        "seq": seq,
        "heads": 64,
        "batch": 1,
        "chunked": chunked,
        "topk_derived": chunked,
        "times_ms": dict(
            prep_fused=0.3,
            prep_torch=9.0,
            prep_bf16=2.0,
            score_bf16=4.6,
            score_fp8=2.7,
            topk=0.8,
            e2e_bf16=7.0,
            e2e_fp8=3.9,
        ),
        "tflops": dict(score_bf16=480.0, score_fp8=800.0, e2e_bf16=300.0, e2e_fp8=560.0),
        "fp8_speedup": {"score": 4.6 / 2.7, "e2e": 7.0 / 3.9},
        "prep_share_of_fp8_score": 0.3 / 2.7,
        "prep_fused_tb_per_s": 1.5,
        "peak_extra_mib": dict(
            prep_fused=1.0, select_bf16=1100.0, select_fp8=1100.0, e2e_bf16=2100.0, e2e_fp8=1600.0
        ),
    }


def test_table_layout():
    report = {
        "config": dict(batch=1, topk=2048, reps=20, rope_fp32=True, hadamard=True),
        "ceilings": dict(bf16_matmul_tflops=700.0, fp8_scaled_mm_tflops=1300.0, copy_tb_per_s=4.1),
        "results": [_result(16384, False), _result(65536, True)],
    }
    text = format_tables(report)
    lines = text.splitlines()
    assert lines[0].startswith("ceilings: bf16 matmul 700 TFLOP/s")
    row = next(line for line in lines if line.lstrip().startswith("16384"))
    assert "11.1%" in row and "1.79" in row and "1600" in row
    assert any(line.startswith("* chunked") for line in lines)
