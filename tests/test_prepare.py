"""prepare_indexer_operands: the reference path, and when the fused kernel applies (CPU)."""

import subprocess
import sys

import pytest
import torch

from dsa_precision import prepare
from dsa_precision.prepare import fused_unsupported_reason, prepare_indexer_operands
from dsa_precision.scoring import prepare_scoring_operands

from .fused_cases import assert_bit_identical, make_case


def _prepare(case, **kw):
    return prepare_indexer_operands(
        case.pre, case.q, case.k, case.w, case.freqs, cu_seqlens=case.cu_seqlens, **kw
    )


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("packed", [None, [3, 5]], ids=["bshd", "thd"])
def test_reference_path_is_preprocess_then_prepare_scoring_operands(precision, packed):
    case = make_case(rope_fp32=True, hadamard=True, packed=packed)
    got = _prepare(case, scoring_precision=precision, sm_scale=0.5, mscale=1.2, impl="torch")
    q, k = case.pre(case.q, case.k, case.freqs, mscale=1.2, cu_seqlens=case.cu_seqlens)
    want = prepare_scoring_operands(
        q.transpose(0, 1),
        k.transpose(0, 1),
        case.w.transpose(0, 1),
        scoring_precision=precision,
        sm_scale=0.5,
    )
    if precision == "fp8":
        assert_bit_identical(got, want)
    else:
        assert torch.equal(got.q, want.q) and torch.equal(got.k, want.k)
    assert got.q.shape[:3] == (case.q.shape[1], case.q.shape[0], case.q.shape[2])


def test_auto_on_cpu_is_the_reference_and_has_no_autograd():
    case = make_case(rope_fp32=True)
    case.q.requires_grad_(True)
    auto = _prepare(case, scoring_precision="fp8", impl="auto")
    assert_bit_identical(auto, _prepare(case, scoring_precision="fp8", impl="torch"))
    assert not auto.w.requires_grad


def test_explicit_triton_that_cannot_run_raises_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case(rope_fp32=True)
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        _prepare(case, scoring_precision="fp8", impl="triton")
    with pytest.raises(RuntimeError, match="BF16 scoring"):
        _prepare(case, scoring_precision="bf16", impl="triton")
    with pytest.raises(ValueError, match="impl"):
        _prepare(case, scoring_precision="fp8", impl="cuda")


def test_unsupported_cases_name_their_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to the case checks
    case = make_case(rope_fp32=False, hadamard=True)

    def reason(c=case, **kw):
        return fused_unsupported_reason(c.pre, c.q, c.k, c.w, scoring_precision="fp8", **kw)

    monkeypatch.setattr(prepare, "HAVE_FAST_HADAMARD", True)
    assert "fast_hadamard_transform" in reason()
    monkeypatch.setattr(prepare, "HAVE_FAST_HADAMARD", False)
    assert "2**-100" in reason(amax_floor=1e-35)
    half = make_case(rope_fp32=True, dtype=torch.float16)
    assert "float16" in reason(half)
    rms = make_case(rope_fp32=True)
    rms.pre.k_norm = torch.nn.RMSNorm(128)
    assert "RMSNorm" in reason(rms)


def test_deciding_does_not_import_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from dsa_precision.prepare import fused_unsupported_reason\n"
        "from dsa_precision.preprocess import IndexerPreprocess\n"
        "pre = IndexerPreprocess(128, 64, rope_fp32=True)\n"
        "q, k, w = torch.zeros(2, 1, 32, 128), torch.zeros(2, 1, 128), torch.zeros(2, 1, 32)\n"
        "print(fused_unsupported_reason(pre, q, k, w, scoring_precision='fp8'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "CUDA" in out.stdout
