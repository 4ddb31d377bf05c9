"""examples/parallel_parity.py on the CPU: two gloo ranks, tiny shapes, the torch backend.

The launcher runs the toy GLM-5-like model under TP=1/CP=1 (the reference, on every rank),
TP=2 with sequence parallelism and CP=2 (allgather), each for BSHD and packed THD, and writes
what it measured as JSON. Checked here, what the package guarantees whatever the BLAS library
does with the thread count or the batch size (the thread setting is the environment's):

- on every layout and layer, the picks equal a single-process selection of the run's own
  operands (``split``): the FP8 picks of a row do not depend on how rows are split over ranks,
  given the same operands; ranks that hold the same rows pick alike;
- wherever a layer's indexer operands are bit-identical to the reference's, its picks are the
  reference's on every row and its scores are the reference's;
- where they differ it is Megatron's parallel arithmetic upstream of the indexer (TP's BF16
  partial sums; under CP, GEMMs over half the rows, which the BLAS library may block otherwise
  for some thread counts and batch sizes): Megatron's stock model's operands differ there too;
- FP8 scoring calls were counted on every rank, none in BF16 (``DSA_PRECISION_STRICT=1``);
- losses and gradient norms are finite, and the reference is reproduced on every rank.

Run it under several thread settings (``OMP_NUM_THREADS`` unset, ``=1``, ``=2``): the verdicts
do not depend on it.
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
    env = dict(os.environ, DSA_PRECISION_STRICT="1")  # threads: the environment's
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
        where = f"{config} under {layout}, DSA layer {n}"
        assert layer["split_identical"] == 1.0, (
            f"{where}: {layer['split_identical']:.2%} of rows equal a single-process selection of "
            "the same operands; the picks of a row must not depend on the split over ranks"
        )
        assert layer["tp_ranks_agree"], f"{where}: ranks holding the same rows picked otherwise"
        if layer["operands_identical"]:
            assert layer["rows_identical"] == 1.0 and layer["score_rel"] == 0.0, (
                f"{where}: operands bit-identical to the reference's, yet "
                f"{layer['rows_identical']:.2%} rows identical, score rel {layer['score_rel']:.1e}"
            )
        else:  # Megatron's parallel arithmetic upstream of the indexer: the stock model too
            assert not stock["layers"][n]["operands_identical"], (
                f"{where}: the indexer operands differ from the reference's but stock "
                "Megatron's do not: the difference is the package's"
            )


def test_the_operand_condition_is_exercised(parity):
    """Layer 1 under TP reads the embedding (its TP reduction adds only zeros) through GEMMs of
    the reference's shapes: its operands are the reference's, so the check above compares picks
    with the reference's somewhere rather than never."""
    for config in FP8:
        layer = parity[("tp2-sp", config)]["layers"]["1"]
        assert layer["operands_identical"], f"{config} under tp2-sp, DSA layer 1: operands differ"
        assert layer["rows_identical"] == 1.0, f"{config} under tp2-sp, DSA layer 1: {layer}"


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
