"""vLLM 0.28.0's indexer key path (its LayerNorm and rotary files, unmodified, in
``Indexer.forward``'s order: :mod:`conformance.legacy_key`) against ``vllm-legacy``'s
key before quantization, on the CPU (the query kernel runs under Triton's interpreter beside it).

Compiled by Inductor, as vLLM's default run compiles it, the key is the profile's: LayerNorm in
float32 rounded to BF16, then RoPE in float32 rounded once. Run eagerly, the same code rounds
every RoPE product and sum to BF16 (the profile's ``rope_dtype=bfloat16``): why ``vllm-legacy``
describes the compiled run. The CPU's Inductor code is C++, whose multiply-adds the machine's
compiler may or may not contract; the GPU's is Triton (tools/layer_conformance.py compares it
there, against the profile as it is). Skipped without vLLM 0.28.0's files in
``DSA_ENGINE_KERNELS`` (docs/gpu-validation.md, "Layer conformance")."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance import legacy_key as lk
from conformance.legacy_kernel import package_key
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.preprocess import IndexerPreprocess
from dsa_precision.rope import EngineRopeTables, RopePositions, RopeSpec, YarnScaling

pytestmark = pytest.mark.skipif(lk.missing_reason() is not None, reason=str(lk.missing_reason()))

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ENGINE_PROFILES["vllm-legacy"]
S, H, D = 64, 4, 128
CASES = {
    "GLM-5 (interleaved, base 1e6)": (RopeSpec(64, 1e6), True),
    "DeepSeek-V3.2 (NeoX, YaRN)": (
        RopeSpec(64, 1e4, YarnScaling(40, 4096, 32, 1, 1.0, 1.0)),
        False,
    ),
}


def _inputs(seed: int) -> SyntheticIndexerInputs:
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.LayerNorm(D, eps=lk.VLLM_K_NORM_EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=g))
        norm.bias.copy_(0.2 * torch.randn(D, generator=g))
    return SyntheticIndexerInputs(
        torch.randn(S, 1, H, D, generator=g).to(torch.bfloat16),
        (3 * torch.randn(S, 1, D, generator=g)).to(torch.bfloat16),
        torch.randn(S, 1, H, generator=g).to(torch.bfloat16),
        norm,
        torch.zeros(S, 1, 1, 64),  # unused: the layer's engine tables take the positions
    )


def _package_key(inputs, spec, interleaved, profile=LEGACY) -> torch.Tensor:
    pre = IndexerPreprocess(
        D, 64, k_norm=inputs.k_norm, rope_interleaved=interleaved, rotate_activation=False,
        rope_fp32=True, engine=profile, rope_tables=EngineRopeTables(spec, profile),
    )  # fmt: skip
    return package_key(inputs, profile, interleaved=interleaved, pre=pre)


def _engine(inputs, spec, interleaved, compiled):
    kw = torch.cat((inputs.k[:, 0], inputs.w[:, 0]), dim=-1)
    return lk.legacy_engine_run(
        kw, inputs.q[:, 0], inputs.k_norm.weight, inputs.k_norm.bias, spec,
        interleaved=interleaved, max_position_embeddings=S, compiled=compiled,
    )  # fmt: skip


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


@pytest.mark.parametrize("case", CASES)
def test_vllm_028s_compiled_key_is_the_legacy_profiles(case):
    spec, interleaved = CASES[case]
    inputs = _inputs(0)
    run = _engine(inputs, spec, interleaved, compiled=True)
    assert run.k.shape == (S, D) and run.k.dtype == torch.bfloat16
    assert run.source["compiled"] and run.source["torch"] == torch.__version__
    assert run.source["layernorm"].startswith("vllm 0.28.0")
    assert run.source["rope"].startswith("vllm 0.28.0")
    contracted = _package_key(inputs, spec, interleaved)
    plain = _package_key(inputs, spec, interleaved, dataclasses.replace(LEGACY, fma=False))
    # The profile as it is, or uncontracted where this CPU's compiler did not contract.
    assert min(_differ(run.k, contracted), _differ(run.k, plain)) == 0
    # The cache the query kernel read is the table vllm-legacy's layer reads.
    cos, sin = EngineRopeTables(spec, LEGACY).rows(RopePositions.first(S), "cpu", torch.bfloat16)
    assert torch.equal(run.cos_sin_cache, torch.cat((cos[:, :32], sin[:, :32]), dim=-1))


def test_vllm_028s_eager_key_rounds_its_rope_to_bf16():
    """The same files without torch.compile: RoPE's products and sums each rounded to BF16 (the
    profile with ``rope_dtype=bfloat16`` and no contraction), not the compiled run's key."""
    spec, interleaved = CASES["DeepSeek-V3.2 (NeoX, YaRN)"]
    inputs = _inputs(1)
    run = _engine(inputs, spec, interleaved, compiled=False)
    eager = dataclasses.replace(LEGACY, rope_dtype=torch.bfloat16, fma=False)
    assert _differ(run.k, _package_key(inputs, spec, interleaved, eager)) == 0
    assert _differ(run.k, _package_key(inputs, spec, interleaved)) > 0


def test_the_child_tool_runs_the_key_path_in_its_own_process(tmp_path):
    """tools/vllm_legacy_engine.py (how the layer's conformance runs it under vLLM 0.28's own
    torch): its output is the in-process run's, and it says which torch compiled it."""
    spec, interleaved = CASES["GLM-5 (interleaved, base 1e6)"]
    inputs = _inputs(2)
    kw = torch.cat((inputs.k[:, 0], inputs.w[:, 0]), dim=-1)
    norm = inputs.k_norm
    torch.save(
        dict(kw=kw, q=inputs.q[:, 0], norm_weight=norm.weight.detach(),
             norm_bias=norm.bias.detach(), spec=spec, interleaved=interleaved,
             max_position_embeddings=S),
        tmp_path / "inputs.pt",
    )  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(ROOT / "tools" / "vllm_legacy_engine.py"),
           str(tmp_path / "inputs.pt"), str(tmp_path / "engine.pt")]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=900)
    out = torch.load(tmp_path / "engine.pt", weights_only=False)
    assert out["source"]["torch_file"] == torch.__file__
    assert out["source"]["inductor_cache"] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").rglob("*.py"))  # Inductor's generated code, kept
    here = _engine(inputs, spec, interleaved, compiled=True)
    for name in ("k", "q", "weights", "cos_sin_cache"):
        assert torch.equal(out[name].view(torch.uint8), getattr(here, name).view(torch.uint8)), name
