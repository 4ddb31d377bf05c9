"""The engines' own RoPE table code (vLLM 0.33.0's rotary modules, LMDeploy 0.18.0's, SGLang
0.5.23's), loaded
unmodified from ``DSA_ENGINE_KERNELS`` and run on the CPU, against the tables ``rope_fp32``
reads (:class:`dsa_precision.rope.EngineRopeTables`): every entry, bit for bit. Skipped with the
reason when the files are absent (docs/gpu-validation.md has the recipe); on the GPU,
tools/layer_conformance.py compares them where the engines build them."""

import pytest
import torch

from conformance import engine_kernels as ek
from dsa_precision import ENGINE_PROFILES
from dsa_precision.rope import EngineRopeTables, RopePositions, RopeSpec, YarnScaling

needs = {
    e: pytest.mark.skipif(ek.missing_reason(e) is not None, reason=str(ek.missing_reason(e)))
    for e in ("vllm-rope", "vllm-legacy-rope", "lmdeploy-rope", "sglang-rope")
}
SPECS = {
    "rope-1e4": RopeSpec(64, 1e4),
    "rope-1e6 (GLM-5)": RopeSpec(64, 1e6),
    "yarn (DeepSeek-V3.2)": RopeSpec(64, 1e4, YarnScaling(40, 4096, 32, 1, 1.0, 1.0)),
}
N = 8192


def _ours(profile, spec, n=N):
    e = ENGINE_PROFILES[profile]
    cos, sin = EngineRopeTables(spec, e).rows(RopePositions.first(n), "cpu", e.cos_sin_dtype)
    half = spec.rope_dim // 2
    return cos[:, :half], sin[:, :half]


@needs["vllm-rope"]
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("profile", ["vllm", "vllm-eager"])
def test_vllms_own_cos_sin_cache_is_the_package_table(profile, spec):
    if profile == "vllm-eager" and SPECS[spec].yarn is None:
        pytest.skip("vllm-eager is vLLM's eager run of a YaRN model (GLM-5's eager run is vllm)")
    run = ek.engine_rope(ENGINE_PROFILES[profile], SPECS[spec], N, device="cpu")
    assert run.source.startswith("vllm 0.33.0 (sha256 "), run.source
    assert run.cos.dtype == ENGINE_PROFILES[profile].cos_sin_dtype  # the profile's fact
    cos, sin = _ours(profile, SPECS[spec])
    assert torch.equal(run.cos, cos) and torch.equal(run.sin, sin)


@needs["vllm-rope"]
def test_vllms_eager_cache_of_a_plain_rope_model_is_the_model_dtype():
    """Why vllm-eager describes YaRN models only: vLLM's base RotaryEmbedding never takes
    flashinfer's float32 cache, so GLM-5's eager run is the 'vllm' profile's BF16 cache."""
    run = ek.engine_rope(ENGINE_PROFILES["vllm-eager"], SPECS["rope-1e6 (GLM-5)"], 64, device="cpu")
    assert run.cos.dtype == torch.bfloat16 and ENGINE_PROFILES["vllm-eager"].rope_type == "yarn"


@needs["lmdeploy-rope"]
@pytest.mark.parametrize("spec", SPECS)
def test_lmdeploys_own_tables_are_the_package_table(spec):
    """LMDeploy builds its tables per forward in a torch.compile'd function and falls back to
    eager when compiling fails; the package computes them with ATen's cos / sin, that eager
    path: compared with compiling off (Inductor's CPU cos / sin differ from ATen's in 2-3 of the
    524,288 entries of the plain tables here; its CUDA code is compared on the GPU)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        run = ek.engine_rope(ENGINE_PROFILES["lmdeploy"], SPECS[spec], N, device="cpu")
    assert run.source.startswith("lmdeploy 0.18.0 (sha256 "), run.source
    assert run.cos.dtype == torch.bfloat16
    cos, sin = _ours("lmdeploy", SPECS[spec])
    assert torch.equal(run.cos, cos) and torch.equal(run.sin, sin)


@needs["sglang-rope"]
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("profile", ["sglang-fused", "sglang-unfused"])
def test_sglangs_own_cos_sin_cache_is_the_package_table(profile, spec):
    """SGLang's indexer builds its rotary module by get_rope_wrapper (RotaryEmbedding, or
    DeepseekScalingRotaryEmbedding for deepseek_yarn) under its loader's device and keeps the
    cache float32 on CUDA: both SGLang profiles' tables, every entry."""
    run = ek.engine_rope(ENGINE_PROFILES[profile], SPECS[spec], N, device="cpu")
    assert run.source.startswith("sglang 0.5.23 (sha256 "), run.source
    assert run.cos.dtype == torch.float32 == ENGINE_PROFILES[profile].cos_sin_dtype
    cos, sin = _ours(profile, SPECS[spec])
    assert torch.equal(run.cos, cos) and torch.equal(run.sin, sin)


@needs["vllm-legacy-rope"]
@pytest.mark.parametrize("spec", SPECS)
def test_vllm_028s_own_cos_sin_cache_is_the_legacy_table(spec):
    """vLLM 0.28.0's rotary files (another root of DSA_ENGINE_KERNELS, picked by their hashes
    over 0.33.0's at the same paths): the BF16 cache of its compiled run is vllm-legacy's."""
    run = ek.engine_rope(ENGINE_PROFILES["vllm-legacy"], SPECS[spec], N, device="cpu")
    assert run.source.startswith("vllm 0.28.0 (sha256 39bf5bb498ae c81804498f08 "), run.source
    assert run.cos.dtype == torch.bfloat16 == ENGINE_PROFILES["vllm-legacy"].cos_sin_dtype
    cos, sin = _ours("vllm-legacy", SPECS[spec])
    assert torch.equal(run.cos, cos) and torch.equal(run.sin, sin)


def test_a_pinned_engine_skips_a_root_of_another_release(tmp_path):
    """A root whose files sit at vLLM 0.28.0's paths but are not its bytes is not 0.28.0's."""
    for rel in ek.ENGINE_FILES["vllm-legacy-rope"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# not vLLM 0.28.0\n")
    assert ek.kernel_files("vllm-legacy-rope", tmp_path) is None
    reason = ek.missing_reason("vllm-legacy-rope", tmp_path)
    assert reason is not None and "pinned release" in reason
    assert ek.kernel_files("vllm-rope", tmp_path) is not None  # an unpinned engine takes them


def test_profiles_without_a_rope_oracle_say_so():
    with pytest.raises(ValueError, match="has no RoPE oracle here"):
        ek.engine_rope(ENGINE_PROFILES["vllm-exact"], SPECS["rope-1e4"], 8, device="cpu")
    with pytest.raises(ValueError, match="table function"):
        ek.engine_rotary(
            ENGINE_PROFILES["lmdeploy"], SPECS["rope-1e4"], device="cpu", max_position_embeddings=8
        )
