"""``python -m dsa_precision demo``: how often training picks the keys inference picked.

From one set of structured BF16 projection outputs (:mod:`.synthetic`), the demo computes the
inference engine's top-k and the training top-k of the four configurations the Megatron
integration offers (baseline, rope_fp32, fp8, rope_fp32+fp8), and reports their agreement.

The two sides share nothing but the inputs. The inference side is :mod:`.engine_model`: on CUDA
the engine's own kernels when ``DSA_ENGINE_KERNELS`` holds them (vLLM 0.33, LMDeploy 0.18) and the
demo runs from a source checkout (their loaders, ``conformance/``, are not installed), else an
independent model of the chosen engine profile (the report says which); on the CPU its scores
are exact, on CUDA they are DeepGEMM's MQA logits (the engines' kernel) when importable. The
training side is the package, as the Megatron integration runs it (torch reference on the CPU,
cuDNN on CUDA). On the CPU both sides use exact arithmetic, so the ``rope_fp32+fp8`` row measures
the contract (the profile's rules, reproduced), not a kernel. Metric definitions:
``docs/numerics.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..agreement import _boundary_margin, _row_scale, _score_error, topk_agreement
from ..backends import deepgemm
from ..config import _FP8_N_HEADS, IndexerPrecisionConfig
from ..engines import DEFAULT_ENGINE, ENGINE_PROFILES, EngineProfile
from ..scoring import Backend, indexer_scores
from ..topk import indexer_topk
from . import CliError, print_json, progress, seed
from .demo_operands import IndexerFields, training_operands
from .engine_model import (
    MODEL_SOURCE,
    EngineOperands,
    engine_operands,
    engine_scores,
    engine_select,
)
from .report import _AGREEMENT_HEADERS, _AGREEMENT_LEGEND, _agreement_cells, _format_table
from .synthetic import SyntheticIndexerInputs, synthetic_indexer_inputs

__all__ = ["configs", "register"]

# (seq_len, topk) per device when not given; the CPU size finishes in well under 30 s on 2 cores.
_DEFAULT_SIZES = {"cpu": (2048, 256), "cuda": (8192, 2048)}
_HEAD_DIM = 128
_ROPE_DIM = 64
_PLOT_BINS = 64
# Fewer compared rows (query positions with more visible keys than topk) than this measure nothing.
_MIN_COMPARED_ROWS = 32


def _inference_operands(
    inputs: SyntheticIndexerInputs, engine: EngineProfile, *, hadamard: bool, interleaved: bool
) -> tuple[EngineOperands, str]:
    """The inference side's operands and what built them. From a source checkout
    ``conformance.inference.inference_operands`` decides (the engine's own kernels on CUDA when
    ``DSA_ENGINE_KERNELS`` holds them, else the engine model, with the reason); a pip install has
    no ``conformance/``, so the engine model builds them and the description says why."""
    try:
        from conformance.inference import inference_operands as from_checkout
    except ImportError as error:  # a pip install: the engine oracles are not installed
        if (error.name or "").partition(".")[0] != "conformance":
            raise
        ops = engine_operands(inputs, engine, hadamard=hadamard, interleaved=interleaved)
        why = "they run from a source checkout (conformance/)"
        return ops, f"{MODEL_SOURCE}; not the engine's kernels: {why}"
    return from_checkout(inputs, engine, hadamard=hadamard, interleaved=interleaved)


def configs(engine: EngineProfile) -> tuple[IndexerPrecisionConfig, ...]:
    """The four training configurations, in table order."""
    return tuple(
        IndexerPrecisionConfig(rope_fp32=r, scoring_precision=p, engine=engine)
        for r, p in ((False, "bf16"), (True, "bf16"), (False, "fp8"), (True, "fp8"))
    )


@dataclasses.dataclass(frozen=True)
class _ConfigResult:
    """One training configuration against inference, over the compared rows."""

    config: IndexerPrecisionConfig
    indices: torch.Tensor  # int32 [rows, topk], the configuration's picks (compared rows only)
    agreement: dict[str, float | int]  # TopkAgreement.as_dict()
    boundary_margin: float
    score_error: float

    @property
    def name(self) -> str:
        return self.config.short_str()

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rope_fp32": self.config.rope_fp32,
            "scoring_precision": self.config.scoring_precision.value,
            **self.agreement,
            "boundary_margin": _finite_or_none(self.boundary_margin),
            "score_error": _finite_or_none(self.score_error),
        }


@dataclasses.dataclass(frozen=True)
class _DemoRun:
    """Everything the demo measured; ``as_json`` is what ``--json`` prints."""

    seq_len: int
    topk: int
    n_heads: int
    seed: int
    device: str
    backend: str
    inference_kernel: str
    engine: EngineProfile
    model: IndexerFields
    inference_margin: float
    inference_indices: torch.Tensor  # int32 [rows, topk], compared rows only
    configs: list[_ConfigResult]
    seconds: float
    inference_source: str = MODEL_SOURCE  # what built the inference operands

    @property
    def first_row(self) -> int:
        """Query position of the first compared row (earlier rows keep every visible key)."""
        return self.topk

    def as_json(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "topk": self.topk,
            "n_heads": self.n_heads,
            "head_dim": _HEAD_DIM,
            "rope_dim": _ROPE_DIM,
            "seed": self.seed,
            "device": self.device,
            "training_backend": self.backend,
            "inference": {
                "engine": self.engine.name,
                "scores": self.inference_kernel,
                "operands": self.inference_source,
            },
            "model": dataclasses.asdict(self.model),
            "first_row": self.first_row,
            "inference_boundary_margin": _finite_or_none(self.inference_margin),
            "configs": [c.as_json() for c in self.configs],
            "seconds": round(self.seconds, 3),
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _run_demo(
    *,
    seq_len: int,
    topk: int,
    n_heads: int = 32,
    seed: int = 0,
    device: str = "cpu",
    backend: Backend | None = None,
    engine: EngineProfile = DEFAULT_ENGINE,
    model: IndexerFields | None = None,
) -> _DemoRun:
    """Run the comparison; see the module docstring. Rows ``< topk`` (which select every visible
    key on both sides) are left out of every metric."""
    start = time.monotonic()
    model = model or IndexerFields()
    backend = backend or ("torch" if device == "cpu" else "cudnn")
    kernel = "deepgemm" if device == "cuda" and deepgemm._deepgemm_available() else "exact"
    inputs = synthetic_indexer_inputs(
        seq_len, n_heads=n_heads, head_dim=_HEAD_DIM, rope_dim=_ROPE_DIM, seed=seed
    ).to(device)
    rows = slice(topk, None)
    with torch.no_grad():
        ref_ops, source = _inference_operands(
            inputs, engine, hadamard=model.hadamard, interleaved=model.rope_interleaved
        )
        ref_scores = engine_scores(ref_ops, kernel=kernel)[rows]
        ref_indices = engine_select(ref_scores, topk)
        scale = _row_scale(ref_scores)
        results = []
        for config in progress(configs(engine), desc="demo"):
            # DeepGEMM scores FP8 operands only: the BF16 rows stay on cuDNN (--backend help).
            fp8_only = backend == "deepgemm" and not config.fp8
            ops = training_operands(inputs, config, model)
            scores = indexer_scores(ops, backend="cudnn" if fp8_only else backend)[0]
            picks = indexer_topk(
                scores[rows], topk, backend="cudnn" if backend != "torch" else "torch"
            )
            results.append(
                _ConfigResult(
                    config,
                    picks.cpu(),
                    topk_agreement(picks, ref_indices).as_dict(),
                    _boundary_margin(scores[rows], scale, topk),
                    _score_error(scores[rows], ref_scores, scale),
                )
            )
    return _DemoRun(
        seq_len=seq_len,
        topk=topk,
        n_heads=n_heads,
        seed=seed,
        device=device,
        backend=backend,
        inference_kernel=kernel,
        engine=engine,
        model=model,
        inference_margin=_boundary_margin(ref_scores, scale, topk),
        inference_indices=ref_indices.cpu(),
        configs=results,
        seconds=time.monotonic() - start,
        inference_source=source,
    )


def _fmt(x: float) -> str:
    return "n/a" if not math.isfinite(x) else ("0" if x == 0 else f"{x:.3g}")


def _format_run(run: _DemoRun) -> str:
    """The human-readable report."""
    e, m = run.engine, run.model
    scores = (
        f"DeepGEMM {deepgemm._entry_point()} (the engines' kernel)"
        if run.inference_kernel == "deepgemm"
        else "exact (float64 sums of the E4M3 products)"
    )
    training = {
        "torch": "the exact torch reference",
        "cudnn": "cuDNN's SM90 kernels",
        "deepgemm": f"DeepGEMM {deepgemm._entry_point()} (FP8 rows; BF16 rows by cuDNN)",
    }[run.backend]
    rows = run.inference_indices.shape[0]
    header = [
        "DSA lightning indexer: training top-k vs inference top-k",
        f"  indexer {run.n_heads} heads x {_HEAD_DIM}, rope {_ROPE_DIM}; sequence {run.seq_len}, "
        f"top-{run.topk}; seed {run.seed}; {run.device}",
        f"  inference: engine profile '{e.name}' ({e.summary}),",
        f"             operands: {run.inference_source}; scores {scores}",
        f"  training:  dsa-precision, as the Megatron integration runs it, scored by {training}",
        f"  model: Hadamard {'on' if m.hadamard else 'off'}, RoPE "
        f"{'interleaved' if m.rope_interleaved else 'rotate-half'}",
        f"  compared: {rows} query rows (positions {run.first_row}..{run.seq_len - 1}; earlier "
        "rows keep every visible key)",
    ]
    if run.inference_kernel == "exact" and run.backend == "torch":
        header.append(
            "  note: both sides use exact arithmetic here, so the rope_fp32+fp8 row measures the "
            "contract (the profile's rules, reproduced), not a kernel"
        )
    table_rows = [
        ["inference", "", "", "", "", _fmt(run.inference_margin), "0"],
        *(
            [c.name, *_agreement_cells(c.agreement), _fmt(c.boundary_margin), _fmt(c.score_error)]
            for c in run.configs
        ),
    ]
    table = _format_table(["config", *_AGREEMENT_HEADERS, "margin", "score error"], table_rows)
    footer = [
        "",
        *_AGREEMENT_LEGEND,
        "margin: median over rows of (k-th - (k+1)-th largest score) / row score std;",
        "score error: median over rows of max |training - inference score| / row score std.",
        f"({run.seconds:.1f} s)",
    ]
    return "\n".join([*header, "", table, *footer])


def _plot_run(run: _DemoRun, path: Path) -> None:
    """Member agreement and identical-row share per query-position bin, one line per config."""
    from matplotlib.figure import Figure

    rows = run.inference_indices.shape[0]
    edges = torch.linspace(0, rows, min(_PLOT_BINS, rows) + 1).round().long().tolist()
    bins = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    centers = [run.first_row + (a + b - 1) / 2 for a, b in bins]
    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    # Distinct line styles: configurations often coincide (e.g. baseline and rope_fp32).
    for c, style in zip(run.configs, itertools.cycle(("-", "--", "-.", ":")), strict=False):
        per_bin = [
            topk_agreement(c.indices[a:b], run.inference_indices[a:b]).as_dict() for a, b in bins
        ]
        line = dict(label=c.name, linestyle=style)
        top.plot(centers, [100 * m["member_agreement"] for m in per_bin], **line)
        bottom.plot(centers, [100 * m["rows_identical"] for m in per_bin], **line)
    top.set_ylabel("member agreement (%)")
    bottom.set_ylabel("rows identical (%)")
    bottom.set_xlabel("query position")
    top.set_title(
        f"training vs {run.engine.name} top-{run.topk}, sequence {run.seq_len}, {run.n_heads} "
        f"heads ({run.device})"
    )
    top.legend(loc="lower left")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def _check_plot_path(path: Path) -> None:
    """Before the demo runs: matplotlib is importable, writes ``path``'s suffix, and the
    directory exists."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()  # {suffix: description}
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install 'dsa-precision[plot]'") from None
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in formats:
        what = f".{suffix} files" if suffix else "a file name without a suffix"
        raise CliError(
            f"--plot {path}: matplotlib cannot write {what}; name a file ending in one of "
            + ", ".join("." + f for f in sorted(formats))
        )
    if not path.parent.is_dir():
        raise CliError(f"--plot {path}: directory {path.parent} does not exist")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="measure training vs inference top-k agreement on structured synthetic inputs",
        description=__doc__,
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument("--seq", type=_positive_int, help="sequence length (cpu 2048, cuda 8192)")
    p.add_argument("--topk", type=_positive_int, help="keys per query (cpu 256, cuda 2048)")
    p.add_argument(
        "--heads", type=int, choices=_FP8_N_HEADS, default=32, help="indexer heads (default 32)"
    )
    p.add_argument(
        "--seed", type=seed, default=0, help="input generator seed, 0 to 2**64 - 1 (default 0)"
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINE_PROFILES),
        default=DEFAULT_ENGINE.name,
        help=f"inference engine profile, both sides (default {DEFAULT_ENGINE.name})",
    )
    p.add_argument(
        "--backend",
        choices=("torch", "cudnn", "deepgemm"),
        help="training-side scoring backend (cpu: torch, cuda: cudnn); deepgemm scores the FP8 "
        "configurations and leaves the BF16 ones on cudnn",
    )
    model = p.add_argument_group("model (applies to both sides)")
    model.add_argument(
        "--hadamard", action="store_true", help="Hadamard-rotate q and k (rotate_activation)"
    )
    model.add_argument(
        "--rope-interleaved", action="store_true", help="interleaved RoPE lanes (MLA style)"
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="plot agreement vs position (any format matplotlib writes: .png, .pdf, .svg, ...)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    default_seq, default_topk = _DEFAULT_SIZES[args.device]
    seq_len = args.seq or default_seq
    topk = args.topk or min(default_topk, max(1, seq_len // 4))
    if topk >= seq_len:
        raise CliError(f"--topk {topk} must be below the sequence length {seq_len}")
    if seq_len - topk < _MIN_COMPARED_ROWS:
        raise CliError(
            f"--seq {seq_len} --topk {topk} leaves {seq_len - topk} query rows with more visible "
            f"keys than topk (positions {topk}..{seq_len - 1}; earlier rows keep every key on "
            f"both sides); agreement over fewer than {_MIN_COMPARED_ROWS} rows measures nothing: "
            f"use --seq >= {topk + _MIN_COMPARED_ROWS} or a smaller --topk"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: CUDA is not available in this process")
    if args.backend in ("cudnn", "deepgemm") and args.device != "cuda":
        raise CliError(f"--backend {args.backend} runs on --device cuda")
    engine = ENGINE_PROFILES[args.engine]
    model = IndexerFields(hadamard=args.hadamard, rope_interleaved=args.rope_interleaved)
    mismatch = engine.model_mismatch(
        rotate_activation=model.hadamard, rope_interleaved=model.rope_interleaved
    )
    if mismatch:
        raise CliError("; ".join(mismatch).replace("dsa_indexer_rotate_activation", "--hadamard"))
    if args.plot is not None:
        _check_plot_path(args.plot)
    try:
        run = _run_demo(
            seq_len=seq_len,
            topk=topk,
            n_heads=args.heads,
            seed=args.seed,
            device=args.device,
            backend=args.backend,
            engine=engine,
            model=model,
        )
    except (RuntimeError, ImportError) as exc:  # e.g. cuDNN unusable, out of memory
        raise CliError(" ".join(str(exc).split())) from None
    if args.plot is not None:
        try:
            _plot_run(run, args.plot)
        except OSError as exc:
            raise CliError(f"--plot {args.plot}: {exc.strerror or exc}") from None
    if args.json:
        print_json(run.as_json())
    else:
        print(_format_run(run))
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0
