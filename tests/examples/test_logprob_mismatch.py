"""examples/logprob_mismatch.py on the CPU (tiny toy, MoE): the command runs, reports at step 0
and after the warm-up steps, and its figures are those of two forwards computed here from the
weights, picks and tokens it saved (the rollout's run with the engine's picks handed in, each
configuration's own); run again on those saved files, it reports the same numbers."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ..support.configs import ROOT
from ..support.helpers import free_port, import_example

pytest.importorskip("megatron.core")

CONFIGS = "baseline,fp8,rope_fp32+fp8"
STEPS = 2


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))  # fmt: skip
    return subprocess.run(
        [sys.executable, "examples/logprob_mismatch.py", "--tiny", "--device", "cpu", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("logprobs")
    args = ["--steps", str(STEPS), "--batch", "2", "--configs", CONFIGS,
            "--out", str(out / "report.json"), "--save", str(out)]  # fmt: skip
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(out / "dlogp.png")]
    run = _run(*args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text()), run.stdout


def test_reports_at_step_zero_and_after_the_warm_up(toy_run):
    out, doc, stdout = toy_run
    assert [c["step"] for c in doc["checkpoints"]] == [0, STEPS]
    assert doc["checks"] == {"identical_picks_give_zero_dlogp": True,
                             "matched_config_picks_the_engines": True}  # fmt: skip
    assert len(doc["train_losses"]) == STEPS and doc["settings"]["mlp"] == "moe"
    for c in doc["checkpoints"]:
        reports = {r["name"]: r for r in c["reports"]}
        assert list(reports) == CONFIGS.split(",")
        matched = reports["rope_fp32+fp8"]
        assert matched["picks_identical"] and matched["logprobs"]["tokens_differing"] == 0
        assert matched["logprobs"]["abs_max"] == 0 and matched["logprobs"]["kl_k3"] == 0
        baseline = reports["baseline"]
        assert not baseline["picks_identical"] and baseline["logprobs"]["abs_max"] > 0
        assert [layer["layer"] for layer in baseline["layers"]] == [1, 2]
        assert all(layer["first_differing"] for layer in baseline["layers"])
    assert "step 0:" in stdout and f"step {STEPS}, training loss" in stdout
    assert "baseline: layer 1:" in stdout and "(sequence:position)" in stdout
    assert {"picks.pt", "tokens.pt", "weights.pt"} <= {p.name for p in out.iterdir()}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "dlogp.png").stat().st_size > 0


def _direct(out, name: str):
    """delta per token and each layer's differing rows, computed here from the saved files."""
    import dsa_precision.megatron as dsap
    from dsa_precision.capture import load_picks

    toy = import_example("toy_glm5_train")
    args = argparse.Namespace(tiny=True, device="cpu", topk=32, engine="vllm", seed=1234,
                              seq=256, batch=2, lr=1e-3)  # fmt: skip
    weights = torch.load(out / "weights.pt", weights_only=True)
    saved = torch.load(out / "tokens.pt", weights_only=True)
    tokens, labels = saved["tokens"], saved["labels"]
    picks = load_picks(out / "picks.pt")
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def logprobs(fields, **kw):
        model = toy.build_model(args, toy.model_config(args, **fields))[0]
        model.load_state_dict(weights)
        model.eval()
        with torch.no_grad(), dsap.record_topk() as recorder:
            logits = model(tokens, positions, None, **kw).float()
        lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
        return lp, recorder.picks.indices

    with dsap.engine_topk(picks):
        rollout, _ = logprobs(toy.CONFIGS["replay"])
    train, own = logprobs(toy.CONFIGS[name])
    differing = {
        n: sum(set(a) - {-1} != set(b) - {-1}
               for a, b in zip(own[n].tolist(), picks.indices[n].tolist(), strict=True))
        for n in own
    }  # fmt: skip
    return (train.double() - rollout.double()).reshape(-1).numpy(), differing


@pytest.mark.parametrize("name", ["baseline", "fp8", "rope_fp32+fp8"])
def test_figures_are_those_of_two_forwards_computed_here(toy_run, name, megatron_parallel,
                                                         cpu_rotary):  # fmt: skip
    out, doc, _ = toy_run
    report = next(r for r in doc["checkpoints"][-1]["reports"] if r["name"] == name)
    delta, differing = _direct(out, name)
    m = report["logprobs"]
    assert m["tokens"] == delta.size  # the toy's labels: every position has its next token
    assert m["tokens_differing"] == int((delta != 0).sum())
    assert m["abs_mean"] == pytest.approx(float(np.abs(delta).mean()), abs=2e-6)
    assert m["abs_p99"] == pytest.approx(float(np.quantile(np.abs(delta), 0.99)), abs=2e-6)
    assert m["abs_max"] == pytest.approx(float(np.abs(delta).max()), abs=2e-6)
    per_seq = delta.reshape(2, -1)
    assert m["delta_mean"] == pytest.approx(float(per_seq.mean(1).mean()), abs=2e-6)
    k3 = np.expm1(per_seq) - per_seq
    assert m["kl_k3"] == pytest.approx(float(k3.mean(1).mean()), abs=1e-8)
    ratio = np.exp(delta)
    for key, (low, high) in {"ppo_0.2": (0.2, 0.2), "ppo_0.1": (0.1, 0.1),
                             "dapo_0.2_0.28": (0.2, 0.28)}.items():  # fmt: skip
        share = float(((ratio < 1 - low) | (ratio > 1 + high)).mean())
        assert m["clipped"][key] == pytest.approx(share, abs=1 / delta.size), key
    assert {layer["layer"]: layer["rows_differing"] for layer in report["layers"]} == differing
    if name == "rope_fp32+fp8":
        assert not delta.any() and set(differing.values()) == {0}


def test_saved_files_give_the_same_table(toy_run):
    out, doc, _ = toy_run
    run = _run("--configs", CONFIGS, "--picks", str(out / "picks.pt"), "--tokens",
               str(out / "tokens.pt"), "--weights", str(out / "weights.pt"), "--json")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = json.loads(run.stdout)
    (checkpoint,) = files["checkpoints"]
    assert checkpoint["reports"] == doc["checkpoints"][-1]["reports"]


def test_the_command_refuses_inconsistent_flags(capsys):
    lm = import_example("logprob_mismatch")
    for argv, message in (
        (["--engine-output", "x.jsonl", "--tokens", "t.pt"], "--engine-format"),
        (["--picks", "p.pt"], "--tokens"),
        (
            ["--picks", "p", "--engine-output", "x", "--engine-format", "vllm", "--tokens", "t"],
            "not both",
        ),
        (["--device", "cpu", "--configs", "rope_fp32+fp8+graph"], "CUDA graphs"),
        (["--configs", "fp16"], "unknown configuration 'fp16'"),
        (
            ["--rollout", "engine-kernels", "--engine", "sglang-fused"],
            "the engine's own code runs for ['lmdeploy', 'vllm', 'vllm-eager'] only",
        ),
        (
            ["--rollout", "engine-kernels", "--picks", "p", "--tokens", "t"],
            "saved picks are theirs",
        ),
        (["--rollout-scores", "exact"], "with --rollout engine-kernels"),
    ):
        with pytest.raises(SystemExit) as exit_:
            lm.parse(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_an_engines_saved_responses_packed_as_thd(tmp_path, megatron_parallel, cpu_rotary):
    """SGLang responses (``return_indexer_topk``: every token's rows but the last) of two
    requests, their picks those of the toy engine: read through the capture adapters, packed
    (THD), measured with Megatron's packed forward. rope_fp32+fp8 picks the engine's keys on
    every row the engine ran, and its dlogp is 0 on every compared token."""
    import dsa_precision.megatron as dsap

    from ..support.engine_outputs import sglang_response

    lm, toy = import_example("logprob_mismatch"), import_example("toy_glm5_train")
    args = lm.parse(["--tiny", "--device", "cpu"])
    lengths = (70, 50)
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    tokens = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    args.seq = max(lengths)
    engine = toy.build_model(args, toy.model_config(args, **toy.ENGINE))[0]
    with torch.no_grad(), dsap.record_topk() as recorder:
        lm.packed_forward(tokens, cu, "cpu")(engine)
    rows = torch.stack([recorder.picks.indices[n] for n in (1, 2)], dim=1)  # (T, layers, k)
    responses = [sglang_response(rows[a:b]) for a, b in itertools.pairwise(cu.tolist())]
    (tmp_path / "responses.json").write_text(json.dumps(responses))
    torch.save(tokens[0], tmp_path / "tokens.pt")
    run = _run("--configs", "baseline,rope_fp32+fp8", "--engine-output",
               str(tmp_path / "responses.json"), "--engine-format", "sglang", "--tokens",
               str(tmp_path / "tokens.pt"), "--json")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = {r["name"]: r for r in json.loads(run.stdout)["checkpoints"][0]["reports"]}
    matched = reports["rope_fp32+fp8"]
    assert matched["picks_identical"] and matched["logprobs"]["tokens_differing"] == 0
    assert matched["logprobs"]["tokens"] == sum(lengths) - 2  # each request's last: no next
    assert matched["logprobs"]["sequences"] == 2
    assert all(layer["rows"] == sum(lengths) - 2 for layer in matched["layers"])  # ran rows
    assert not reports["baseline"]["picks_identical"]
    places = [p for layer in reports["baseline"]["layers"] for p in layer["first_differing"]]
    assert all(0 <= s < 2 and 0 <= p < lengths[s] for s, p in places), places


def test_the_engine_kernel_rollout_names_what_is_missing(capsys, monkeypatch, tmp_path):
    """Without the engines' files, ``--rollout engine-kernels`` refuses with the reason (the
    folder and the file it looked for), before building anything."""
    lm = import_example("logprob_mismatch")
    monkeypatch.setenv("DSA_ENGINE_KERNELS", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        lm.parse(["--rollout", "engine-kernels"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--rollout engine-kernels: " in err and str(tmp_path) in err


def test_bad_flags_and_unreadable_files_are_one_line_errors(capsys, tmp_path):
    lm = import_example("logprob_mismatch")
    (tmp_path / "garbage.pt").write_text("not a torch file")
    for argv, message in (
        (["--device", "tpu"], "--device 'tpu': give cpu or cuda"),
        (["--engine", "tgi"], "--engine 'tgi': choose one of"),
        (["--lr", "nan"], "--lr nan: give a positive finite learning rate"),
        (["--seq", "1"], "--seq 1: give a count >= 2"),
        (["--picks", str(tmp_path / "none.pt"), "--tokens", "t.pt"], "none.pt: no such file"),
        (["--picks", str(tmp_path), "--tokens", "t.pt"], "a directory, not a file"),
        (["--out", str(tmp_path / "no" / "r.json")], "give a file path in an existing folder"),
        (["--save", str(tmp_path / "no" / "dir")], "its parent folder"),
    ):
        with pytest.raises(SystemExit) as exit_:
            lm.parse(["--device", "cpu", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_mismatched_saved_files_are_one_line_errors(toy_run, tmp_path):
    """Tokens of another length than the picks', a loss_mask of token indices, weights of
    another model: exit status 2 and one line naming the file, never a traceback."""
    out, _, _ = toy_run
    saved = torch.load(out / "tokens.pt")
    tokens = saved["tokens"]
    torch.save({"tokens": tokens[:, 1:]}, tmp_path / "short.pt")
    torch.save({"tokens": tokens, "loss_mask": torch.tensor([0, 3, 5])}, tmp_path / "indices.pt")
    torch.save({"embedding.weight": torch.zeros(1)}, tmp_path / "weights.pt")
    picks = ["--configs", "baseline", "--picks", str(out / "picks.pt")]
    for argv, message in (
        (["--tokens", str(tmp_path / "short.pt")], "but the picks seq_len="),
        (["--tokens", str(tmp_path / "indices.pt")], "holds values other than 0 and 1"),
        (["--tokens", str(out / "tokens.pt"), "--weights", str(tmp_path / "weights.pt")],
         "not the toy model's state dict"),
    ):  # fmt: skip
        run = _run(*picks, *argv)
        assert run.returncode == 2, run.stderr[-3000:]
        assert "Traceback" not in run.stderr and message in run.stderr.strip().splitlines()[-1]


def test_the_engines_tied_rows_replayed_close_the_tie_floor():
    """With the engine's top-k breaking ties at random (vLLM's kernels do) on logits equal to
    training's, rope_fp32+fp8's own picks differ exactly on the tied rows and move the log-probs;
    with the engine's tied rows replayed (replay_ties) every row is the engine's and every
    token's dlogp is 0 (tests/support/tie_rollout.py: the stand-ins and the planted ties)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.tie_rollout", "--tiny", "--device", "cpu",
         "--steps", "0", "--batch", "2", "--configs", "rope_fp32+fp8,rope_fp32+fp8+ties",
         "--rollout", "engine-kernels", "--rollout-topk", "vllm", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(run.stdout)
    assert doc["checks"] == {"identical_picks_give_zero_dlogp": True,
                             "matched_config_picks_the_engines": True}  # fmt: skip
    (c,) = doc["checkpoints"]
    assert "selected by vLLM's own top-k kernels" in c["rollout"]
    ties = c["ties"]
    assert ties["rows_sent"] > 0 and ties["layers"] == 2
    first = ties["per_layer"]["1"]  # the zeroed tokens: rows of exact-0 scores in layer 1
    assert first["rows_sent"] > 0 and first["at_zero"] == first["rows_sent"]
    assert ties["bytes_per_token_layer"] < ties["int32_bytes_per_token_layer"]
    reports = {r["name"]: r for r in c["reports"]}
    own, replayed = reports["rope_fp32+fp8"], reports["rope_fp32+fp8+ties"]
    assert not own["picks_identical"] and own["logprobs"]["tokens_differing"] > 0
    assert replayed["picks_identical"] and replayed["logprobs"]["tokens_differing"] == 0
    assert replayed["logprobs"]["abs_max"] == 0 and replayed["logprobs"]["kl_k3"] == 0
    # rope_fp32+fp8 runs as verify: layer 1's differing rows are all at a tie of its own scores
    # (the planted ties); layer 2's follow from them (inputs moved), none is left once replayed.
    first_layer = own["layers"][0]
    assert first_layer["rows_differing"] > 0
    assert first_layer["causes"] == dict(tie_rows=first_layer["rows_differing"], precision_rows=0)
    assert "causes" not in replayed["layers"][0]
    # dlogp by cause: every moved token moved because of a tie; none is left once replayed.
    split = c["dlogp_by_cause"]
    assert split["ties"]["tokens"] == own["logprobs"]["tokens_differing"] > 0
    assert split["ties"]["abs_max"] == own["logprobs"]["abs_max"]
    assert split["left"] == dict(tokens=0, abs_sum=0.0, abs_max=0.0)


def test_tied_rows_need_the_engines_logits(capsys):
    lm = import_example("logprob_mismatch")
    for flags, match in (
        (["--rollout-topk", "vllm"], "--rollout-topk needs the engine's logits"),
        (["--configs", "rope_fp32+fp8+ties"], "rope_fp32+fp8+ties needs the engine's logits"),
        (["--prompt", "9999", "--tiny", "--device", "cpu"], "--prompt 9999"),
    ):
        with pytest.raises(SystemExit) as exit_:
            lm.parse(flags)
        assert exit_.value.code == 2 and match in capsys.readouterr().err
