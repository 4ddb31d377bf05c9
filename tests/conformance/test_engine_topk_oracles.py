"""The SGLang 0.5.23 and LMDeploy 0.18.0 top-k oracles on the CPU: what they refuse and why, which
kernel serves which top-k, and (with the wheels' files in ``DSA_ENGINE_KERNELS``) that SGLang's
``dsv4/topk.py`` and its JIT utilities load unmodified with the stand-ins. The kernels themselves
run in tests/gpu/test_engine_topk.py (and LMDeploy's Triton one in tests/interpreter)."""

import pytest
import torch

from conformance import lmdeploy_topk, sglang_topk
from conformance.loader import ENV_VAR


def test_without_the_files_each_kernel_says_why(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(sglang_topk.OPS_ENV, raising=False)
    for kernel in ("decode", "prefill"):
        assert ENV_VAR in sglang_topk.missing_reason(kernel)
        assert "holds no" in sglang_topk.missing_reason(kernel, tmp_path)
    assert sglang_topk.OPS_ENV in sglang_topk.missing_reason("prefill-paged")
    for kernel in lmdeploy_topk.KERNELS:
        assert ENV_VAR in lmdeploy_topk.missing_reason(kernel)
        assert "holds no" in lmdeploy_topk.missing_reason(kernel, tmp_path)
    with pytest.raises(ValueError):
        sglang_topk.missing_reason("persistent")


def test_sgl_kernel_ops_need_the_torch_they_were_built_for(monkeypatch, tmp_path):
    lib = tmp_path / "common_ops.abi3.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(sglang_topk.OPS_ENV, str(lib))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert "2.14" in sglang_topk.missing_reason("prefill-paged")
    monkeypatch.setenv(sglang_topk.OPS_ENV, str(tmp_path / "absent.so"))
    assert "is not a file" in sglang_topk.missing_reason("prefill-paged")


def test_which_kernel_takes_which_topk():
    assert sglang_topk.applies("prefill-paged", 100, 256) is not None
    assert sglang_topk.applies("prefill-paged", 100, 2048) is None
    assert sglang_topk.applies("decode", 100, 2048) is None
    assert sglang_topk.applies("prefill", 100, 4096) is not None
    assert lmdeploy_topk.lmdeploy_kernel(2048) == "tilelang"
    assert lmdeploy_topk.lmdeploy_kernel(512) == "tilelang"
    assert lmdeploy_topk.lmdeploy_kernel(256) == "bitonic"
    assert lmdeploy_topk.applies("tilelang", 10, 256) is not None
    assert lmdeploy_topk.applies("bitonic", 10, 256) is None
    assert lmdeploy_topk.applies("bitonic", 10, 300) is not None


def test_the_contract_is_float32_logits_with_unit_column_stride():
    logits = torch.zeros(4, 8, dtype=torch.float16)
    lengths = torch.full((4,), 8, dtype=torch.int32)
    with pytest.raises(ValueError):
        sglang_topk.run("decode", logits, lengths, 2)
    with pytest.raises(ValueError):
        lmdeploy_topk.run("bitonic", logits.float().t(), lengths, 2)


def test_unaligned_rows_are_padded_for_the_v2_kernel():
    logits = torch.randn(3, 7)
    out = sglang_topk._aligned(logits)
    assert out.stride(0) == 8 and torch.equal(out, logits)
    aligned = torch.randn(3, 8)
    assert sglang_topk._aligned(aligned) is aligned


def test_sglang_topk_wrapper_loads_unmodified():
    if sglang_topk.kernel_files() is None:
        pytest.skip(f"{ENV_VAR} holds no SGLang 0.5.23 top-k v2 files")
    ns = sglang_topk._module()
    for name in ("plan_topk_v2", "topk_transform_paged_v2", "topk_transform_ragged_v2"):
        assert callable(getattr(ns.topk, name))
    assert "sglang.kernels.jit.utils.occupancy" in ns.stubs
    assert "sglang.kernels.ops.attention.dsv4.topk" not in __import__("sys").modules


def test_lmdeploy_files_are_the_wheels():
    for kernel in lmdeploy_topk.KERNELS:
        if lmdeploy_topk.kernel_files(kernel) is None:
            pytest.skip(f"{ENV_VAR} holds no {lmdeploy_topk.FILES[kernel]}")
        assert lmdeploy_topk.source(kernel).startswith("lmdeploy 0.18.0")
