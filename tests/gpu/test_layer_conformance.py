"""tools/layer_conformance.py on the GPU at a small S: Megatron's DSA layer with the drop-ins
(rope_fp32+fp8) against the engines' own RoPE code (built on the device as the engines build it)
and kernels, each profile with an oracle, ``use_cpu_initialization`` both ways. Target: every
table entry, byte, k descale and folded weight equal, every row identical. Skipped without the
engines' files in ``DSA_ENGINE_KERNELS`` (docs/gpu-validation.md, "Layer conformance")."""

import json

import pytest

from conformance import engine_kernels as ek

from ..support.configs import load_tool
from ..support.helpers import needs_deepgemm

MISSING = [
    r for e in ("vllm", "lmdeploy", "vllm-rope", "lmdeploy-rope") if (r := ek.missing_reason(e))
]
MISSING_SGLANG = [r for e in ("sglang", "sglang-rope") if (r := ek.missing_reason(e))]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))]


@pytest.mark.parametrize("scores", ["exact", pytest.param("deepgemm", marks=needs_deepgemm)])
def test_the_layer_matches_the_engines_own_code_on_the_gpu(tmp_path, record, scores):
    """vLLM's and LMDeploy's profiles, both models."""
    _check(tmp_path, record, scores, ["vllm", "vllm-eager", "lmdeploy"], ["glm5", "v32"], 10)


@pytest.mark.skipif(bool(MISSING_SGLANG), reason="; ".join(MISSING_SGLANG))
@pytest.mark.parametrize("scores", ["exact", pytest.param("deepgemm", marks=needs_deepgemm)])
def test_the_layer_matches_sglangs_own_code_on_the_gpu(tmp_path, record, scores):
    """sglang-fused: SGLang's rotary module built on the device and its fused JIT CUDA kernels
    (built here by nvcc), the GLM-5-like model (the only one its fused path serves)."""
    _check(tmp_path, record, scores, ["sglang-fused"], ["glm5"], 2)


MISSING_UNFUSED = [r for e in ("sglang-unfused", "sglang-rope") if (r := ek.missing_reason(e))]


@pytest.mark.skipif(bool(MISSING_UNFUSED), reason="; ".join(MISSING_UNFUSED))
@pytest.mark.parametrize("scores", ["exact", pytest.param("deepgemm", marks=needs_deepgemm)])
def test_the_layer_matches_sglangs_unfused_code_on_the_gpu(tmp_path, record, scores):
    """sglang-unfused: SGLang's rotary module built on the device and its unfused path
    (FlashInfer's CuTe DSL LayerNorm, SGLang's JIT RoPE, Hadamard and store, its Triton q
    quantization, its compiled head gate on the layer's own x and weights_proj), the
    DeepSeek-V3.2-like model (NeoX, YaRN, Hadamard)."""
    _check(tmp_path, record, scores, ["sglang-unfused"], ["v32"], 2)


def _legacy_missing() -> list[str]:
    from conformance import legacy_kernel, legacy_key

    return [r for r in (legacy_key.missing_reason(), legacy_kernel.missing_reason()) if r]


MISSING_LEGACY = _legacy_missing()


@pytest.mark.skipif(bool(MISSING_LEGACY), reason="; ".join(MISSING_LEGACY))
@pytest.mark.parametrize("scores", ["exact", pytest.param("deepgemm", marks=needs_deepgemm)])
def test_the_layer_matches_vllm_028s_own_code_on_the_gpu(tmp_path, record, scores):
    """vllm-legacy: vLLM 0.28.0's rotary module built on the device, its key LayerNorm and RoPE
    compiled by Inductor in a child process (this torch), its Triton query kernel and its CUDA
    key quantization (built by .vllm-legacy/build.sh), both models."""
    records = _check(tmp_path, record, scores, ["vllm-legacy"], ["glm5", "v32"], 4)
    for rec in records:
        assert rec["vllm-legacy"]["k_bf16_differ"] == 0, rec["vllm-legacy"]
        assert rec["vllm-legacy"]["compiled"] is True
        # 512 tokens: Inductor's persistent reduction, the rule of the XBLOCK it kept
        assert rec["layer_layernorm"] == rec["vllm-legacy"]["layernorm_rule"]
        assert rec["layer_layernorm"].startswith("fp32-inductor-x"), rec["vllm-legacy"]


def _check(tmp_path, record, scores: str, profiles: list[str], models: list[str], n: int):
    tool = load_tool("layer_conformance")
    argv = ["--seq", "512", "--topk", "64", "--scores", scores, "--profiles", *profiles,
            "--models", *models, "--out", str(tmp_path)]  # fmt: skip
    assert tool.main(argv) == 0
    records = json.loads((tmp_path / "layer_conformance.json").read_text())["records"]
    assert len(records) == n, [r.get("error") for r in records]
    for rec in records:
        record(
            "layer_conformance_small",
            scores=scores,
            **{k: rec[k] for k in ("model", "profile", "tables")},
        )
        where = (rec["model"], rec["profile"], rec["use_cpu_initialization"])
        assert rec["tables"]["layer_differ"] == 0, where
        for side in ("layer", "torch"):
            diff = {k: v for k, v in rec[side].items() if k.endswith("_differ")}
            assert set(diff.values()) == {0}, (where, side, diff)
        assert rec["layer_topk"]["rows_identical"] == 1.0, where
    return records
