"""examples/toy_glm5_train.py on the CPU (tiny model): the configurations train, the default one
equals stock Megatron, and ``replay`` -- the FP8 picks handed in -- runs no indexer in its step
and trains exactly as the FP8 configuration that computes them."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from ..support.configs import ROOT
from ..support.helpers import free_port, import_example


def test_toy_trains_and_its_replay_configuration_is_the_fp8_one_without_an_indexer(tmp_path):
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))  # fmt: skip
    out = tmp_path / "toy.json"
    args = ["--tiny", "--device", "cpu", "--steps", "4", "--share-steps", "1",
            "--stock-steps", "1", "--profile-steps", "1", "--host-steps", "1",
            "--configs", "baseline,rope_fp32+fp8,replay,rope_fp32+fp8+ties", "--manual-gc", "2",
            "--tie-share", "0.1"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "examples/toy_glm5_train.py", *args, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert result["mlp"] == "moe"  # the seed's model: Megatron's MoELayer in every layer
    assert result["manual_gc"] == 2
    assert result["losses_compared"] == "all"  # Megatron's PyTorch path: a deterministic backward
    assert result["replay_losses_identical"] is True
    assert runs["replay"]["losses"] == runs["rope_fp32+fp8"]["losses"]
    assert runs["replay"]["losses"] != runs["baseline"]["losses"]  # FP8 picks differ from BF16's
    assert runs["rope_fp32+fp8"]["scoring_calls"]["fp8"] == 2 * 4  # 2 layers x 4 steps
    assert runs["replay"]["scoring_calls"]["total"] == 0  # its step scores nothing
    assert runs["replay"]["indexer_ms"] is None
    # replay_ties: its own top-k in every step, a tenth of the rows taken from the engine model
    # (the same picks), so it trains as the FP8 configuration that computes them all.
    assert result["ties_losses_identical"] is True
    assert runs["rope_fp32+fp8+ties"]["scoring_calls"]["fp8"] == 2 * 4
    assert runs["rope_fp32+fp8"]["topk_host_ms_in_step"] > 0  # its top-k, timed inside steps
    assert runs["replay"]["topk_host_ms_in_step"] is None  # no top-k of its own
    assert runs["baseline"]["topk_host_ms_in_step"] is None  # Megatron's, inside its forward
    assert runs["replay"]["package_host_ms_per_layer_forward"] > 0
    # The whole core attention's host time in the step, for every configuration: without an
    # indexer (its picks handed in) it costs the host less than computing them.
    attention = {name: r["attention_host_ms_in_step"] for name, r in runs.items()}
    assert all(ms > 0 for ms in attention.values()), attention
    assert attention["replay"] < attention["rope_fp32+fp8"], attention
    assert result["stock_equivalence"]["bit_identical_losses"] is True
    assert "replay" not in str(result["topk_identical_inputs"])
    assert "ties" not in str(result["topk_identical_inputs"])


def test_tie_rows_sends_every_digest_and_the_shares_rows():
    toy = import_example("toy_glm5_train")
    from dsa_precision.capture import digest_rows

    seq, k = 20, 4
    picks = {1: torch.arange(2 * seq * k, dtype=torch.int64).reshape(2 * seq, k) % seq}
    payload = toy.tie_rows(picks, [seq, seq], 0.1, seq_len=seq)  # every 10th row of each sequence
    assert torch.equal(payload.digests[1], digest_rows(picks[1]))
    assert payload.sent[1].tolist() == [9, 19, 29, 39]
    assert torch.equal(payload.indices[1], picks[1][[9, 19, 29, 39]].to(torch.int32))
    assert toy.tie_rows(picks, [seq, seq], 0.0, seq_len=seq).sent[1].numel() == 0


def test_manual_gc_collects_only_at_its_interval(monkeypatch):
    """``--manual-gc N`` as Megatron's training loop: the collector off inside, one collection on
    entry and one at every N-th step; automatic again after (and untouched without the flag)."""
    import gc

    toy = import_example("toy_glm5_train")
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append("collect") or 0)
    with toy.manual_gc(3) as collect:
        assert not gc.isenabled() and collected == ["collect"]
        for step in range(1, 8):
            collect(step)
        assert collected == ["collect"] * 3  # entry, steps 3 and 6
    assert gc.isenabled()
    with toy.manual_gc(0) as collect:
        collect(5)
    assert collected == ["collect"] * 4 and gc.isenabled()  # entry only
    with toy.manual_gc(None) as collect:
        assert gc.isenabled()
        collect(3)
    assert collected == ["collect"] * 4


def test_toy_refuses_a_bitwise_stock_check_on_megatrons_fused_backward():
    """``--kernel-backend cudnn`` runs Megatron's fused backward, whose atomic adds differ run to
    run: the default-vs-stock bit check after updates cannot hold there, so it is refused."""
    run = subprocess.run(
        [sys.executable, "examples/toy_glm5_train.py", "--kernel-backend", "cudnn",
         "--stock-steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--stock-steps 2" in run.stderr and "--stock-steps 0" in run.stderr, run.stderr[-2000:]


def test_the_full_size_toy_is_the_seeds_moe_model(megatron_parallel):
    """The seed's model: 2 blocks, hidden 1024, MLA kv_lora_rank 512, 32 indexer heads, top-256,
    and in every block Megatron's own MoELayer (8 routed experts, top-2, a shared expert);
    ``mlp="dense"`` keeps the dense MLP of the earlier measurements."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import dsa_precision.megatron as dsap

    toy = import_example("toy_glm5_train")
    args = argparse.Namespace(tiny=False, device="cpu", topk=256, engine="vllm")
    config = toy.model_config(args)
    assert (config.num_layers, config.hidden_size, config.kv_lora_rank) == (2, 1024, 512)
    assert (config.dsa_indexer_n_heads, config.dsa_indexer_topk) == (32, 256)
    assert (config.num_moe_experts, config.moe_router_topk) == (8, 2)
    assert config.moe_token_dispatcher_type == "allgather"
    spec = dsap.get_gpt_dsa_precision_block_spec(config)
    assert all(layer.submodules.mlp.func is MoELayer for layer in spec.layer_specs)
    dense = toy.model_config(argparse.Namespace(**vars(args), mlp="dense"))
    assert dense.num_moe_experts is None
    with pytest.raises(ValueError, match="mlp='sparse'"):
        toy.model_config(argparse.Namespace(**vars(args), mlp="sparse"))


TOY_BAD_FLAGS = [
    (["--steps", "1"], "--steps 1: give a count >= 2"),
    (["--steps", "-5"], "--steps -5: give a count >= 2"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--seq", "0"], "--seq 0: give a count >= 1"),
    (["--topk", "-3"], "--topk -3: give a count >= 1"),
    (["--batch", "0"], "--batch 0: give a count >= 1"),
    (["--share-steps", "-1"], "--share-steps -1: give a count >= 0"),
    (["--manual-gc", "-1"], "--manual-gc -1: give a count >= 0"),
    (["--attention-heads", "0"], "--attention-heads 0: give a count >= 1"),
    (["--tie-share", "1.5"], "--tie-share 1.5: give a share of rows in [0, 1]"),
    (["--lr", "inf"], "--lr inf: give a positive finite learning rate"),
    (["--lr=-1e-3"], "--lr -0.001: give a positive finite learning rate"),
    (["--lr", "0"], "--lr 0.0: give a positive finite learning rate"),
    (["--engine", "tgi"], "--engine 'tgi': choose one of"),
    (["--mlp", "sparse"], "argument --mlp: invalid choice: 'sparse'"),
    (["--configs", "fp16"], "--configs: unknown configuration 'fp16'"),
    (["--configs", "baseline,"], "--configs: unknown configuration ''"),
    (["--configs", "rope_fp32+fp8+graph"], "rope_fp32+fp8+graph replays CUDA graphs"),
    (["--device", "tpu"], "--device 'tpu': give cpu or cuda"),
    (["--device", "cuda"], "--device cuda: no CUDA device here; run with --device cpu"),
    (["--packed", "3", "--batch", "2", "--stock-steps", "0"], "--packed 3: pass --batch 1"),
    (["--packed", "3"], "--packed 3: pass --batch 1, --stock-steps 0"),
    (["--packed", "3", "--stock-steps", "0", "--configs", "replay"], "no replay configuration"),
    (["--packed", "300", "--stock-steps", "0"],
     "--packed 300: 256 tokens (--seq) leave an empty sequence among 300"),
    (["--kernel-backend", "cudnn", "--stock-steps", "0"],
     "--kernel-backend cudnn runs Megatron's fused CUDA kernels; pass --kernel-backend none"),
    (["--kernel-backend", "tilelang"], "--stock-steps 3 compares the default fields"),
    (["--out", "{tmp}/no/toy.json"], "give a file path in an existing folder"),
    (["--out", "{tmp}"], "give a file path in an existing folder"),
]  # fmt: skip


@pytest.mark.parametrize(
    "argv, message", TOY_BAD_FLAGS, ids=[" ".join(a) for a, _ in TOY_BAD_FLAGS]
)
def test_bad_flags_are_one_line_errors(argv, message, capsys, monkeypatch, tmp_path):
    """Every flag the run cannot honour ends the command in one line and exit status 2
    (argparse's), before anything is built; the device as this machine has none."""
    toy = import_example("toy_glm5_train")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        toy.parse(["--tiny", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err


def test_bridge_without_its_packages_is_a_one_line_error(capsys, monkeypatch):
    toy = import_example("toy_glm5_train")
    fc = import_example("flag_checks")
    monkeypatch.setattr(fc, "missing_modules", lambda *names: ["transformer_engine"])
    with pytest.raises(SystemExit) as exit_:
        toy.parse(["--tiny", "--device", "cpu", "--bridge"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and "--bridge builds the model" in err
    assert "transformer_engine cannot be imported here" in err


def test_good_flags_parse_with_the_tiny_defaults_filled_in(tmp_path):
    toy = import_example("toy_glm5_train")
    args = toy.parse(["--tiny", "--device", "cpu:0", "--out", str(tmp_path / "toy.json")])
    assert (args.seq, args.device) == (256, "cpu")  # "cpu:0" as the run compares it
    assert args.configs.split(",") == [n for n in toy.CONFIGS if n not in toy.GRAPHED]
    packed = toy.parse(["--tiny", "--device", "cpu", "--packed", "4", "--stock-steps", "0"])
    assert "replay" not in packed.configs.split(",")


def test_a_bad_flag_on_the_command_line_prints_no_traceback():
    run = subprocess.run(
        [sys.executable, "examples/toy_glm5_train.py", "--tiny", "--device", "cpu", "--steps", "0"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith("--steps 0: give a count >= 2 (the run checks that the loss decreased)")
    )
