"""When the fused preprocess + quantize kernel builds the operands (dsa_precision.preprocess_kernel): only where it gives the reference's bytes, decided without Triton."""

import os
import subprocess
import sys

import pytest
import torch

from dsa_precision import (
    IndexerPrecisionConfig,
    IndexerPreprocess,
    prepare_indexer_operands,
    prepare_scoring_operands,
    preprocess_kernel,
    quantize_e4m3_ue8m0,
)
from dsa_precision import prepare as prepare_module
from dsa_precision.prepare import _fused_unsupported_reason

from .support.configs import FP8, ROOT
from .support.helpers import assert_bitwise_equal, indexer_projections, scoring_carriers


def test_auto_on_cpu_is_the_reference(monkeypatch):
    """impl='auto' launches the fused kernel only where it runs: never for CPU tensors, but under
    Triton's interpreter (which runs it on CPU tensors). A recorder stands in for the launch."""
    from dsa_precision.kernels import triton_unavailable_reason

    launches, made = [], []  # the recorder returns operands (those of the reference, below)
    monkeypatch.setattr(
        prepare_module, "_quantize_triton", lambda *a: launches.append(a) or made[0]
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, w = scoring_carriers()
    auto = prepare_scoring_operands(q, k, w, config=FP8, impl="auto")
    assert not launches
    q8, qs = quantize_e4m3_ue8m0(q)  # the reference's bytes (default engine)
    assert_bitwise_equal(auto.q, q8, "q")
    assert_bitwise_equal(auto.weights, w.float() * qs, "weights")
    made.append(auto)
    if triton_unavailable_reason() is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert prepare_scoring_operands(q, k, w, config=FP8, impl="auto") is auto
        assert len(launches) == 1


_INTERPRETER_CHECK = """
import torch
from dsa_precision import ENGINE_PROFILES, IndexerPrecisionConfig, prepare_scoring_operands
g = torch.Generator().manual_seed(3)
lanes = torch.logspace(-8, 6, 128, base=2.0)
q = torch.randn(2, 3, 32, 128, generator=g) * lanes
k = torch.randn(2, 5, 128, generator=g) * lanes.flip(0)
w = (torch.randn(2, 3, 32, generator=g) * 0.02).to(torch.bfloat16)
q[1, 2, 4, 9] = float("nan")
# Every engine once (carrier and sm_scale alternating), the default engine in all four ways.
cases = [("vllm-exact", c, s) for c in (torch.float32, torch.bfloat16) for s in (1.0, 0.3)]
cases += [
    (name, (torch.float32, torch.bfloat16)[i % 2], (1.0, 0.3)[i // 2 % 2])
    for i, name in enumerate(n for n in ENGINE_PROFILES if n != "vllm-exact")
]
checked = 0
for name, carrier, sm_scale in cases:
    args = (q.to(carrier), k.to(carrier), w)
    config = IndexerPrecisionConfig(scoring_precision="fp8", engine=ENGINE_PROFILES[name])
    kw = dict(config=config, sm_scale=sm_scale)
    try:
        got = prepare_scoring_operands(*args, impl="triton", **kw)
    except RuntimeError as exc:  # an engine the kernel does not reproduce: named
        assert "impl='triton' cannot build" in str(exc), exc
        continue
    want = prepare_scoring_operands(*args, impl="torch", **kw)
    for field in ("q", "k", "weights", "q_descale", "k_descale"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, field)
        ints = {1: torch.uint8, 4: torch.int32}[a.element_size()]
        assert torch.equal(a.view(ints), b.view(ints)), (name, carrier, sm_scale, field)
    checked += 1
print("checked", checked)
"""


def test_fused_kernel_in_the_interpreter_builds_the_reference_bytes():
    """prepare_scoring_operands(impl="triton") runs the fused kernel on transposed carrier views;
    Triton's CPU interpreter runs it here (the compiled kernel: tests/gpu)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_CHECK],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    checked = int(out.stdout.split("checked")[-1])
    assert checked >= 4, out.stdout  # at least the default engine, both carriers and scales


def test_deciding_and_preparing_on_cpu_need_no_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from dsa_precision import IndexerPrecisionConfig, prepare_scoring_operands, indexer_select\n"
        "q, k, w = torch.randn(1, 4, 32, 128), torch.randn(1, 4, 128), torch.randn(1, 4, 32)\n"
        "fp8 = IndexerPrecisionConfig(scoring_precision='fp8')\n"
        "ops = prepare_scoring_operands(q, k, w, config=fp8)\n"
        "print(indexer_select(ops, topk=2).tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("[[[0, -1], [0, 1], ")  # row 0 sees one key, row 1 two


def test_fused_kernel_reasons(monkeypatch):
    pre, q, k, w, freqs = indexer_projections()
    fp8 = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "on cpu" in _fused_unsupported_reason(pre, q, k, w, config=fp8)
    with pytest.raises(RuntimeError, match=r"impl='triton' cannot build these operands.*on cpu"):
        prepare_indexer_operands(pre, q, k, w, freqs, config=fp8, impl="triton")
    bf16 = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="bf16")
    assert "BF16" in _fused_unsupported_reason(pre, q, k, w, config=bf16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the case checks
    half = [t.to(torch.float16) for t in (q, k, w)]
    assert "float16" in _fused_unsupported_reason(pre, *half, config=fp8)
    rms = IndexerPreprocess(128, 64, rope_fp32=True, k_norm=torch.nn.RMSNorm(128))
    assert "RMSNorm" in _fused_unsupported_reason(rms, q, k, w, config=fp8)
    plain = IndexerPreprocess(128, 64, rope_fp32=False, rotate_activation=True)
    monkeypatch.setattr(preprocess_kernel, "HAVE_FAST_HADAMARD", True)
    cfg = IndexerPrecisionConfig(rope_fp32=False, scoring_precision="fp8")
    assert "fast_hadamard_transform" in _fused_unsupported_reason(plain, q, k, w, config=cfg)
