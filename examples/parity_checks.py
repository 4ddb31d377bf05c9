"""Parallel parity: the verdicts of a parallel run's top-k against a single-process reference.

What ``examples/parallel_parity.py`` (and ``tests/examples/test_parallel_parity.py``) compare, as plain
functions of what every rank recorded (``parallel_runs``): per layer, each rank's picks in the
engines' layout (``tokens``: each query row's global token, ``picks``: its sequence-relative keys)
and its indexer operands with each row's global position (``positions``, ``ops``: the FP8 bytes
and descales, or the BF16 ``q``, ``k`` and ``weights``; CPU tensors).

- :func:`assemble_picks` / :func:`assemble_ops`: the ranks' parts in global order, and whether
  ranks holding the same rows (TP) hold the same picks / bytes;
- :func:`compare_layer`: ``rows_identical`` / ``member_agreement`` against the reference's picks,
  ``split_identical`` (the parallel picks against a single-process selection of the parallel
  run's own operands: the package's claim, the picks of a row do not depend on how rows are
  split over ranks, given the same operands), ``operands_identical`` and ``score_rel``;
- :func:`checks`: the verdicts -- ``split`` 100 % everywhere, FP8 picks identical wherever the
  operands are bit-identical, FP8 scoring calls on every rank, finite losses, references
  reproduced. Whether operands are bit-identical is Megatron's (and the BLAS library's) business
  upstream of the indexer; no verdict requires it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_CONFIGS",
    "assemble_ops",
    "assemble_picks",
    "bits_equal",
    "checks",
    "compare_layer",
    "rel",
    "same_rows",
    "score_rel",
    "scores_and_picks",
]

FP8_CONFIGS = ("fp8", "rope_fp32+fp8")


def assemble_picks(parts: list[dict]) -> tuple[torch.Tensor, bool]:
    """The ranks' picks in global token order (every token once), and whether ranks holding the
    same rows (TP ranks, when the attention's query rows are not sequence-local) picked alike."""
    tokens = torch.cat([p["tokens"] for p in parts])
    picks = torch.cat([p["picks"] for p in parts])
    total = int(tokens.max()) + 1
    out = torch.full((total, picks.shape[-1]), -2, dtype=picks.dtype)
    agree = True
    for p in parts:
        held = out[p["tokens"]]
        seen = held[:, 0] != -2
        if bool(seen.any()):
            agree &= same_rows(held[seen], p["picks"][seen]) == 1.0
        out[p["tokens"]] = p["picks"]
    if bool((out[:, 0] == -2).any()):
        raise RuntimeError("the ranks' captured rows do not cover every token")
    return out, agree


def assemble_ops(parts: list[dict], batch: int, total: int) -> tuple[dict, bool]:
    """The ranks' indexer operands in global row order, and whether ranks holding the same rows
    (TP) hold the same bytes."""
    first = parts[0]["ops"]
    out = {}
    agree = True
    for f, t in first.items():
        if not isinstance(t, torch.Tensor):
            out[f] = t
            continue
        g = torch.zeros((batch, total, *t.shape[2:]), dtype=t.dtype)
        seen = torch.zeros(total, dtype=torch.bool)
        for p in parts:
            pos, v = p["positions"], p["ops"][f]
            dup = seen[pos]
            if bool(dup.any()):
                agree &= torch.equal(g[:, pos[dup]], v[:, dup])
            g[:, pos] = v
            seen[pos] = True
        if not bool(seen.all()):
            raise RuntimeError(f"operand {f}: the ranks' rows do not cover the micro-batch")
        out[f] = g
    return out, agree


def to_operands(d: dict, device: str):
    from dsa_precision import ScoringOperands

    def t(f):
        v = d.get(f)
        if v is None:
            return None
        v = v.to(device)
        return v.view(torch.float8_e4m3fn) if d["fp8"] and f in ("q", "k") else v

    if d.get("stock"):
        return None
    return ScoringOperands(
        t("q"), t("k"), t("weights"), t("q_descale"), t("k_descale"), sm_scale=d["sm_scale"]
    )


def bits_equal(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[f], b[f]) for f in a if isinstance(a[f], torch.Tensor) and f in b
    ) and {f for f in a if isinstance(a[f], torch.Tensor)} == {
        f for f in b if isinstance(b[f], torch.Tensor)
    }


def scores_and_picks(d: dict, cu: torch.Tensor | None, topk: int, device: str):
    """Single-process scores (float32, ``-inf`` off the causal pairs) and picks (sequence-relative
    keys, one row per global token) of global operands: the package's functions, or for ``stock``
    Megatron's own ``fused_qk_topk_naive``."""
    from dsa_precision import (
        indexer_scores,
        indexer_scores_varlen,
        indexer_select,
        indexer_select_varlen,
    )

    if d.get("stock"):
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            fused_qk_topk_naive,
        )

        q, k, w = (d[f].to(device).transpose(0, 1) for f in ("q", "k", "weights"))
        total = q.shape[0]
        rows = torch.arange(total, device=device)
        if cu is None:
            starts = torch.zeros_like(rows)
        else:
            cud = cu.to(device)
            starts = cud[torch.searchsorted(cud[1:], rows, right=True)]
        scores, picks = fused_qk_topk_naive(
            q, k, w, topk, varlen_starts=starts, varlen_ends=rows + 1, use_relu=True
        )
        picks = torch.where(picks >= 0, picks - starts[None, :, None], -1)
        picks = torch.nn.functional.pad(picks, (0, topk - picks.shape[-1]), value=-1)
        if cu is not None:
            scores = scores[0]
        return scores, picks.reshape(-1, topk).to(torch.int32)
    ops = to_operands(d, device)
    if cu is None:
        scores = indexer_scores(ops)
        picks = indexer_select(ops, topk=topk)
        return scores, picks.reshape(-1, topk)
    cud = cu.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    kw = dict(cu_seqlens_q=cud, cu_seqlens_k=cud, max_seqlen_q=longest, max_seqlen_k=longest)
    return indexer_scores_varlen(ops, **kw), indexer_select_varlen(ops, topk=topk, **kw)


def score_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite entries of ``b`` (``a`` finite at the same places)."""
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    diff = (a.double() - b.double())[finite].abs().max()
    return float(diff / b.double()[finite].abs().max().clamp_min(1e-30))


def same_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of rows with the same set of keys (order and ``-1`` padding ignored)."""
    from dsa_precision import topk_agreement

    return float(topk_agreement(a.long(), b.long()).rows_identical)


def compare_layer(
    layer_ref: dict,
    parts: list[dict],
    cu: torch.Tensor | None,
    *,
    batch: int,
    seq: int,
    topk: int,
    device: str,
) -> dict:
    """One layer of one (layout, config) run (``parts``: every rank's capture) against the
    reference's (``layer_ref``); ``cu``: the packed micro-batch's cumulative lengths (THD), else
    ``batch`` sequences of ``seq`` tokens."""
    from dsa_precision import topk_agreement

    total = cu[-1].item() if cu is not None else seq
    ops, tp_agree = assemble_ops(parts, batch, int(total))
    ref_scores, ref_sel = scores_and_picks(layer_ref["ops"], cu, topk, device)
    ref_scores = ref_scores.clone()  # a kernel's output buffer: keep it from the next call
    scores, sel = scores_and_picks(ops, cu, topk, device)
    stock = bool(ops.get("stock"))
    if stock:  # Megatron's own selection of the gathered operands, vs the reference's
        picks, ref_picks = sel, ref_sel
        split = float("nan")
    else:
        picks, picks_agree = assemble_picks(parts)
        tp_agree &= picks_agree
        ref_picks, _ = assemble_picks([layer_ref])
        picks, ref_picks = picks.to(device), ref_picks.to(device)
        split = same_rows(picks, sel)
    agreement = topk_agreement(picks.long(), ref_picks.long()).as_dict()
    return dict(
        rows_identical=agreement["rows_identical"],
        member_agreement=agreement["member_agreement"],
        rows=agreement["rows"],
        split_identical=split,
        operands_identical=bits_equal(ops, layer_ref["ops"]),
        tp_ranks_agree=tp_agree,
        score_rel=score_rel(scores, ref_scores),
    )


def rel(a: float, b: float) -> float:
    """``|a - b| / |b|``."""
    return abs(a - b) / max(abs(b), 1e-30)


def checks(rows: list[dict]) -> dict:
    """The verdicts over every row of a run (see the module docstring): ``{name: bool}`` and
    ``ok``, all of them."""
    out = dict(
        split_everywhere=True,
        fp8_identical_where_operands_identical=True,
        fp8_calls_every_rank=True,
        finite=True,
        references_reproduced=True,
    )
    for r in rows:
        out["finite"] &= r["finite"]
        out["references_reproduced"] &= r.get("ranks_reproduce", True)
        if r["config"] in FP8_CONFIGS:
            out["fp8_calls_every_rank"] &= all(
                c["fp8"] > 0 and c["bf16"] == 0 for c in r["calls_per_rank"]
            )
        for layer in r.get("layers", {}).values():
            if r["config"] != "stock":
                out["split_everywhere"] &= layer["split_identical"] == 1.0
            if r["config"] in FP8_CONFIGS and layer["operands_identical"]:
                out["fp8_identical_where_operands_identical"] &= layer["rows_identical"] == 1.0
    out["ok"] = all(out.values())
    return out
