"""``dsa-precision demo``: run in-process at a small size and check what it reports."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch

from dsa_precision import cli
from dsa_precision.demo import CONFIGS, head_weights
from dsa_precision.scoring import prepare_scoring_operands
from dsa_precision.synthetic import synthetic_indexer_inputs

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
    assert [c.short_str() for c in CONFIGS] == NAMES
    assert (demo_json["seq_len"], demo_json["topk"], demo_json["n_heads"]) == (SEQ, TOPK, 32)
    assert demo_json["backend"] == "torch" and demo_json["first_row"] == TOPK
    for c in demo_json["configs"]:
        for key in ("member_agreement", "rows_identical"):
            assert 0.0 <= c[key] <= 1.0
        # Rows before position TOPK keep every visible key on both sides and are not compared.
        assert c["rows"] == SEQ - TOPK
        assert c["members"] == (SEQ - TOPK) * TOPK
        # Every compared row has TOPK picks, so the flips are exactly the missing members.
        assert c["flipped_mean"] == pytest.approx((1 - c["member_agreement"]) * TOPK)
        assert c["rows_identical"] <= c["member_agreement"]
        assert 0 <= c["flipped_max"] <= TOPK
        assert c["boundary_margin"] > 0 and c["score_error"] >= 0


def test_rope_fp32_fp8_reproduces_inference_and_baseline_does_not(demo_json):
    by_name = {c["name"]: c for c in demo_json["configs"]}
    both = by_name["rope_fp32+fp8"]
    assert both["member_agreement"] == 1.0 and both["rows_identical"] == 1.0
    assert both["flipped_max"] == 0 and both["score_error"] == 0.0
    assert both["boundary_margin"] == demo_json["inference_boundary_margin"]
    base = by_name["baseline"]
    assert base["member_agreement"] < 1.0 and base["rows_identical"] < 1.0
    assert base["score_error"] > 0


def test_text_output_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "agreement.png"
    code, out, err = run_cli("demo", "--seq", "128", "--topk", "16", "--plot", str(png))
    assert code == 0, err
    for name in ["inference", *NAMES]:
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "compared: 112 query rows" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_variant_bf16_head_weights_breaks_exact_agreement():
    code, out, err = run_cli(
        "demo", "--seq", str(SEQ), "--topk", str(TOPK), "--engine-head-weights", "bf16", "--json"
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["engine"]["head_weights"] == "bf16"
    both = result["configs"][-1]
    assert both["name"] == "rope_fp32+fp8" and both["score_error"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq", "64", "--topk", "64"], "--topk 64 must be below"),
        (["--seq", "64", "--topk", "8", "--plot", "/nonexistent-dir/x.png"], "does not exist"),
    ],
)
def test_errors_are_one_line(argv, message):
    code, out, err = run_cli("demo", *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


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
    assert torch.equal(a.k_norm.weight, b.k_norm.weight)
    assert not torch.equal(a.q, c.q)


def test_fp32_head_weights_fold_to_vllm_order():
    """``head_weights("fp32")`` with the q descale folded by FP8 scoring equals vLLM's
    ``w * q_scale * softmax_scale * n_head**-0.5`` bit for bit."""
    for n_heads in (32, 64):
        x = synthetic_indexer_inputs(64, n_heads=n_heads)
        w = head_weights(x.w, 128, "fp32").transpose(0, 1)
        q = x.q.transpose(0, 1).float()
        ops = prepare_scoring_operands(q, x.k.transpose(0, 1), w, scoring_precision="fp8")
        vllm = x.w.transpose(0, 1).float() * ops.q_scale * 128**-0.5 * n_heads**-0.5
        assert torch.equal(ops.w, vllm)


def test_fp32_head_weights_variants():
    """For H=32 the two scale products commute bit for bit (both constants are fp32(sqrt 2) times
    a power of two) but premultiplying them (2**-6) differs; for H=64 all forms agree."""
    w = synthetic_indexer_inputs(256, n_heads=32).w
    seq = head_weights(w, 128, "fp32")
    assert torch.equal(seq, (w.float() * 32**-0.5) * 128**-0.5)
    assert not torch.equal(seq, head_weights(w, 128, "fp32-premultiplied"))
    w64 = synthetic_indexer_inputs(256, n_heads=64).w
    assert torch.equal(head_weights(w64, 128, "fp32"), head_weights(w64, 128, "fp32-premultiplied"))


def test_bf16_head_weights_match_megatron(megatron_parallel, cpu_rotary):
    from .megatron_utils import make_config, make_indexer

    config = make_config(dsa_indexer_n_heads=32)
    indexer = make_indexer(config)
    x = torch.randn(16, 2, config.hidden_size, dtype=torch.bfloat16)
    qr = torch.randn(16, 2, config.q_lora_rank, dtype=torch.bfloat16)
    with torch.no_grad():
        _, _, weights = indexer.forward_before_topk(x, qr)
        w_proj, _ = indexer.linear_weights_proj(x)
    ours = head_weights(w_proj, config.dsa_indexer_head_dim, "bf16")
    assert ours.dtype == weights.dtype == torch.bfloat16
    assert torch.equal(ours, weights)


def test_model_variants_still_reproduce_inference():
    code, out, err = run_cli(
        "demo", "--seq", "128", "--topk", "16", "--heads", "64", "--hadamard", "--rope-interleaved",
        "--engine-amax-floor", "1e-10", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["n_heads"] == 64
    assert result["engine"] == {
        "hadamard": True,
        "rope_interleaved": True,
        "amax_floor": 1e-10,
        "head_weights": "fp32",
    }
    assert result["configs"][-1]["rows_identical"] == 1.0


def test_cudnn_path_with_recording_fake(monkeypatch):
    """The --device cuda code path (explicit backend="cudnn") on the CPU, through the recording
    fake of cudnn.DSA: every scoring and top-k call reaches the kernel API, none falls back."""
    from dsa_precision import demo, reset_scoring_calls, scoring_calls

    from . import fake_cudnn

    fake = fake_cudnn.install(monkeypatch)
    monkeypatch.setitem(demo.BACKENDS, "cpu", "cudnn")
    reset_scoring_calls()
    run = demo.run_demo(seq_len=96, topk=16)
    assert run.backend == "cudnn"
    assert scoring_calls(backend="torch") == 0 and scoring_calls(backend="cudnn") == 5
    # inference, then baseline, rope_fp32, fp8, rope_fp32+fp8
    assert [c["precision"] for c in fake.forward_calls] == ["fp8", "bf16", "bf16", "fp8", "fp8"]
    # BF16 scoring keeps Megatron's bf16 head weights; FP8 folds the q descale into float32.
    f32, bf16 = torch.float32, torch.bfloat16
    assert [c["w_dtype"] for c in fake.forward_calls] == [f32, bf16, bf16, f32, f32]
    assert all(c["top_k"] == 16 and c["deterministic"] for c in fake.topk_calls)
    assert len(fake.topk_calls) == 5
    assert run.configs[-1].agreement["rows_identical"] == 1.0


def test_cudnn_unusable_is_an_error_not_a_fallback(monkeypatch):
    from dsa_precision import demo

    monkeypatch.setitem(demo.BACKENDS, "cpu", "cudnn")
    code, out, err = run_cli("demo", "--seq", "64", "--topk", "8")
    assert code == 2 and out == ""
    assert "backend='cudnn' cannot score this call" in err and err.count("\n") == 1
