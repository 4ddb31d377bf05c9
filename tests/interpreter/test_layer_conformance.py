"""tools/layer_conformance.py at a small S on the CPU: Megatron's DSA layer with the drop-ins
(rope_fp32+fp8, each profile with an engine oracle, ``use_cpu_initialization`` both ways)
against the engines' own RoPE code and kernels, unmodified, under Triton's interpreter with its
casts corrected (``engine_oracles.hardware_casts``) and the layer's profile uncontracted (the
interpreter does not contract): every table entry, E4M3 byte, k descale and folded weight equal,
every row's top-k identical. Skipped without the engines' files in ``DSA_ENGINE_KERNELS``
(docs/gpu-validation.md, "Layer conformance"); the GPU run is the tool itself."""

import json

import pytest

from conformance import engine_kernels as ek

from ..support.configs import load_tool
from ..support.engine_oracles import hardware_casts

MISSING = [
    r for e in ("vllm", "lmdeploy", "vllm-rope", "lmdeploy-rope") if (r := ek.missing_reason(e))
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))


def _tool():
    return load_tool("layer_conformance")


def test_the_layer_matches_the_engines_own_code_at_a_small_size(tmp_path):
    # The Triton engines' profiles (SGLang's kernels are CUDA: the GPU test runs them).
    argv = ["--device", "cpu", "--seq", "32", "--topk", "8", "--scores", "exact", "--no-fma",
            "--profiles", "vllm", "vllm-eager", "lmdeploy", "--out", str(tmp_path)]  # fmt: skip
    with hardware_casts():
        assert _tool().main(argv) == 0
    records = json.loads((tmp_path / "layer_conformance.json").read_text())["records"]
    # 2 models x 2 use_cpu_initialization x (vllm, lmdeploy; vllm-eager for the YaRN model)
    assert len(records) == 10, [r.get("error") for r in records]
    for rec in records:
        where = (rec["model"], rec["profile"], rec["use_cpu_initialization"])
        assert rec["tables"]["layer_differ"] == 0, where
        for side in ("layer", "torch"):
            diff = {k: v for k, v in rec[side].items() if k.endswith("_differ")}
            assert set(diff.values()) == {0}, (where, side, diff)
            assert rec[side]["rows_identical"] == 1.0, (where, side)
        assert rec["layer_topk"]["rows_identical"] == 1.0, where
