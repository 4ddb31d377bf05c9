"""tools/engine_conformance.py ``--engine-triton``: the engines' Triton kernels run in a child
process whose PYTHONPATH puts another Triton first (on the H200: Triton 3.8 beside the host's 3.6),
the operands it built handed to this process, every row naming the release that compiled them.

Here the "other" Triton is a folder holding a link to this interpreter's own (the child must
import it from there), and both processes run Triton's interpreter at a small S: the plumbing is
checked (the child's operands are the ones the kernels build in this process, bit for bit; its
inputs are these; its release is recorded and printed), not the arithmetic (the GPU run is the
tool itself; docs/gpu-validation.md, "Triton 3.8"). Skipped without the engines' files in
``DSA_ENGINE_KERNELS``."""

import json
from pathlib import Path

import pytest
import torch

from conformance import engine_kernels as ek
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.synthetic import synthetic_indexer_inputs

from ..support.configs import load_tool

MISSING = [r for e in ("vllm", "lmdeploy") if (r := ek.missing_reason(e))]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))


def _tool():
    return load_tool("engine_conformance")


@pytest.fixture(scope="module")
def child_run(tmp_path_factory):
    import triton

    other = tmp_path_factory.mktemp("other-triton")
    (other / "triton").symlink_to(Path(triton.__file__).parent, target_is_directory=True)
    out = tmp_path_factory.mktemp("conformance")
    argv = ["--device", "cpu", "--seq", "32", "--topk", "8", "--scores", "exact",
            "--models", "1", "--profiles", "lmdeploy", "--engine-triton", str(other),
            "--out", str(out)]  # fmt: skip
    tool = _tool()
    assert tool.main(argv) == 0
    return tool, other, out, json.loads((out / "conformance.json").read_text())


def test_the_child_imports_triton_from_the_folder_first(child_run):
    import triton

    _, other, _, results = child_run
    env = results["engine_child"]["env"]
    assert env["triton"] == triton.__version__
    assert Path(env["triton_file"]).is_relative_to(other)
    assert env["TRITON_INTERPRET"] == "1"
    assert set(results["ptx"]) == {"vllm", "lmdeploy"}  # the child's kernels (none on the CPU)


def test_every_row_names_the_child_release(child_run):
    import triton

    _, _, _, results = child_run
    # lmdeploy, and vllm-exact against vLLM's kernels (the child runs vLLM's for it)
    assert [r["profile"] for r in results["models"]] == ["lmdeploy", "vllm-exact"]
    for rec in results["models"]:
        assert "error" not in rec, rec
        assert rec["engine_compiler"] == f"Triton {triton.__version__} (child)"


def test_the_child_wrote_the_operands_the_kernels_build(child_run):
    tool, _, out, results = child_run
    child = {**results["engine_child"], "dir": str(out / tool.CHILD_DIR)}
    child["runs"] = json.loads((out / tool.CHILD_DIR / "child.json").read_text())["runs"]
    assert sorted(child["runs"]) == ["H32-interleaved-lmdeploy", "H32-interleaved-vllm"]
    inputs = synthetic_indexer_inputs(32, n_heads=32, seed=0)
    for name in ("vllm", "lmdeploy"):
        got = tool._child_run(child, inputs, True, name)
        here = ek.engine_kernel_operands(inputs, ENGINE_PROFILES[name], interleaved=True)
        assert ek.operand_diff(got.operands, here.operands) == ek.operand_diff(
            here.operands, here.operands
        ), name
        assert got.source == here.source
        if name == "vllm":  # vLLM's float32 keys travel too
            assert torch.equal(got.k_float.view(torch.int32), here.k_float.view(torch.int32))
        else:
            assert got.k_float is None
    with pytest.raises(RuntimeError, match="inputs"):  # other inputs than the child's
        tool._child_run(child, synthetic_indexer_inputs(32, n_heads=32, seed=1), True, "vllm")


def test_without_the_flag_rows_name_this_process_release():
    tool = _tool()
    assert tool._compiler("vllm", None, "3.6.0") == "Triton 3.6.0"
    assert tool._compiler("vllm-exact", None, "3.6.0") == "Triton 3.6.0"
    assert tool._compiler("sglang-fused", None, "3.6.0") == "nvcc (SGLang JIT)"
    child = {"env": {"triton": "3.8.0"}}
    assert tool._compiler("lmdeploy", child, "3.6.0") == "Triton 3.8.0 (child)"
    assert tool._child_profiles(["lmdeploy", "sglang-fused"]) == ["lmdeploy", "vllm"]
