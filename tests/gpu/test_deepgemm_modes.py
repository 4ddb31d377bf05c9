"""DeepGEMM's determinism mode stays the caller's (issue 49): set to each value, it is found as set
after the package's DeepGEMM scoring. The mode is process-wide (an inference engine's own
DeepGEMM GEMMs in the same process read it) and DeepGEMM 2.8.1 has no getter for it, so the test
reads it from what DeepGEMM does with it: ``bf16_gemm_nt`` runs DeepGEMM's own SM90 kernel
(``sm90_bf16_gemm_impl``) in the mode and cuBLASLt out of it (``csrc/apis/gemm.hpp`` of
vllm-project/DeepGEMM), told apart by the kernel names the profiler records. 54e2261 has no
mode: with only that DeepGEMM the test skips, saying so."""

from __future__ import annotations

import importlib

import pytest
import torch

from dsa_precision import (
    indexer_scores,
    indexer_select,
    prepare_scoring_operands,
    reset_scoring_calls,
    scoring_calls,
)
from dsa_precision.backends import deepgemm as deepgemm_backend

from ..support.configs import FP8

pytestmark = pytest.mark.gpu

DEV = "cuda"
SWITCH = "use_deterministic_algorithms"  # DeepGEMM 2.8's setter; 2.8.1 has no getter
OWN_KERNEL = "sm90_bf16_gemm_impl"  # DeepGEMM's SM90 BF16 GEMM (deep_gemm/impls/sm90_bf16_gemm.cuh)


@pytest.fixture
def deepgemm(monkeypatch):
    """The package's DeepGEMM entry point on the first module of ``_MODULES`` that has the mode
    (``deep_gemm``, else vLLM's copy), the package pointed at it; the mode set back to DeepGEMM's
    default (off) after."""
    tried = []
    for name in deepgemm_backend._MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken build
            tried.append(f"{name}: {exc}")
            continue
        if not callable(getattr(module, SWITCH, None)):
            version = getattr(module, "__version__", "unknown version")
            tried.append(f"{name} ({version}) has no {SWITCH}")
            continue
        entry, reason = deepgemm_backend._resolve(module, name)
        if entry is None:
            tried.append(str(reason))
            continue
        break
    else:
        pytest.skip(
            "no DeepGEMM with a determinism mode imports (2.8 has one, 54e2261 none): "
            f"{'; '.join(tried)}; vLLM's copy: ../shared/gpu/vllm_wheel.sh"
        )
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (entry, None))
    yield entry
    getattr(entry.module, SWITCH)(False)


def _runs_own_gemm(module) -> bool:
    """Whether DeepGEMM's BF16 GEMM runs its own SM90 kernel (its determinism mode on), read
    from the kernels the profiler records; cuBLASLt's otherwise."""
    g = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randn(256, 512, device=DEV, generator=g).bfloat16()
    b = torch.randn(384, 512, device=DEV, generator=g).bfloat16()
    d = torch.empty(256, 384, device=DEV, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        module.bf16_gemm_nt(a, b, d)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names, "the profiler recorded no kernel of bf16_gemm_nt"
    torch.testing.assert_close(d.float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-1)
    return any(OWN_KERNEL in n for n in names)


def _operands(b: int, s: int, h: int = 64, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, h, 128, device=DEV, generator=g)
    k = torch.randn(b, s, 128, device=DEV, generator=g)
    w = (torch.randn(b, s, h, device=DEV, generator=g) * h**-0.5).bfloat16()
    return prepare_scoring_operands(q, k, w, config=FP8)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deepgemms_determinism_mode_is_found_as_set(deepgemm, deterministic):
    module = deepgemm.module
    switch = getattr(module, SWITCH)
    observed = {}
    for mode in (True, False):
        switch(mode)
        observed[mode] = _runs_own_gemm(module)
    if observed != {True: True, False: False}:  # e.g. cuBLASLt unavailable: one kernel for both
        pytest.skip(
            f"{deepgemm.name}'s mode is not observable here: bf16_gemm_nt ran "
            f"{OWN_KERNEL if observed[False] else 'cuBLASLt'} with the mode off and "
            f"{OWN_KERNEL if observed[True] else 'cuBLASLt'} with it on"
        )
    batch, single = _operands(2, 1024), _operands(1, 1024, seed=1)
    switch(deterministic)
    reset_scoring_calls()
    indexer_scores(batch, backend="deepgemm")  # one compressed launch
    indexer_scores(batch, backend="deepgemm", clean=False)
    indexer_scores(single, backend="deepgemm")  # full causal scores
    indexer_select(batch, topk=256, backend="deepgemm", chunk_bytes=1 << 20)  # several chunks
    torch.cuda.synchronize()
    assert scoring_calls("fp8", "deepgemm") >= 4, "the scoring did not go through DeepGEMM"
    state = "on" if deterministic else "off"
    assert _runs_own_gemm(module) is deterministic, (
        f"DeepGEMM's determinism mode was set {state}; the package's scoring changed it"
    )
