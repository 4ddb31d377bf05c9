"""``python -m dsa_precision demo``: how often training picks the keys inference picked.

From one set of structured BF16 projection outputs (:mod:`dsa_precision.synthetic`), the demo
computes the inference engine's top-k (FP32 preprocessing, FP8 E4M3/UE8M0 scoring, FP32 head
weights) and the training top-k of the four :class:`~dsa_precision.IndexerPrecisionConfig`
settings the Megatron integration offers, and reports their agreement. The contract of both sides
and the metric definitions are in ``docs/numerics.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from ._report import AGREEMENT_HEADERS, agreement_cells, format_table
from .agreement import topk_agreement
from .cli import CliError, progress
from .config import FP8_N_HEADS, IndexerPrecisionConfig
from .preprocess import IndexerPreprocess, indexer_head_weights
from .quantize import DEFAULT_AMAX_FLOOR
from .scoring import indexer_scores
from .synthetic import SyntheticIndexerInputs, synthetic_indexer_inputs
from .topk import indexer_topk

__all__ = [
    "CONFIGS",
    "ConfigResult",
    "DemoRun",
    "EngineVariant",
    "Side",
    "boundary_margin",
    "head_weights",
    "inference_side",
    "register",
    "row_scale",
    "run_demo",
    "score_error",
    "training_side",
]

HeadWeights = Literal["fp32", "fp32-premultiplied", "bf16"]

# The four training configurations, in table order.
CONFIGS = (
    IndexerPrecisionConfig(),
    IndexerPrecisionConfig(rope_fp32=True),
    IndexerPrecisionConfig(scoring_precision="fp8"),
    IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8"),
)

# (seq_len, topk) per device when not given; the CPU size finishes in well under 30 s on 2 cores.
DEFAULT_SIZES = {"cpu": (2048, 256), "cuda": (8192, 2048)}
# Scoring and top-k backend per device: explicit, so a cuDNN problem is an error, not a fallback.
BACKENDS = {"cpu": "torch", "cuda": "cudnn"}
HEAD_DIM = 128
ROPE_DIM = 64
PLOT_BINS = 64


@dataclasses.dataclass(frozen=True)
class EngineVariant:
    """The inference engine and model variant to compare against.

    ``hadamard`` and ``rope_interleaved`` are properties of the model (Megatron's
    ``dsa_indexer_rotate_activation`` / ``dsa_indexer_rope_interleaved``) and apply to both sides.
    ``amax_floor`` and ``head_weights`` describe the engine only; the training side keeps the
    package's FP8 contract (floor 1e-4, FP32 head weights in vLLM's order).
    """

    hadamard: bool = False
    rope_interleaved: bool = False
    amax_floor: float = DEFAULT_AMAX_FLOOR
    head_weights: HeadWeights = "fp32"


@dataclasses.dataclass(frozen=True)
class Side:
    """How one side (inference, or a training configuration) selects its keys."""

    rope_fp32: bool
    scoring_precision: str
    head_weights: HeadWeights
    amax_floor: float = DEFAULT_AMAX_FLOOR


def inference_side(variant: EngineVariant) -> Side:
    """The inference engine: FP32 preprocessing, FP8 scoring, the variant's weights and floor."""
    return Side(True, "fp8", variant.head_weights, variant.amax_floor)


def training_side(config: IndexerPrecisionConfig) -> Side:
    """What the Megatron integration does for ``config``: BF16 scoring keeps Megatron's BF16
    head weights; FP8 scoring computes them in FP32 in vLLM's order."""
    weights: HeadWeights = "fp32" if config.fp8 else "bf16"
    return Side(config.rope_fp32, config.scoring_precision.value, weights)


def head_weights(w_proj: torch.Tensor, head_dim: int, mode: HeadWeights) -> torch.Tensor:
    """Per-head scoring weights from the raw ``linear_weights_proj`` output.

    Args:
        w_proj: ``[..., H]`` bfloat16 projection output.
        head_dim: indexer head width ``D`` (``softmax_scale = D**-0.5``).
        mode: ``"fp32"``: ``(fp32(w) * D**-0.5) * H**-0.5`` in float32 (vLLM's order; with the
            power-of-two q descale folded in by FP8 scoring this is vLLM's
            ``w * q_scale * softmax_scale * n_head**-0.5`` bit for bit).
            ``"fp32-premultiplied"``: ``fp32(w) * fp32(D**-0.5 * H**-0.5)``, one product with
            the constants multiplied first (in Python floats; ``2**-6`` for ``H=32, D=128``).
            ``"bf16"``: ``(w * H**-0.5) * D**-0.5`` rounded to bfloat16 after each product,
            exactly Megatron's ``forward_before_topk``.

    Returns:
        ``w_proj``'s shape; float32, or bfloat16 for ``"bf16"``.
    """
    n_heads = w_proj.shape[-1]
    if mode in ("fp32", "bf16"):  # the integration's two orders (preprocess.indexer_head_weights)
        w = w_proj if mode == "fp32" else w_proj.to(torch.bfloat16)
        return indexer_head_weights(w, n_heads=n_heads, head_dim=head_dim, fp32=mode == "fp32")
    if mode == "fp32-premultiplied":
        return w_proj.float() * (head_dim**-0.5 * n_heads**-0.5)
    raise ValueError(f"head weights mode {mode!r} is not one of {get_args(HeadWeights)}.")


def select(
    inputs: SyntheticIndexerInputs,
    side: Side,
    variant: EngineVariant,
    *,
    topk: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Preprocess, score and select for one side.

    Returns:
        ``(scores, indices)``: float32 ``[S, S]`` (``-inf`` above the causal diagonal) and int32
        ``[S, topk]`` (ascending, ``-1`` padded).
    """
    preprocess = IndexerPreprocess(
        inputs.head_dim,
        inputs.rope_dim,
        k_norm=inputs.k_norm,
        rope_interleaved=variant.rope_interleaved,
        rotate_activation=variant.hadamard,
        rope_fp32=side.rope_fp32,
    )
    with torch.no_grad():
        q, k = preprocess(inputs.q, inputs.k, inputs.freqs)  # [S, 1, H, D], [S, 1, D]
        w = head_weights(inputs.w, inputs.head_dim, side.head_weights)  # [S, 1, H]
        scores = indexer_scores(
            q.transpose(0, 1),
            k.transpose(0, 1),
            w.transpose(0, 1),
            scoring_precision=side.scoring_precision,
            sm_scale=1.0,  # the weights carry D**-0.5 * H**-0.5
            backend=backend,
            amax_floor=side.amax_floor,
        )[0]
        indices = indexer_topk(scores, topk, backend=backend)
    return scores, indices


def row_scale(reference: torch.Tensor) -> torch.Tensor:
    """``sigma_r``: float64 ``[rows]`` standard deviation of each row's finite entries of
    ``reference`` ``[rows, S_k]`` (``-inf`` = masked); NaN where a row is constant."""
    finite = torch.isfinite(reference)
    ref = torch.where(finite, reference.double(), 0.0)
    n = finite.sum(-1)
    centered = torch.where(finite, ref - (ref.sum(-1) / n)[:, None], 0.0)
    sigma = ((centered**2).sum(-1) / n).sqrt()
    return torch.where(sigma > 0, sigma, torch.nan)


def boundary_margin(scores: torch.Tensor, scale: torch.Tensor, topk: int) -> float:
    """``median_r (y_(k) - y_(k+1)) / sigma_r``, with ``y_(j)`` the ``j``-th largest score of row
    ``r`` of ``scores`` ``[rows, S_k]`` (more than ``topk`` finite entries per row) and ``scale``
    from :func:`row_scale`."""
    top = scores.topk(topk + 1, dim=-1).values.double()
    return float(((top[:, topk - 1] - top[:, topk]) / scale).nanmedian())


def score_error(scores: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    """``median_r max_t |scores[r, t] - reference[r, t]| / sigma_r`` over the finite entries
    (both ``[rows, S_k]`` with the same ``-inf`` pattern)."""
    finite = torch.isfinite(reference)
    diff = torch.where(finite, scores.double() - reference.double(), 0.0).abs().amax(-1)
    return float((diff / scale).nanmedian())


@dataclasses.dataclass(frozen=True)
class ConfigResult:
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
class DemoRun:
    """Everything the demo measured; ``as_json`` is what ``--json`` prints."""

    seq_len: int
    topk: int
    n_heads: int
    seed: int
    device: str
    backend: str
    variant: EngineVariant
    inference_margin: float
    inference_indices: torch.Tensor  # int32 [rows, topk], compared rows only
    configs: list[ConfigResult]
    seconds: float

    @property
    def first_row(self) -> int:
        """Query position of the first compared row (earlier rows keep every visible key)."""
        return self.topk

    def as_json(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "topk": self.topk,
            "n_heads": self.n_heads,
            "head_dim": HEAD_DIM,
            "rope_dim": ROPE_DIM,
            "seed": self.seed,
            "device": self.device,
            "backend": self.backend,
            "engine": dataclasses.asdict(self.variant),
            "first_row": self.first_row,
            "inference_boundary_margin": _finite_or_none(self.inference_margin),
            "configs": [c.as_json() for c in self.configs],
            "seconds": round(self.seconds, 3),
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_demo(
    *,
    seq_len: int,
    topk: int,
    n_heads: int = 32,
    seed: int = 0,
    device: str = "cpu",
    variant: EngineVariant | None = None,
) -> DemoRun:
    """Run the comparison; see the module docstring. Rows ``< topk`` (which select every visible
    key on both sides) are left out of every metric."""
    start = time.monotonic()
    variant = variant or EngineVariant()
    backend = BACKENDS[device]
    inputs = synthetic_indexer_inputs(
        seq_len, n_heads=n_heads, head_dim=HEAD_DIM, rope_dim=ROPE_DIM, seed=seed
    ).to(device)
    rows = slice(topk, None)

    def side_picks(side: Side) -> tuple[torch.Tensor, torch.Tensor]:
        scores, indices = select(inputs, side, variant, topk=topk, backend=backend)
        return scores[rows], indices[rows]

    sides = [inference_side(variant), *(training_side(c) for c in CONFIGS)]
    picks = [side_picks(side) for side in progress(sides, desc="demo")]
    (ref_scores, ref_indices), trained = picks[0], picks[1:]
    scale = row_scale(ref_scores)
    results = [
        ConfigResult(
            config,
            indices.cpu(),
            topk_agreement(indices, ref_indices).as_dict(),
            boundary_margin(scores, scale, topk),
            score_error(scores, ref_scores, scale),
        )
        for config, (scores, indices) in zip(CONFIGS, trained, strict=True)
    ]
    return DemoRun(
        seq_len=seq_len,
        topk=topk,
        n_heads=n_heads,
        seed=seed,
        device=device,
        backend=backend,
        variant=variant,
        inference_margin=boundary_margin(ref_scores, scale, topk),
        inference_indices=ref_indices.cpu(),
        configs=results,
        seconds=time.monotonic() - start,
    )


def _fmt(x: float) -> str:
    return "n/a" if not math.isfinite(x) else ("0" if x == 0 else f"{x:.3g}")


def format_run(run: DemoRun) -> str:
    """The human-readable report."""
    v = run.variant
    weights = {
        "fp32": "FP32 (vLLM order)",
        "fp32-premultiplied": "FP32 (premultiplied scale)",
        "bf16": "BF16 (Megatron order)",
    }[v.head_weights]
    rows = run.inference_indices.shape[0]
    header = [
        "DSA lightning indexer: training top-k vs inference top-k",
        f"  indexer {run.n_heads} heads x {HEAD_DIM}, rope {ROPE_DIM}; sequence {run.seq_len}, "
        f"top-{run.topk}; seed {run.seed}; {run.device}, {run.backend} backend",
        f"  inference: FP32 preprocessing, FP8 E4M3/UE8M0 scoring, {weights} head weights, "
        f"amax floor {v.amax_floor:g}",
        f"  model: Hadamard {'on' if v.hadamard else 'off'}, RoPE "
        f"{'interleaved' if v.rope_interleaved else 'rotate-half'}",
        f"  compared: {rows} query rows (positions {run.first_row}..{run.seq_len - 1}; earlier "
        "rows keep every visible key)",
        "",
    ]
    table_rows = [
        ["inference", "", "", "", "", _fmt(run.inference_margin), "0"],
        *(
            [c.name, *agreement_cells(c.agreement), _fmt(c.boundary_margin), _fmt(c.score_error)]
            for c in run.configs
        ),
    ]
    table = format_table(["config", *AGREEMENT_HEADERS, "margin", "score error"], table_rows)
    footer = [
        "",
        "margin: median over rows of (k-th - (k+1)-th largest score) / row score std;",
        "score error: median over rows of max |training - inference score| / row score std.",
        f"({run.seconds:.1f} s)",
    ]
    return "\n".join([*header, table, *footer])


def plot_run(run: DemoRun, path: Path) -> None:
    """Member agreement and identical-row share per query-position bin, one line per config."""
    from matplotlib.figure import Figure

    rows = run.inference_indices.shape[0]
    edges = torch.linspace(0, rows, min(PLOT_BINS, rows) + 1).round().long().tolist()
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
        f"training vs inference top-{run.topk}, sequence {run.seq_len}, {run.n_heads} heads "
        f"({run.device})"
    )
    top.legend(loc="lower left")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0.0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"{value} must be a positive finite number")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="measure training vs inference top-k agreement on structured synthetic inputs",
        description=(
            "Compute the inference engine's top-k (FP32 preprocessing, FP8 E4M3/UE8M0 scoring) "
            "and the training top-k under the four precision configurations (baseline, "
            "rope_fp32, fp8, rope_fp32+fp8) from the same BF16 projection outputs, and print "
            "their agreement. CPU: torch reference backend, sequence 2048, top-256. "
            "--device cuda: cuDNN kernels, sequence 8192, top-2048. See docs/numerics.md."
        ),
    )
    p.add_argument("--device", choices=tuple(BACKENDS), default="cpu", help="default: cpu")
    p.add_argument("--seq", type=_positive_int, help="sequence length (cpu 2048, cuda 8192)")
    p.add_argument("--topk", type=_positive_int, help="keys per query (cpu 256, cuda 2048)")
    p.add_argument(
        "--heads", type=int, choices=FP8_N_HEADS, default=32, help="indexer heads (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="input generator seed (default 0)")
    model = p.add_argument_group("model (applies to both sides)")
    model.add_argument(
        "--hadamard", action="store_true", help="Hadamard-rotate q and k (rotate_activation)"
    )
    model.add_argument(
        "--rope-interleaved", action="store_true", help="interleaved RoPE lanes (MLA style)"
    )
    engine = p.add_argument_group("inference engine variant (inference side only)")
    engine.add_argument(
        "--engine-amax-floor",
        type=_positive_float,
        default=DEFAULT_AMAX_FLOOR,
        metavar="F",
        help="UE8M0 amax floor of the engine (default 1e-4; some engines use 1e-10)",
    )
    engine.add_argument(
        "--engine-head-weights",
        choices=get_args(HeadWeights),
        default="fp32",
        help="engine head weights: fp32 scaled by D**-0.5 then H**-0.5 as vLLM (default), fp32 "
        "times the premultiplied constant D**-0.5 * H**-0.5, or bf16 as Megatron computes them",
    )
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="plot agreement vs position")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    default_seq, default_topk = DEFAULT_SIZES[args.device]
    seq_len = args.seq or default_seq
    topk = args.topk or min(default_topk, max(1, seq_len // 4))
    if topk >= seq_len:
        raise CliError(f"--topk {topk} must be below the sequence length {seq_len}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: CUDA is not available in this process")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'dsa-precision[plot]'") from None
        if not args.plot.parent.is_dir():
            raise CliError(f"--plot {args.plot}: directory {args.plot.parent} does not exist")
    variant = EngineVariant(
        hadamard=args.hadamard,
        rope_interleaved=args.rope_interleaved,
        amax_floor=args.engine_amax_floor,
        head_weights=args.engine_head_weights,
    )
    try:
        run = run_demo(
            seq_len=seq_len,
            topk=topk,
            n_heads=args.heads,
            seed=args.seed,
            device=args.device,
            variant=variant,
        )
    except (RuntimeError, ImportError) as exc:  # e.g. cuDNN unusable, out of memory
        raise CliError(" ".join(str(exc).split())) from None
    if args.plot is not None:
        try:
            plot_run(run, args.plot)
        except OSError as exc:
            raise CliError(f"--plot {args.plot}: {exc.strerror or exc}") from None
    if args.json:
        json.dump(run.as_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_run(run))
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0
