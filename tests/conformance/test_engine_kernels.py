"""The engine-kernel oracle loader (conformance.engine_kernels) without running a kernel:
finding the files, the scoped stand-ins for the engines' imports, the byte comparison. The
kernels themselves run in tests/interpreter/test_engine_kernels.py and on the GPU
(tools/engine_conformance.py)."""

import importlib.util
import os
import sys

import pytest
import torch

from conformance import engine_kernels as ek
from conformance import sglang_jit, sglang_unfused
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.engine_model import EngineOperands

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
    with pytest.raises(ValueError, match="engine='vllm-exact' has no kernel oracle"):
        ek.kernel_files("vllm-exact")
    # sglang-unfused's files are two wheels' (SGLang's and FlashInfer's): its own check, by name.
    assert "holds no sglang/srt/layers/attention/dsa/dsa_indexer.py" in ek.missing_reason(
        "sglang-unfused"
    )


def test_missing_reason_names_the_variable(monkeypatch):
    monkeypatch.delenv(ek.ENV_VAR, raising=False)
    assert ek.missing_reason("vllm").startswith(f"{ek.ENV_VAR} is not set")
    with pytest.raises(RuntimeError, match="the vllm kernel oracle cannot run"):
        ek.engine_kernel_operands(None, ENGINE_PROFILES["vllm"], interleaved=False)


def test_profiles_without_an_engine_kernel_are_refused():
    assert ek.oracle_for(ENGINE_PROFILES["vllm"]) == "vllm"
    assert ek.oracle_for(ENGINE_PROFILES["sglang-fused"]) is None  # JIT CUDA, not yet compared
    assert ek.JIT_ORACLE_ENGINES == {"sglang-fused": "sglang", "sglang-unfused": "sglang-unfused"}
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


# ------------------------------------------------------------------ SGLang's JIT CUDA kernels

SGLANG_WHEEL_FILES = ek.kernel_files("sglang")  # DSA_ENGINE_KERNELS at collection, or None
needs_sglang_files = pytest.mark.skipif(
    SGLANG_WHEEL_FILES is None,
    reason=f"{ek.ENV_VAR} holds no SGLang 0.5.23 files (docs/gpu-validation.md recipe)",
)


def test_sglang_files_that_are_not_the_wheels_are_named(tmp_path):
    files = tuple(_tree(tmp_path, "sglang", text="// not SGLang's\n") / f for f in
                  ek.ENGINE_FILES["sglang"])  # fmt: skip
    source = ek._release("sglang", files)
    assert source.startswith(f"unknown release ({len(files)} files; not the wheel's: ")
    assert source.endswith(" ".join(ek.ENGINE_FILES["sglang"]) + ")")
    sglang_files = len(files) + len(ek.ENGINE_FILES["sglang-rope"])
    assert sum(v == "sglang 0.5.23" for v in ek.KNOWN_SHA256.values()) == sglang_files


@needs_sglang_files
def test_sglang_wheel_files_are_recognised():
    assert ek._release("sglang", SGLANG_WHEEL_FILES) == (
        f"sglang 0.5.23 ({len(ek.ENGINE_FILES['sglang'])} files)"
    )


def test_sglang_toolchain_reason_names_what_is_missing(monkeypatch, tmp_path):
    if importlib.util.find_spec("tvm_ffi") is None:
        assert ek.sglang_toolchain_reason().startswith("apache-tvm-ffi is not installed")
        return
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert ek.sglang_toolchain_reason() == (
        f"no nvcc at {tmp_path}/bin/nvcc (SGLang's JIT build: CUDA_HOME, CUDA_PATH, PATH, "
        "/usr/local/cuda)"
    )


def test_the_build_file_runs_without_ninja(tmp_path):
    """The fallback for hosts without ninja runs SGLang's build.ninja as ninja would: variables
    and $in / $out expanded, $$ and quoted paths kept, builds in order."""
    (tmp_path / "a b.txt").write_text("x")
    build = "\n".join([
        "ninja_required_version = 1.3",
        "cp = cp",
        "flags = -p",
        "ldflags = $flags",
        "",
        "rule compile_cuda",
        "  depfile = $out.d",
        '  command = $cp $flags "$in" "$out" && echo $$HOME-ok > "$out.d"',
        "",
        "rule link",
        '  command = cat $in > "$out" && echo $ldflags >> "$out"',
        "",
        "build one.o: compile_cuda a$ b.txt",
        "",
        "build lib.so: link one.o",
        "",
        "default lib.so",
    ])  # fmt: skip
    sglang_jit.run_build_file(tmp_path, build)
    assert (tmp_path / "lib.so").read_text() == "x-p\n"
    assert (tmp_path / "one.o.d").read_text().strip() == f"{os.environ['HOME']}-ok"
    with pytest.raises(RuntimeError, match="SGLang JIT build step failed"):
        sglang_jit.run_build_file(tmp_path, "rule link\n  command = false\nbuild x: link y\n")


def test_sglang_fused_path_refuses_neox():
    with pytest.raises(ValueError, match="interleaved indexer RoPE only"):
        ek._run_sglang(None, "", None, False, 1e-6, None, None)


@needs_sglang_files
@pytest.mark.skipif(
    ek.sglang_toolchain_reason(need_device=False) is not None,
    reason=str(ek.sglang_toolchain_reason(need_device=False)),
)
def test_sglang_kernels_build_for_sm90a_through_sglangs_own_build_code(tmp_path, monkeypatch):
    """SGLang's wrappers and JIT build code, unmodified, compile and link the fused indexer's two
    modules for sm_90a with the local nvcc and load them with tvm-ffi (no GPU needed); the
    engine's imports are stand-ins only while loading."""
    monkeypatch.setenv(ek.SGLANG_JIT_DIR_VAR, str(tmp_path))
    libs = ek.sglang_build(capability=(9, 0))
    names = sorted(p.name for p in libs)
    assert names == [
        "sgl_kernel_jit_dpsk_v32_k_indexer_norm_rope_store_p64_bf16_t_true_64.so",
        "sgl_kernel_jit_dpsk_v4_main_q_indexer_rope_first_quant_bf16_t_true_true_false.so",
    ]
    build = (libs[0].parent / "build.ninja").read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a -DSGL_CUDA_ARCH=900 -std=c++20 -O3 " in build
    assert "--expt-relaxed-constexpr" in build and "fast_math" not in build
    assert not any(n.split(".")[0] in {"sglang", "msgspec"} for n in sys.modules)


UNFUSED_BUILD_REASON = sglang_unfused.sglang_unfused_missing_reason(need_device=False)


@pytest.mark.skipif(UNFUSED_BUILD_REASON is not None, reason=str(UNFUSED_BUILD_REASON))
def test_sglangs_unfused_modules_build_for_sm90a(tmp_path, monkeypatch):
    """SGLang's unfused path (sglang-unfused): its three JIT modules (RoPE, Hadamard, index-K
    store), as DeepSeek-V3.2's indexer instantiates them, built for sm_90a by SGLang's own build
    code from the wheel's files (no GPU); FlashInfer's CuTe DSL LayerNorm compiles at its first
    call on the device, not here. No engine module stays importable."""
    monkeypatch.setenv(sglang_jit.SGLANG_JIT_DIR_VAR, str(tmp_path))
    libs = sglang_unfused.sglang_unfused_build(capability=(9, 0))
    assert sorted(p.name for p in libs) == [
        "sgl_kernel_jit_fused_rope_true_64_true_bf16_t_bf16_t.so",
        "sgl_kernel_jit_fused_store_index_k_cache_bf16_t_int64_t_64_true.so",
        "sgl_kernel_jit_hadamard_bf16_t.so",
    ]
    assert all(p.is_file() and p.is_relative_to(tmp_path) for p in libs)
    assert "-gencode=arch=compute_90a,code=sm_90a" in (libs[0].parent / "build.ninja").read_text()
    assert not any(n.split(".")[0] in {"sglang", "flashinfer", "msgspec"} for n in sys.modules)
    _, source = sglang_unfused.load_sglang_unfused(reason=None)
    assert source == "flashinfer 0.7.2, sglang 0.5.23 (39 files)"
