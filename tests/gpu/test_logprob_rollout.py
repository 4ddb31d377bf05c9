"""examples/logprob_mismatch.py with the rollout's picks from the engine's own code
(``--rollout engine-kernels``) on the H200: each layer's picks made by vLLM's own RoPE code and
preprocess kernels (unmodified, from ``DSA_ENGINE_KERNELS``) on that layer's projections,
scored by DeepGEMM's ``fp8_mqa_logits``, layer by layer through the MoE toy; ``rope_fp32+fp8``
with the ``vllm`` profile picks the same keys on every row of every layer and gives dlogp = 0
on every token, at step 0 and after warm-up steps. Skipped without the engines' files or
DeepGEMM (docs/gpu-validation.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance import engine_kernels as ek

from ..support.configs import ROOT
from ..support.helpers import free_port, needs_deepgemm

MISSING = [r for e in ("vllm", "vllm-rope") if (r := ek.missing_reason(e))]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING)),
    needs_deepgemm,
]


def test_the_matched_configuration_picks_what_vllms_own_kernels_pick(record):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    run = subprocess.run(
        [sys.executable, "examples/logprob_mismatch.py", "--seq", "512", "--topk", "64",
         "--steps", "3", "--configs", "baseline,rope_fp32+fp8", "--rollout", "engine-kernels",
         "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(run.stdout)
    assert doc["settings"]["rollout"] == "engine-kernels"
    assert doc["settings"]["rollout_scores"] == "deepgemm"
    assert doc["checks"]["matched_config_picks_the_engines"]
    for c in doc["checkpoints"]:
        assert c["rollout"].startswith("vllm 0.33.0"), c["rollout"]
        reports = {r["name"]: r for r in c["reports"]}
        matched = reports["rope_fp32+fp8"]
        record("logprob_rollout_engine_kernels", step=c["step"],
               baseline_rows_identical=reports["baseline"]["picks"]["rows_identical"])  # fmt: skip
        assert matched["picks_identical"] and matched["logprobs"]["tokens_differing"] == 0
        assert matched["logprobs"]["abs_max"] == 0
        assert not reports["baseline"]["picks_identical"]
