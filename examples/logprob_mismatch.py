"""What the switches do to RL: the log-prob mismatch each indexer configuration adds, against the
rollout's picks (issue 32), on the toy GLM-5-like model or on saved engine picks.

The comparison isolates the indexer: the same model, weights and tokens run twice, once with
the engine's picks handed in (``dsa_indexer_topk_source="replay"``: attending as the rollout
did) and once with each configuration computing its own picks (baseline, rope_fp32, fp8,
rope_fp32+fp8 with the engine profile, and on CUDA rope_fp32+fp8 from CUDA graphs). Everything
but the indexer is the same code, so ``dlogp = log p_train - log p_rollout`` per token is the
indexer's share of the train/inference mismatch, exactly 0 where every pick is the engine's.
Per configuration: |dlogp| (mean, p99, max), the sequence-level KL estimates (mean dlogp, k3 =
mean exp(dlogp) - 1 - dlogp), the share of tokens whose importance ratio leaves PPO's clip range
(eps 0.2, 0.1) and GRPO / DAPO's [0.8, 1.28], beside the top-k agreement of the same run; for a
configuration whose picks differ, the layers and first tokens where they do
(``dsa_precision.megatron.logprobs.logprob_mismatch``, docs/megatron.md, "RL: log-prob mismatch").

The toy (examples/toy_glm5_train.py, MoE by default): the "engine" is a model of rope_fp32+fp8's
fields and the engine profile (``--engine``), its picks recorded with ``record_topk`` on the
current training weights. The weights train ``--steps`` steps of the toy's copy task (the
``--train-config`` configuration) so that the logits are not uniform; the report is made at
step 0 and after them, on a held-out batch of the task. With ``--rollout engine-kernels`` the
engine's own code makes the rollout's picks (``--rollout-topk vllm``: vLLM's own top-k kernels,
which choose among tied keys at random) and ``rope_fp32+fp8+ties`` replays the engine's tied
rows; with it and rope_fp32+fp8 both run, the report splits rope_fp32+fp8's dlogp by cause: the
tokens moved only by the engine's choice among tied keys, and those still moved with the tied
rows replayed.

Saved picks (``--picks`` a replay file, or ``--engine-output`` an engine's saved responses with
``--engine-format``) with ``--tokens`` (a .pt / .safetensors tensor of the tokens, or a dict with
``tokens`` and optionally ``labels`` and ``loss_mask``): the same table per layer and overall,
for the toy model (``--weights``: a state dict; default the seeded weights). Your own Megatron
model: call ``logprob_mismatch(model, tokens, picks, replay_model=...)`` as ``measure`` does.

CPU:    python examples/logprob_mismatch.py --tiny --device cpu
        python examples/logprob_mismatch.py --tiny --device cpu --save $DIR
        python examples/logprob_mismatch.py --tiny --device cpu --picks $DIR/picks.pt \\
            --tokens $DIR/tokens.pt --weights $DIR/weights.pt
GPU:    python examples/logprob_mismatch.py --out $OUT/logprobs.json --plot $OUT/dlogp.png
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from dsa_precision import ENGINE_PROFILES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flag_checks as fc
import toy_glm5_train as toy

COMPARED = ("baseline", "rope_fp32", "fp8", "rope_fp32+fp8", "rope_fp32+fp8+graph",
            "rope_fp32+fp8+ties")  # fmt: skip
# The configuration whose picks are the engine's by construction: its dlogp must be 0 (with the
# engine's own top-k kernels, whose choice among tied keys no precision reproduces: the same
# fields with the engine's tied rows replayed).
MATCHED = "rope_fp32+fp8"
MATCHED_TIES = "rope_fp32+fp8+ties"
# Where the rollout's picks come from (--rollout), and its top-k (--rollout-topk).
ROLLOUTS = ("model", "engine-kernels")
ROLLOUT_TOPK = ("exact", "vllm")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small model and sequence (CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (tiny: 256)")
    p.add_argument("--topk", type=int, default=256, help="dsa_indexer_topk (tiny: 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences of the measured batch")
    p.add_argument("--steps", type=int, default=30, help="warm-up training steps before the "
                   "second report (0: step 0 only)")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--engine", default="vllm", help="the engine profile (dsa_indexer_engine)")
    p.add_argument(
        "--rollout", choices=ROLLOUTS, default="model",
        help="the rollout's picks: 'model', the package's model of the engine (the toy with "
        "rope_fp32+fp8 and --engine); 'engine-kernels', the engine's own RoPE code and "
        "preprocess kernels from DSA_ENGINE_KERNELS on each layer's projections, layer by layer, "
        "scored by --rollout-scores (vllm, vllm-eager, lmdeploy)",
    )  # fmt: skip
    p.add_argument(
        "--rollout-scores", choices=("deepgemm", "exact"), default=None,
        help="engine-kernels: the scorer of the engine's operands (default deepgemm on CUDA, "
        "exact on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--rollout-topk", choices=ROLLOUT_TOPK, default="exact",
        help="engine-kernels: the rollout's top-k of the engine's logits: 'exact' (ties to the "
        "lower key, the package's model of the engine) or 'vllm', vLLM's own top-k kernels "
        "(DSA_VLLM_OPS: its ops library; rows before --prompt through its prefill kernel, the "
        "rest as decode steps of the whole batch, the kernel vLLM picks for them)",
    )  # fmt: skip
    p.add_argument("--prompt", type=int, default=None,
                   help="--rollout-topk vllm: the prompt's tokens (default half the sequence)")  # fmt: skip
    p.add_argument("--mlp", choices=toy.MLPS, default=toy.MODEL_DEFAULTS["mlp"])
    p.add_argument("--attention-heads", type=int, default=toy.MODEL_DEFAULTS["attention_heads"],
                   help="attention heads (Megatron's unfused sparse attention holds heads x S x S "
                   "float32 scores per layer: 2 at S = 32768)")  # fmt: skip
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, of {', '.join(COMPARED)} (default: all; on the CPU no graphs)",
    )
    p.add_argument("--train-config", default="baseline", help="the configuration that trains")
    p.add_argument("--first-tokens", type=int, default=8, help="differing tokens named")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="plot the dlogp distributions here (matplotlib)")
    p.add_argument("--save", default=None, metavar="DIR", help="write the last report's engine "
                   "picks, tokens and weights to DIR (picks.pt, tokens.pt, weights.pt)")  # fmt: skip
    files = p.add_argument_group("saved engine picks instead of the toy's engine model")
    files.add_argument("--picks", default=None, help="a replay file (save_picks / load_picks)")
    files.add_argument("--engine-output", default=None, help="an engine's saved responses")
    files.add_argument("--engine-format", choices=("sglang", "vllm"), default=None)
    files.add_argument("--tokens", default=None, help="the tokens the picks were made on")
    files.add_argument("--weights", default=None, help="the toy model's weights (state dict)")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.topk = min(args.seq, 256), min(args.topk, 32)
    if args.configs is None:
        args.configs = ",".join(
            n for n in COMPARED
            if (args.device != "cpu" or n not in toy.GRAPHED)
            and (n != MATCHED_TIES or args.rollout == "engine-kernels")
        )  # fmt: skip
    args.configs = args.configs.split(",")
    for name in [*args.configs, args.train_config]:
        if name not in COMPARED:
            p.error(f"unknown configuration {name!r}; choose from {', '.join(COMPARED)}")
        if name in toy.GRAPHED and args.device == "cpu":
            p.error(f"{name} replays CUDA graphs; leave it out on the CPU (--configs)")
    args.files = args.picks is not None or args.engine_output is not None
    if args.picks is not None and args.engine_output is not None:
        p.error("give --picks (a replay file) or --engine-output (an engine's responses), not both")
    if args.engine_output is not None and args.engine_format is None:
        p.error("--engine-output needs --engine-format sglang or vllm")
    if args.files and args.tokens is None:
        p.error("saved picks need --tokens: the tokens they were made on")
    if args.files and args.save:
        p.error("--save writes the toy engine's picks; it has nothing to add to saved picks")
    if args.rollout == "engine-kernels":
        if args.files:
            p.error("--rollout engine-kernels computes the rollout's picks; saved picks are theirs")
        from conformance import engine_kernels as ek

        profile = ENGINE_PROFILES[args.engine] if args.engine in ENGINE_PROFILES else None
        if profile is None or ek.oracle_for(profile) is None or args.engine not in ek.ROPE_ORACLES:
            served = sorted(set(ek.ROPE_ORACLES) & set(ek.ORACLE_ENGINES))  # Triton kernels
            p.error(f"--rollout engine-kernels --engine {args.engine}: the engine's own code runs "
                    f"for {served} only")  # fmt: skip
        missing = [r for e in (ek.oracle_for(profile), ek.ROPE_ORACLES[args.engine][0])
                   if (r := ek.missing_reason(e))]  # fmt: skip
        if missing:
            p.error("--rollout engine-kernels: " + "; ".join(missing))
        if args.rollout_scores is None:
            args.rollout_scores = "exact" if args.device == "cpu" else "deepgemm"
        if args.rollout_topk == "vllm":
            from conformance import vllm_topk

            if (why := vllm_topk.missing_reason()) is not None:
                p.error(f"--rollout-topk vllm: {why}")
    elif args.rollout_scores is not None:
        p.error(
            "--rollout-scores scores the engine kernels' operands: with --rollout engine-kernels"
        )
    elif args.rollout_topk != "exact" or MATCHED_TIES in args.configs:
        what = "--rollout-topk" if args.rollout_topk != "exact" else MATCHED_TIES
        p.error(f"{what} needs the engine's logits: with --rollout engine-kernels")
    if args.prompt is None:
        args.prompt = args.seq // 2
    elif not 0 <= args.prompt <= args.seq:
        p.error(f"--prompt {args.prompt}: give a count of tokens in [0, --seq {args.seq}]")
    fc.check_counts(p, args, dict(
        first_tokens=0, steps=0, batch=1, seq=2, topk=1, attention_heads=1,
    ))  # fmt: skip
    fc.check_lr(p, args.lr)
    fc.check_engine(p, args.engine)
    args.device = fc.check_device(p, args.device)
    _check_files(p, args)
    return args


def _check_files(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The input files readable and the outputs' folders present, before anything runs."""
    from dsa_precision.capture.files import readable_file

    for flag in ("picks", "engine_output", "tokens", "weights"):
        path = getattr(args, flag)
        if path is not None:
            try:
                readable_file(Path(path), flag.replace("_", " "))
            except ValueError as exc:
                p.error(f"--{flag.replace('_', '-')}: {exc}")
    for flag in ("out", "plot"):
        fc.check_output(p, flag, getattr(args, flag))
    if args.save is not None:
        save_dir = Path(args.save)
        if save_dir.exists() and not save_dir.is_dir():
            p.error(f"--save {args.save}: a file, not a folder")
        if not save_dir.exists() and not save_dir.parent.is_dir():
            p.error(f"--save {args.save}: its parent folder {save_dir.parent} does not exist")


# ---------------------------------------------------------------------------- the comparison


def build(args: argparse.Namespace, name: str) -> torch.nn.Module:
    """The toy model of configuration ``name`` (or ``"replay"``: the rollout's run, the
    engine's picks handed in; ``"engine"``: the engine's fields), seeded weights."""
    if name == MATCHED_TIES:  # the matched fields, the engine's tied rows replayed
        fields = {**toy.CONFIGS[MATCHED], "dsa_indexer_topk_source": "replay_ties"}
    elif name == MATCHED:  # its own picks, compared with the engine's as it runs: by cause
        fields = {**toy.CONFIGS[MATCHED], "dsa_indexer_topk_source": "verify"}
    else:
        fields = toy.ENGINE if name == "engine" else toy.CONFIGS[name]
    return toy.build_model(args, toy.model_config(args, **fields))[0]


def measure(
    models: dict[str, torch.nn.Module],
    replay: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    tokens: torch.Tensor,
    picks,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    forward: Callable | None = None,
    first_tokens: int = 8,
    tied_rows=None,
) -> list:
    """Every configuration's report against the rollout's run (``replay`` attending to
    ``picks``), all models on ``weights``: the rollout's log-probs once, then each model's own
    (``logprob_mismatch`` with them; ``tied_rows``, the engine's tied rows, to the
    configuration that replays them)."""
    from dsa_precision.megatron.logprobs import logprob_mismatch, replay_logprobs

    replay.load_state_dict(weights)
    rollout = replay_logprobs(replay, tokens, picks, labels=labels, forward=forward)
    reports = []
    for name, model in models.items():
        model.load_state_dict(weights)
        reports.append(
            logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout, labels=labels,
                             loss_mask=loss_mask, forward=forward, name=name,
                             first_tokens=first_tokens,
                             tied_rows=tied_rows if name == MATCHED_TIES else None)
        )  # fmt: skip
    return reports


def engine_picks(engine: torch.nn.Module, trained: torch.nn.Module, tokens: torch.Tensor):
    """The toy engine's picks of ``tokens`` on ``trained``'s current weights, a ``TopkPicks``."""
    from dsa_precision.picks import TokenLayout, TopkPicks

    picks = toy.engine_picks(engine, trained, tokens)
    return TopkPicks(picks, TokenLayout(seq_len=tokens.shape[1]))


def kernel_rollout_picks(
    replay: torch.nn.Module,
    trained: torch.nn.Module,
    tokens: torch.Tensor,
    model_picks,
    scores: str,
    select: Callable[[list[torch.Tensor], int], list[torch.Tensor]],
):
    """The rollout's picks from the engine's own code, layer by layer: each DSA layer's inputs
    come from a replaying forward on ``trained``'s weights whose earlier layers attend to the
    engine's picks already made (a layer's inputs do not depend on its own or later layers'
    picks), :func:`~conformance.engine_kernels.engine_layer_scores` scores that
    layer's rows with the engine's code and ``select`` (per sequence ``(S, S)`` logits, ``k`` ->
    per sequence ``(S, k)`` picks) picks from them. ``model_picks`` (the package's model's)
    stand in for the layers not yet made. Returns the ``TopkPicks``; the engine's tied rows
    (every row's digest and the tied rows' picks, :func:`~dsa_precision.capture.pack_tie_rows`:
    what the engine sends for ``replay_ties``) with, per layer, how many of them tie at an exact
    0; and the engine code's source."""
    import dataclasses

    import dsa_precision.megatron as dsap
    from conformance.engine_kernels import engine_layer_scores
    from dsa_precision.capture import engine_tie_rows, pack_tie_rows

    replay.load_state_dict(trained.state_dict())
    layers = {m.layer_number: m for m in replay.modules() if hasattr(m, "topk_source")}
    indices, source = dict(model_picks.indices), ""
    seq = tokens.shape[1]
    frames: list[dict[int, object]] = [{} for _ in range(tokens.shape[0])]
    at_zero: dict[int, int] = {}  # per layer: rows sent whose k-th score is an exact 0
    pos = torch.arange(seq, device=tokens.device).expand_as(tokens)
    lengths = torch.arange(1, seq + 1, device=tokens.device)
    for number in sorted(model_picks.indices):
        attn, seen = layers[number], {}
        signature = inspect.signature(attn.forward)

        def keep(_module, args, kwargs, seen=seen, signature=signature):
            seen.update(signature.bind(*args, **kwargs).arguments)  # x, qr among them

        hook = attn.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            with (
                torch.no_grad(),
                dsap.engine_topk(dataclasses.replace(model_picks, indices=indices)),
            ):
                replay(tokens, pos, None)
        finally:
            hook.remove()
        logits, source = engine_layer_scores(attn.indexer, seen["x"], seen["qr"], scores=scores)
        picks = select(logits, min(attn.index_topk, seq))
        at_zero[number] = 0
        for b, (s, p) in enumerate(zip(logits, picks, strict=True)):
            frame = frames[b][number] = engine_tie_rows(s, p, lengths.to(s.device))
            kth = s[frame.rows].gather(-1, frame.picks.clamp(min=0).long())
            kth = kth.masked_fill(frame.picks < 0, float("inf")).amin(-1)
            at_zero[number] += int((kth == 0).sum())
        indices[number] = torch.cat(picks)
    ties = pack_tie_rows(frames, [seq] * len(frames), seq_len=seq)
    return dataclasses.replace(model_picks, indices=indices), (ties, at_zero), source


def rollout_select(args: argparse.Namespace) -> Callable:
    """The rollout's top-k of the engine's logits (``--rollout-topk``)."""
    if args.rollout_topk == "vllm":
        from conformance import vllm_topk

        return lambda logits, k: vllm_topk.rollout_topk(logits, k, args.prompt)
    from dsa_precision.cli.engine_model import engine_select

    return lambda logits, k: [engine_select(s, k) for s in logits]


def run_toy(args: argparse.Namespace, say: Callable[[str], None]) -> dict:
    """Reports at step 0 and after ``args.steps`` warm-up steps (module docstring)."""
    trained = build(args, args.train_config)
    engine, replay = build(args, "engine"), build(args, "replay")
    models = {name: build(args, name) for name in args.configs}
    trainer = toy.Trainer(trained, args.lr)
    vocab = trained.vocab_size
    data = toy.copy_task(args, vocab, args.steps + 1)
    (tokens, labels), train_batches = data[-1], data[:-1]  # a held-out batch, the same each time
    checkpoints, losses = [], []
    for step in sorted({0, args.steps}):
        while len(losses) < step:
            losses.append(trainer.step(*train_batches[len(losses)]))
        picks, source = engine_picks(engine, trained, tokens), "the package's model of the engine"
        ties, at_zero = None, None
        if args.rollout == "engine-kernels":
            picks, (ties, at_zero), source = kernel_rollout_picks(
                replay, trained, tokens, picks, args.rollout_scores, rollout_select(args)
            )
            top = "vLLM's own top-k kernels" if args.rollout_topk == "vllm" else "an exact top-k"
            source = f"{source}, scored by {args.rollout_scores}, selected by {top}"
            sent = sum(int(r.numel()) for r in ties.sent.values())
            say(f"\nthe rollout's picks: {source}; {sent} tied rows sent over the layers")
        t0 = time.perf_counter()
        reports = measure(models, replay, trained.state_dict(), tokens, picks, labels=labels,
                          first_tokens=args.first_tokens, tied_rows=ties)  # fmt: skip
        seconds = time.perf_counter() - t0
        checkpoints.append(dict(step=step, loss=losses[-1] if losses else None, seconds=seconds,
                                rollout=source, ties=ties,
                                ties_at_zero=at_zero if ties is not None else None,
                                exact_topk=args.rollout_topk == "exact",
                                reports=reports, picks=picks, tokens=tokens, labels=labels))  # fmt: skip
        say(_heading(args, step, losses, tokens, seconds))
        say(_format(reports, legend=step == args.steps))
        checkpoints[-1]["dlogp_by_cause"] = split = dlogp_by_cause(reports)
        if split is not None:
            say(_format_split(split))
    return dict(checkpoints=checkpoints, train_losses=losses, weights=trained.state_dict())


def dlogp_by_cause(reports: list) -> dict | None:
    """rope_fp32+fp8's dlogp split by cause, with rope_fp32+fp8+ties beside it (both measured):
    the tokens whose log-prob moves only because the engine chose among tied keys (dlogp != 0
    with training's own picks, 0 once the engine's tied rows are replayed), and those left moved
    with the tied rows replayed (precision, or an engine set that is no top-k). ``None``
    without both configurations."""
    by_name = {r.name: r for r in reports}
    if MATCHED not in by_name or MATCHED_TIES not in by_name:
        return None
    own, replayed = by_name[MATCHED], by_name[MATCHED_TIES]
    mask = own.mask & replayed.mask
    moved, left = (own.delta != 0) & mask, (replayed.delta != 0) & mask
    ties = moved & ~left
    return dict(
        tokens=int(mask.sum()),
        ties=dict(tokens=int(ties.sum()), abs_sum=float(own.delta.abs()[ties].sum()),
                  abs_max=float(own.delta.abs()[ties].max()) if bool(ties.any()) else 0.0),
        left=dict(tokens=int(left.sum()), abs_sum=float(replayed.delta.abs()[left].sum()),
                  abs_max=float(replayed.delta.abs()[left].max()) if bool(left.any()) else 0.0),
    )  # fmt: skip


def _format_split(split: dict) -> str:
    ties, left = split["ties"], split["left"]
    return (
        f"dlogp of {MATCHED} by cause: ties {ties['tokens']} of {split['tokens']} tokens (sum "
        f"|dlogp| {ties['abs_sum']:.3g}, max {ties['abs_max']:.3g}: gone with the tied rows "
        f"replayed); left with them replayed (precision, or an engine set that is no top-k) "
        f"{left['tokens']} tokens (sum |dlogp| {left['abs_sum']:.3g}, max {left['abs_max']:.3g})"
    )


def run_files(args: argparse.Namespace, say: Callable[[str], None]) -> dict:
    """The table of saved engine picks and their tokens, per layer and overall."""
    from dsa_precision.capture import load_engine_output, load_picks
    from dsa_precision.capture.files import read_tensors

    if args.picks is not None:
        picks, source = load_picks(args.picks), args.picks
    else:
        picks = load_engine_output(args.engine_output, engine=args.engine_format)
        source = f"{args.engine_output} ({args.engine_format})"
    saved = read_tensors(args.tokens)
    saved = saved if isinstance(saved, dict) else {"tokens": saved}
    if "tokens" not in saved:
        fail(f"--tokens {args.tokens}: holds {sorted(saved)}, no 'tokens' tensor")
    for key, value in saved.items():  # in their own dtypes, before any cast
        if key in ("tokens", "labels") and (value.is_floating_point() or value.is_complex()):
            fail(f"--tokens {args.tokens}: {key!r} is {value.dtype}; save integer token ids")
        if key == "loss_mask" and not _zero_one(value):
            fail(f"--tokens {args.tokens}: 'loss_mask' ({value.dtype}) holds values other than "
                 "0 and 1; save a bool mask of the tokens' shape, not token indices")  # fmt: skip
    tokens = saved["tokens"].to(device=args.device, dtype=torch.int64)
    labels, loss_mask = saved.get("labels"), saved.get("loss_mask")
    labels = None if labels is None else labels.to(device=args.device, dtype=torch.int64)
    loss_mask = None if loss_mask is None else loss_mask.to(args.device).bool()  # 0/1: checked
    forward = None
    if picks.cu_seqlens is not None:  # packed sequences: Megatron's THD forward
        cu = picks.cu_seqlens.to(torch.int64)
        args.seq = int((cu[1:] - cu[:-1]).max())
        tokens = tokens.reshape(1, -1)
        labels = None if labels is None else labels.reshape(1, -1)
        loss_mask = None if loss_mask is None else loss_mask.reshape(1, -1)
        forward = packed_forward(tokens, cu, args.device)
    else:
        args.seq = tokens.shape[-1]
    models = {name: build(args, name) for name in args.configs}
    replay = build(args, "replay")
    vocab = replay.vocab_size
    if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
        fail(
            f"--tokens {args.tokens}: ids in [{int(tokens.min())}, {int(tokens.max())}], the toy "
            f"model's vocabulary is [0, {vocab}); measure your own model with logprob_mismatch"
        )
    weights = next(iter(models.values())).state_dict()
    if args.weights is not None:
        weights = _load_weights(args.weights, args.device, weights)
    t0 = time.perf_counter()
    reports = measure(models, replay, weights, tokens, picks, labels=labels, loss_mask=loss_mask,
                      forward=forward, first_tokens=args.first_tokens)  # fmt: skip
    seconds = time.perf_counter() - t0
    say(f"engine picks {source}, tokens {args.tokens} {tuple(tokens.shape)}, weights "
        f"{args.weights or 'the seed'}; {args.device}, engine profile {args.engine} "
        f"({seconds:.1f} s)")  # fmt: skip
    for report in reports:
        say("")
        say(report.table())
    say("")
    say(_format(reports))
    return dict(checkpoints=[dict(step=None, loss=None, seconds=seconds, reports=reports)])


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2 (argparse's), never a traceback."""
    print(f"logprob_mismatch.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _zero_one(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is 0 or 1 (a bool, or an integer / float 0/1 mask)."""
    return t.dtype == torch.bool or bool(((t == 0) | (t == 1)).all())


def _load_weights(path: str, device: str, like: dict) -> dict:
    """The state dict in ``path``, its keys and shapes those of the toy model's ``like``."""
    try:
        weights = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # pickle / zip errors, objects weights_only refuses
        fail(f"--weights {path}: not a readable torch file ({' '.join(str(exc).split())[:200]})")
    if not isinstance(weights, dict):
        fail(f"--weights {path}: holds a {type(weights).__name__}; save the model's state_dict()")
    missing, extra = sorted(like.keys() - weights.keys()), sorted(weights.keys() - like.keys())
    if missing or extra:
        fail(f"--weights {path}: not the toy model's state dict (missing {missing[:3]}, "
             f"unexpected {extra[:3]}); save this model's state_dict() (--save)")  # fmt: skip
    for key, value in like.items():
        if isinstance(value, torch.Tensor) and (
            not isinstance(weights[key], torch.Tensor) or weights[key].shape != value.shape
        ):
            fail(f"--weights {path}: {key!r} is {getattr(weights[key], 'shape', weights[key])}, "
                 f"the toy model's {tuple(value.shape)}; save the same model's weights")  # fmt: skip
    return weights


def packed_forward(tokens: torch.Tensor, cu: torch.Tensor, device: str) -> Callable:
    """``forward(model)`` of packed sequences ``[1, T]`` (Megatron's THD: ``PackedSeqParams``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    rows = torch.arange(tokens.shape[1])
    positions = (rows - cu[torch.searchsorted(cu[1:], rows, right=True)]).view(1, -1)
    longest = int((cu[1:] - cu[:-1]).max())
    cu32 = cu.to(device=device, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32,
                          max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip
    positions = positions.to(device)

    def forward(model: torch.nn.Module) -> torch.Tensor:
        return model(tokens, positions, None, packed_seq_params=psp)

    return forward


def _heading(args, step: int, losses: list[float], tokens: torch.Tensor, seconds: float) -> str:
    loss = f", training loss {losses[-1]:.3f}" if losses else ""
    return (
        f"\nstep {step}{loss}: S={args.seq} top-k={args.topk} batch {tokens.shape[0]} "
        f"{args.device}, MLP {args.mlp}, engine profile {args.engine}; each configuration "
        f"against the rollout's run (the engine's picks handed in) ({seconds:.1f} s)"
    )


def _format(reports: list, *, legend: bool = True) -> str:
    from dsa_precision.megatron.logprobs import format_reports

    return format_reports(reports, legend=legend)


# ------------------------------------------------------------------------------------ output


def as_json(args: argparse.Namespace, result: dict) -> dict:
    checkpoints = [
        dict(step=c["step"], loss=c["loss"], seconds=c["seconds"], rollout=c.get("rollout"),
             reports=[r.as_dict() for r in c["reports"]],
             ties=_tie_payload(c.get("ties"), c.get("picks"), c.get("ties_at_zero")),
             dlogp_by_cause=c.get("dlogp_by_cause"))
        for c in result["checkpoints"]
    ]  # fmt: skip
    settings = {k: getattr(args, k) for k in ("tiny", "device", "seq", "topk", "batch", "steps",
                                              "lr", "seed", "engine", "rollout",
                                              "rollout_scores", "rollout_topk", "prompt", "mlp",
                                              "configs",
                                              "train_config", "picks", "engine_output",
                                              "engine_format", "tokens", "weights")}  # fmt: skip
    return dict(settings=settings, checkpoints=checkpoints,
                train_losses=result.get("train_losses"), checks=checks(result))  # fmt: skip


def _tie_payload(ties, picks, at_zero) -> dict | None:
    """What the engine sends for replay_ties (every row's 8-byte digest, the sent rows' numbers
    and delta-coded picks, framed: ``TieRows.to_bytes``) against full replay's picks, int32 and
    delta-coded, in bytes per token and layer; the rows sent per layer, and of them those whose
    k-th score is an exact 0."""
    if ties is None:
        return None
    from dsa_precision.capture import TieRows, encode_picks

    tokens = next(iter(ties.digests.values())).numel()
    sent = int32 = delta = rows_sent = 0
    for n, rows in ties.sent.items():
        sent += len(TieRows(ties.digests[n], rows, ties.indices[n].to(torch.int32)).to_bytes())
        rows_sent += int(rows.numel())
        int32 += 4 * picks.indices[n].numel()
        delta += encode_picks(picks.indices[n], "delta").nbytes
    per = tokens * len(ties.sent)
    per_layer = {n: dict(rows_sent=int(r.numel()), at_zero=(at_zero or {}).get(n))
                 for n, r in sorted(ties.sent.items())}  # fmt: skip
    return dict(layers=len(ties.sent), tokens=tokens, rows_sent=rows_sent, per_layer=per_layer,
                bytes_per_token_layer=sent / per, int32_bytes_per_token_layer=int32 / per,
                delta_bytes_per_token_layer=delta / per, share_of_int32=sent / int32,
                share_of_delta=sent / delta)  # fmt: skip


def checks(result: dict) -> dict:
    """The invariants: a configuration whose picks are the engine's on every row has dlogp = 0
    on every token; and (the toy) rope_fp32+fp8 with the engine's profile picks the engine's."""
    exact, matched = [], []
    for c in result["checkpoints"]:
        for r in c["reports"]:
            if r.picks_identical:
                exact.append(r.logprobs.tokens_differing == 0 and r.logprobs.abs_max == 0)
            # the toy's engine: by construction with --rollout model; the engine's own code's
            # picks with --rollout engine-kernels
            # (rope_fp32+fp8's own picks are the engine's where its top-k is exact; with the
            # engine's own top-k kernels, once its tied rows are replayed)
            if r.name == MATCHED_TIES or (r.name == MATCHED and c.get("exact_topk", True)):
                matched.append(r.picks_identical)
    return dict(
        identical_picks_give_zero_dlogp=all(exact), matched_config_picks_the_engines=all(matched)
    )


def plot(path: str, result: dict) -> None:
    """The distribution of |dlogp| per configuration (a panel per report step): histograms of
    log10 |dlogp| over the tokens where it is not 0, the exact zeros counted in the legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
        ) from None
    checkpoints = result["checkpoints"]
    fig, axes = plt.subplots(1, len(checkpoints), figsize=(6 * len(checkpoints), 4), squeeze=False)
    bins = torch.linspace(-9, 1, 61).tolist()
    for ax, c in zip(axes[0], checkpoints, strict=True):
        for r in c["reports"]:
            d = r.delta[r.mask].abs().cpu()
            nonzero = d[d > 0]
            label = f"{r.name} ({int((d == 0).sum())}/{d.numel()} exactly 0)"
            if nonzero.numel():
                ax.hist(
                    nonzero.log10().clamp(-9, 1).tolist(), bins=bins, histtype="step", label=label
                )
            else:
                ax.plot([], [], label=label)
        title = "saved picks" if c["step"] is None else f"step {c['step']}"
        ax.set_title(f"|log p_train - log p_rollout| per token, {title}")
        ax.set_xlabel("log10 |dlogp|")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(directory: str, result: dict) -> None:
    """The last report's engine picks, tokens (and labels) and weights, for the files mode."""
    from dsa_precision.capture import save_picks

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    last = result["checkpoints"][-1]
    save_picks(out / "picks.pt", last["picks"])
    torch.save({"tokens": last["tokens"].cpu(), "labels": last["labels"].cpu()}, out / "tokens.pt")
    weights = {k: v.cpu() if isinstance(v, torch.Tensor) else v  # Megatron's _extra_state: None
               for k, v in result["weights"].items()}  # fmt: skip
    torch.save(weights, out / "weights.pt")


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 onto 2 for the block: what Megatron logs (its root handler writes to
    stdout) and prints goes to stderr, so that ``--json`` prints one JSON object alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from dsa_precision.testing.megatron import megatron_on_cpu

    on_cpu = megatron_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    quiet = stdout_to_stderr() if args.json else contextlib.nullcontext()
    with quiet, on_cpu:
        code, document = _run(args)
    if args.json:
        print(json.dumps(document, indent=1))
    return code


def _run(args: argparse.Namespace) -> tuple[int, dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29535")
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    say = (lambda _text: None) if args.json else print
    t0 = time.perf_counter()
    try:
        result = run_files(args, say) if args.files else run_toy(args, say)
    except (TypeError, ValueError) as exc:  # unreadable or mismatched files, named by the checks
        if not args.files:
            raise
        fail(" ".join(str(exc).split()))
    document = as_json(args, result)
    document["seconds"] = time.perf_counter() - t0
    say(f"\n{document['seconds']:.1f} s in all")
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1))
    if args.plot:
        plot(args.plot, result)
    if args.save:
        try:
            save(args.save, result)
        except (OSError, ValueError) as exc:
            fail(f"--save {args.save}: cannot be written ({exc})")
    ok = all(document["checks"].values())
    if not ok:
        print(f"check failed: {document['checks']}", file=sys.stderr)
    if started:
        dist.destroy_process_group()
    return (0 if ok else 1), document


if __name__ == "__main__":
    raise SystemExit(main())
