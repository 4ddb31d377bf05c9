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
import subprocess
import sys

import pytest
import torch

from ..support.configs import ROOT
from ..support.helpers import free_port, import_example

pytest.importorskip("megatron.core")

FP8 = ("fp8", "rope_fp32+fp8")
PARALLEL = ("tp2-sp", "cp2-bshd", "cp2-thd", "tp2-thd")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    env = dict(os.environ, DSA_PRECISION_STRICT="1")  # threads: the environment's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "examples/parallel_parity.py",
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


# -- the test utilities themselves (no processes) ----------------------------------------------


def _part(tokens, picks):
    return {"tokens": torch.tensor(tokens), "picks": torch.tensor(picks, dtype=torch.int32)}


def test_assemble_picks_orders_by_token_and_compares_duplicate_rows():
    assemble_picks = import_example("parity_checks").assemble_picks

    a, b = _part([2, 0], [[1, 0], [0, -1]]), _part([1, 3], [[0, 1], [2, -1]])
    picks, agree = assemble_picks([a, b])
    assert agree and picks.tolist() == [[0, -1], [0, 1], [1, 0], [2, -1]]
    # A TP rank holding token 0 with another set of keys: the ranks disagree.
    _, agree = assemble_picks([a, b, _part([0], [[-1, 5]])])
    assert not agree
    with pytest.raises(RuntimeError, match="do not cover every token"):
        assemble_picks([_part([0, 2], [[0], [1]])])


def test_assemble_ops_puts_rows_back_and_compares_duplicates():
    assemble_ops = import_example("parity_checks").assemble_ops

    rows = torch.arange(8.0).view(1, 4, 2)
    parts = [
        {"positions": torch.tensor([0, 3]), "ops": {"q": rows[:, [0, 3]], "fp8": False}},
        {"positions": torch.tensor([1, 2]), "ops": {"q": rows[:, [1, 2]], "fp8": False}},
    ]
    ops, agree = assemble_ops(parts, batch=1, total=4)
    assert agree and torch.equal(ops["q"], rows) and ops["fp8"] is False
    other = {"positions": torch.tensor([3]), "ops": {"q": rows[:, [3]] + 1, "fp8": False}}
    assert not assemble_ops([*parts, other], batch=1, total=4)[1]


def _row(config, split=1.0, identical=True, rows_identical=1.0):
    layer = dict(split_identical=split, operands_identical=identical, rows_identical=rows_identical)
    calls = [{"fp8": 3, "bf16": 0}] * 2
    return dict(config=config, finite=True, calls_per_rank=calls, layers={"1": layer})


def test_checks_do_not_require_identical_operands():
    """The verdicts are the package's guarantees: operands that Megatron's (or the BLAS
    library's) arithmetic changed upstream, with other picks, pass; a split that changes picks,
    or other picks from identical operands, fail."""
    checks = import_example("parity_checks").checks

    assert checks([_row("fp8", identical=False, rows_identical=0.9)])["ok"]
    assert checks([_row("stock", split=float("nan"), rows_identical=0.5)])["ok"]
    bad_split = checks([_row("fp8", split=0.99, identical=False)])
    assert not bad_split["ok"] and not bad_split["split_everywhere"]
    bad = checks([_row("rope_fp32+fp8", rows_identical=0.99)])
    assert not bad["ok"] and not bad["fp8_identical_where_operands_identical"]
    bf16_calls = _row("fp8") | {"calls_per_rank": [{"fp8": 3, "bf16": 1}, {"fp8": 3, "bf16": 0}]}
    assert not checks([bf16_calls])["fp8_calls_every_rank"]


def test_score_rel_and_bits_equal():
    bits_equal = import_example("parity_checks").bits_equal
    score_rel = import_example("parity_checks").score_rel

    ref = torch.tensor([[1.0, float("-inf")], [4.0, 2.0]])
    assert score_rel(ref + torch.tensor([[0.0, 0.0], [0.5, 0.0]]), ref) == 0.125
    assert score_rel(torch.zeros(2, 2), ref) == float("inf")  # finite where the reference is not
    a = {"q": torch.ones(2), "fp8": True}
    assert bits_equal(a, {"q": torch.ones(2), "fp8": True})
    assert not bits_equal(a, {"q": torch.ones(2).nextafter(torch.tensor(2.0)), "fp8": True})
    assert not bits_equal(a, {"q": torch.ones(2), "k": torch.ones(2), "fp8": True})


def test_megatron_on_cpu_is_scoped():
    from megatron.core.tensor_parallel import random as mp_random

    from dsa_precision.testing.megatron import megatron_on_cpu

    before = (torch.cuda.current_device, torch.tensor, torch.Tensor.cuda)
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        t = torch.tensor([1, 2], device="cpu", pin_memory=True)
        assert t.cuda(non_blocking=True) is t and not t.is_pinned()
        with mp_random.get_cuda_rng_tracker().fork():  # sequence parallelism's dropout fork
            pass
    assert (torch.cuda.current_device, torch.tensor, torch.Tensor.cuda) == before
    with pytest.raises(Exception, match="not added"):  # Megatron's own tracker again
        with mp_random.get_cuda_rng_tracker().fork():
            pass


BAD_FLAGS = [
    (["--seq", "0"], "--seq 0: give a count >= 1"),
    (["--seq", "100"], "--seq 100: give a multiple of 64 (the packed THD micro-batches)"),
    (["--topk", "-1"], "--topk -1: give a count >= 1"),
    (["--steps", "0"], "--steps 0: give a count >= 1"),
    (["--batch", "0"], "--batch 0: give a count >= 1"),
    (["--throughput-steps", "0"], "--throughput-steps 0: give a count >= 1"),
    (["--throughput", "--throughput-seqs", "128,abc"], "--throughput-seqs 128,abc: give comma-separated token counts"),
    (["--throughput", "--throughput-seqs", "130"], "--throughput-seqs 130: give a multiple of 4"),
    (["--configs", "fp16"], "unknown configuration 'fp16'"),
    (["--layouts", "tp4"], "unknown layout 'tp4'"),
    (["--engine", "tgi"], "--engine 'tgi': choose one of"),
    (["--lr", "0"], "--lr 0.0: give a positive finite learning rate"),
    (["--device", "cuda"], "--device cuda: no CUDA device here; run with --device cpu"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--json", "{tmp}/missing/parity.json"], "give a file path in an existing folder"),
]  # fmt: skip


@pytest.fixture(scope="module")
def launcher():
    """The launcher's module, its environment defaults (DSA_PRECISION_STRICT, ...) set while it
    is imported and taken back after."""
    from unittest import mock

    with mock.patch.dict(os.environ):
        return import_example("parallel_parity")


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_errors(launcher, argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        launcher.parse(["--tiny", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err


def test_the_world_size_and_the_defaults(launcher, capsys, monkeypatch):
    """More than 2 ranks are refused before torch.distributed starts; ``--seq 0`` is refused
    rather than read as "the default"; good flags parse with the tiny defaults."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exit_:
        launcher.parse(["--tiny", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "WORLD_SIZE=4: parallel_parity runs on 1 or 2 ranks" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = launcher.parse(["--tiny", "--device", "cpu"])
    assert (args.seq, args.topk, args.throughput_seqs) == (128, 16, [128, 256])
    args = launcher.parse(["--tiny", "--device", "cpu", "--seq", "192", "--topk", "8"])
    assert (args.seq, args.topk) == (192, 8)
