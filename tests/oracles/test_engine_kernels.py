"""The engine-kernel oracle loader (dsa_precision.oracles.engine_kernels) without running a kernel:
finding the files, the scoped stand-ins for the engines' imports, the byte comparison. The
kernels themselves run in tests/interpreter/test_engine_kernels.py and on the GPU
(tools/engine_conformance.py)."""

import importlib.util
import os
import sys

import pytest
import torch

from dsa_precision import ENGINE_PROFILES
from dsa_precision.oracles import engine_kernels as ek
from dsa_precision.oracles.engine_model import EngineOperands

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

STAND_IN = """
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

FP8 = current_platform.fp8_dtype()
MX = mqa_logits_use_mx_scales()
"""


def _tree(root, engine, text=STAND_IN):
    for rel in ek.ENGINE_FILES[engine]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_kernel_files_take_the_first_root_that_holds_them(tmp_path, monkeypatch):
    empty, full = tmp_path / "empty", _tree(tmp_path / "full", "vllm")
    empty.mkdir()
    monkeypatch.setenv(ek.ENV_VAR, os.pathsep.join([str(empty), str(full)]))
    files = ek.kernel_files("vllm")
    assert files == (full / ek.ENGINE_FILES["vllm"][0],)
    assert ek.kernel_files("lmdeploy") is None
    assert "holds no lmdeploy/pytorch/kernels/cuda" in ek.missing_reason("lmdeploy")
    with pytest.raises(ValueError, match="engine='sglang' has no kernel oracle"):
        ek.kernel_files("sglang")


def test_missing_reason_names_the_variable(monkeypatch):
    monkeypatch.delenv(ek.ENV_VAR, raising=False)
    assert ek.missing_reason("vllm").startswith(f"{ek.ENV_VAR} is not set")
    with pytest.raises(RuntimeError, match="the vllm kernel oracle cannot run"):
        ek.engine_kernel_operands(None, ENGINE_PROFILES["vllm"], interleaved=False)


def test_profiles_without_an_engine_kernel_are_refused():
    assert ek.oracle_for(ENGINE_PROFILES["vllm"]) == "vllm"
    assert ek.oracle_for(ENGINE_PROFILES["sglang-fused"]) is None
    with pytest.raises(ValueError, match="'vllm-exact' has no kernel oracle"):
        ek.engine_kernel_operands(None, ENGINE_PROFILES["vllm-exact"], interleaved=False)


@needs_triton
def test_engine_imports_are_stand_ins_only_while_loading(tmp_path):
    import triton.language as tl

    path = _tree(tmp_path, "vllm") / ek.ENGINE_FILES["vllm"][0]
    before = {name for name in sys.modules if name.split(".")[0] == "vllm"}
    module = ek.load_module(path, "_test_stand_in", ek._vllm_stubs())
    assert module.FP8 is torch.float8_e4m3fn and module.MX is False and module.tl is tl
    assert {name for name in sys.modules if name.split(".")[0] == "vllm"} == before
    assert "_test_stand_in" not in sys.modules


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 2, 128, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn)
    k = torch.randn(4, 128, generator=g).to(torch.float8_e4m3fn)
    return EngineOperands(q, k, torch.rand(4, generator=g), torch.rand(4, 2, generator=g))


def test_operand_diff_counts_bytes():
    a = _operands()
    b = EngineOperands(a.q.clone(), a.k.clone(), a.k_descale.clone(), a.weights.clone())
    b.q.view(torch.uint8)[0, 0, :3] ^= 1
    b.weights[1, 1] = torch.nextafter(b.weights[1, 1], torch.tensor(2.0))
    nan = torch.tensor(float("nan"))
    a.k_descale[2] = b.k_descale[2] = nan  # the same NaN bits compare equal
    diff = ek.operand_diff(b, a)
    assert diff["q_differ"] == 3 and diff["q_total"] == 4 * 2 * 128
    assert diff["weights_differ"] == 1 and diff["k_differ"] == diff["k_descale_differ"] == 0
    with pytest.raises(ValueError, match="operand k"):
        ek.operand_diff(a, EngineOperands(a.q, a.k[:2], a.k_descale, a.weights))
