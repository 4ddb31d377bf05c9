"""examples/parallel_parity.py on the CPU: two gloo ranks, tiny shapes, the torch backend.

The launcher runs the toy GLM-5-like model under TP=1/CP=1 (the reference, on every rank),
TP=2 with sequence parallelism and CP=2 (allgather), each for BSHD and packed THD, and writes
what it measured as JSON. Checked here:

- the FP8 configurations (fp8, rope_fp32+fp8) pick exactly the reference's top-k set on every
  row of every layer whose indexer operands are bit-identical to the reference's: every layer
  under CP=2, layer 1 under TP=2;
- on every layout and layer, the picks equal a single-process selection of the run's own
  operands (``split``): scoring a row does not depend on how rows are split over ranks;
- where the operands differ (layer 2 under TP=2: layer 1's row-parallel projections leave BF16
  partial sums that Megatron's TP reduce-scatter adds, another rounding than one GEMM's),
  Megatron's stock model's operands differ there too;
- FP8 scoring calls were counted on every rank, none in BF16 (``DSA_PRECISION_STRICT=1``);
- losses and gradient norms are finite, and the reference is reproduced on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
FP8 = ("fp8", "rope_fp32+fp8")
PARALLEL = ("tp2-sp", "cp2-bshd", "cp2-thd", "tp2-thd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DSA_PRECISION_STRICT="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), "examples/parallel_parity.py",
        "--tiny", "--device", "cpu", "--steps", "2", "--batch", "2",
        "--configs", "fp8,rope_fp32+fp8,stock", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    return {(r["layout"], r["config"]): r for r in data["rows"]} | {"checks": data["checks"]}


def test_launcher_checks_pass(parity):
    assert parity["checks"]["ok"], parity["checks"]


@pytest.mark.parametrize("layout", PARALLEL)
@pytest.mark.parametrize("config", FP8)
def test_fp8_picks_are_the_single_process_picks(parity, layout, config):
    row = parity[(layout, config)]
    stock = parity[(layout, "stock")]
    for n, layer in row["layers"].items():
        assert layer["split_identical"] == 1.0, (layout, config, n)
        assert layer["tp_ranks_agree"], (layout, config, n)
        if layer["operands_identical"]:
            assert layer["rows_identical"] == 1.0, (layout, config, n, layer)
            assert layer["score_rel"] == 0.0
        else:  # Megatron's parallel arithmetic upstream of the indexer: the stock model too
            assert not stock["layers"][n]["operands_identical"], (layout, config, n)
    if layout.startswith("cp2"):  # on the CPU, CP changes no bit of the indexer's inputs
        assert all(layer["operands_identical"] for layer in row["layers"].values())
        assert all(layer["rows_identical"] == 1.0 for layer in row["layers"].values())
    else:  # TP: layer 1 reads the embedding, whose TP reduction only adds zeros (exact)
        assert row["layers"]["1"]["operands_identical"]
        assert row["layers"]["1"]["rows_identical"] == 1.0


@pytest.mark.parametrize("config", FP8)
def test_fp8_scoring_calls_on_every_rank(parity, config):
    for layout in ("ref", "ref-thd", *PARALLEL):
        calls = parity[(layout, config)]["calls_per_rank"]
        assert len(calls) == 2
        assert all(c["fp8"] > 0 and c["bf16"] == 0 for c in calls), (layout, calls)


def test_losses_finite_and_reference_reproduced(parity):
    for key, row in parity.items():
        if key == "checks":
            continue
        assert row["finite"], key
        assert row.get("ranks_reproduce", True), key
        if "loss_rel" in row:  # parallel runs train like the single-GPU run
            assert row["loss_rel"] < 1e-2, (key, row["loss_rel"])
