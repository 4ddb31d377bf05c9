"""The tables of a ``bench`` report (:func:`format_tables`): the package beside the raw kernels
it wraps, as ratios, then end to end, long context, the FP8 time split and packed sequences."""

from __future__ import annotations

import math
from typing import Any

from .bench_config import _FUSED_THRESHOLD, _HEAD_DIM, _MEGATRON_BACKENDS

__all__ = ["format_tables"]


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _kernel_lines(full: list[dict[str, Any]]) -> list[str]:
    lines = [
        "kernels vs package (same operands; x = package / raw)",
        f"{'S':>6} {'H':>3} | {'bf16 raw':>8} {'pkg':>7} {'x':>5} | {'fp8 raw':>8} {'pkg':>7} "
        f"{'x':>5} | {'dg raw':>7} {'clean':>7} {'pkg':>7} {'x':>5} {'win':>7} {'x':>5} "
        f"{'dg/cu':>5} | {'top-k raw':>9} {'+val':>6} {'pkg':>7} {'x':>5} {'x val':>5}",
    ]
    for r in full:
        t, o = r["times_ms"], r["overhead"]
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t['raw_score_bf16']):>8} "
            f"{_fmt(t['score_bf16']):>7} {o['score_bf16']:>5.2f} | {_fmt(t['raw_score_fp8']):>8} "
            f"{_fmt(t['score_fp8']):>7} {o['score_fp8']:>5.2f} | "
            f"{_fmt(t.get('raw_score_dg')):>7} {_fmt(t.get('raw_score_dg_clean')):>7} "
            f"{_fmt(t.get('score_fp8_deepgemm')):>7} {_fmt(o.get('score_dg'), '.2f'):>5} "
            f"{_fmt(t.get('score_fp8_deepgemm_window')):>7} "
            f"{_fmt(o.get('score_dg_window'), '.2f'):>5} "
            f"{_fmt(o.get('dg_vs_cudnn'), '.2f'):>5} | {_fmt(t['raw_topk']):>9} "
            f"{_fmt(t.get('raw_topk_val')):>6} {_fmt(t['topk']):>7} {o['topk']:>5.2f} "
            f"{_fmt(o.get('topk_vs_val'), '.2f'):>5}"
        )
    lines += [
        "times: device time of each call (its launches queued behind a ~1 ms device sleep: the "
        "host's time before them not counted; host us below)",
        "dg raw: DeepGEMM's compressed uncleaned logits (what the select path reads); clean: "
        "its full cleaned scores (what indexer_scores returns at B=1), the raw of dg x; win: "
        "indexer_scores(clean=False), the scores up to each row's limit with the limits, over "
        "dg raw; dg/cu: dg raw / fp8 raw",
        "top-k raw: indices only (return_val=False); +val: with each pick's score, the "
        "wrapper's default and what the package's -inf/NaN guarantee reads; x / x val: package "
        "over each",
    ]
    return lines


def _host_lines(full: list[dict[str, Any]]) -> list[str]:
    lines = [
        "host us per call until it returns, the device idle before each (median; x = package / "
        "raw)",
        f"{'S':>6} {'H':>3} | {'fp8 raw':>8} {'pkg':>7} {'x':>5} | {'top-k +val':>10} "
        f"{'pkg':>7} {'x':>5} | {'select fp8':>10} | {'dg raw':>7} {'select dg':>9}",
    ]
    for r in full:
        h = r.get("host_us")
        if h is None:
            continue
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {h['raw_score_fp8']:>8.1f} {h['score_fp8']:>7.1f} "
            f"{h['score_fp8'] / h['raw_score_fp8']:>5.2f} | {h['raw_topk_val']:>10.1f} "
            f"{h['topk']:>7.1f} {h['topk'] / h['raw_topk_val']:>5.2f} | "
            f"{h['select_fp8']:>10.1f} | {_fmt(h.get('raw_score_dg'), '.1f'):>7} "
            f"{_fmt(h.get('select_fp8_dg'), '.1f'):>9}"
        )
    lines.append(
        "select: indexer_select from prepared operands (scoring, key counts, top-k, the "
        "-inf/NaN pass)"
    )
    return lines


def _default_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What a user gets without choosing: the backend ``"auto"`` takes, and its FP8 time."""
    lines = [
        "the default path (backend='auto'): end to end from the projections, FP8",
        f"{'S':>6} {'H':>3} | {'backend':>8} {'e2e fp8':>8} {'x bf16':>6} | {'other':>8} {'e2e':>8}",
    ]
    for r in rows:
        t, name = r["times_ms"], r.get("default_backend", "cudnn")
        mine, other = ("e2e_fp8_dg", "e2e_fp8") if name == "deepgemm" else ("e2e_fp8", "e2e_fp8_dg")
        other_name = "cudnn" if name == "deepgemm" else "deepgemm"
        ratio = t["e2e_bf16"] / t[mine] if t.get(mine) else None
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {name:>8} {_fmt(t.get(mine)):>8} "
            f"{_fmt(ratio, '.2f'):>6} | {other_name if t.get(other) else '-':>8} "
            f"{_fmt(t.get(other)):>8}"
        )
    return lines


def _e2e_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "end to end from the projections (prep + indexer_select; x = BF16 / FP8)",
        f"{'S':>6} {'H':>3} | {'prep bf16':>9} {'prep fp8':>8} | {'e2e bf16':>8} {'e2e fp8':>8} "
        f"{'x':>5} | {'raw bound x':>11} {'of bound':>8} {'/raw':>5} | {'dg fp8':>8} {'x':>5} "
        f"{'bound':>5} {'of b.':>5} {'/raw':>5} {'dg/cu':>5} | {'api x':>5} | "
        f"{'peak MiB bf16':>13} {'fp8':>6} {'dg':>6}",
    ]
    for r in rows:
        t, m, o = r["times_ms"], r["peak_extra_mib"], r.get("overhead", {})
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t['prep_bf16']):>9} {_fmt(t['prep_fp8']):>8} | "
            f"{_fmt(t['e2e_bf16']):>8} {_fmt(t['e2e_fp8']):>8} {r['e2e_ratio']:>5.2f} | "
            f"{_fmt(r.get('e2e_bound'), '.2f'):>11} {_pct(r.get('e2e_share_of_bound')):>8} "
            f"{_fmt(o.get('e2e_fp8'), '.2f'):>5} | {_fmt(t.get('e2e_fp8_dg')):>8} "
            f"{_fmt(r.get('e2e_ratio_dg'), '.2f'):>5} {_fmt(r.get('e2e_bound_dg'), '.2f'):>5} "
            f"{_pct(r.get('e2e_share_of_bound_dg')):>5} {_fmt(o.get('e2e_fp8_dg'), '.2f'):>5} "
            f"{_fmt(o.get('e2e_dg_vs_cudnn'), '.2f'):>5} | "
            f"{_fmt(r.get('api_ratio'), '.2f'):>5} | "
            f"{m['e2e_bf16']:>13.0f} {m['e2e_fp8']:>6.0f} {_fmt(m.get('e2e_fp8_dg'), '.0f'):>6}"
        )
    lines += [
        "raw bound = (prep bf16 + raw bf16 scoring + raw top-k) / (prep fp8 + raw fp8 scoring + "
        "raw top-k); /raw = e2e fp8 / (prep fp8 + raw scoring + raw top-k +val); dg: "
        "backend='deepgemm' (bound with dg raw); api = indexer_topk(indexer_scores(carriers)), "
        "BF16 / FP8",
    ]
    return lines


def _long_lines(rows: list[dict[str, Any]], reps: int | None) -> list[str]:
    lines = [
        f"long context, median of {reps} reps: chunked indexer_select (x = BF16 / FP8; bound = "
        "(prep + raw chunked kernels) BF16 / FP8)",
        f"{'S':>6} {'H':>3} {'chunks':>6} | {'e2e bf16':>8} {'fp8':>8} {'dg':>8} | {'x fp8':>5} "
        f"{'x dg':>5} | {'bound fp8':>9} {'dg':>5} | {'of bound':>8} {'dg':>5} | "
        f"{'sel/raw bf16':>12} {'fp8':>5} {'dg':>5} | {'peak MiB sel bf16':>17} {'fp8':>6} "
        f"{'dg':>6} | {'e2e bf16':>8} {'fp8':>6} {'dg':>6} | {'chunk MiB':>9}",
    ]
    for r in rows:
        t, m = r["times_ms"], r["peak_extra_mib"]
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} {r['chunks']:>6} | {_fmt(t['e2e_bf16'], '.2f'):>8} "
            f"{_fmt(t['e2e_fp8'], '.2f'):>8} {_fmt(t.get('e2e_fp8_dg'), '.2f'):>8} | "
            f"{_fmt(r.get('ratio_fp8'), '.2f'):>5} {_fmt(r.get('ratio_fp8_dg'), '.2f'):>5} | "
            f"{_fmt(r.get('bound_fp8'), '.2f'):>9} {_fmt(r.get('bound_fp8_dg'), '.2f'):>5} | "
            f"{_pct(r.get('of_bound_fp8')):>8} {_pct(r.get('of_bound_fp8_dg')):>5} | "
            f"{_fmt(r.get('select_vs_raw_bf16'), '.2f'):>12} "
            f"{_fmt(r.get('select_vs_raw_fp8'), '.2f'):>5} "
            f"{_fmt(r.get('select_vs_raw_fp8_dg'), '.2f'):>5} | "
            f"{m['select_bf16']:>17.0f} {m['select_fp8']:>6.0f} "
            f"{_fmt(m.get('select_fp8_dg'), '.0f'):>6} | {m['e2e_bf16']:>8.0f} "
            f"{m['e2e_fp8']:>6.0f} {_fmt(m.get('e2e_fp8_dg'), '.0f'):>6} | "
            f"{r['chunk_budget_mib']:>9.0f}"
        )
    lines += [
        "sel/raw: indexer_select from prepared operands / the raw chunked kernels (scoring + "
        "top-k +val per chunk); peak MiB: allocator peak beyond inputs and output, select alone "
        "and end to end; chunk MiB: rows per chunk x S x 12 bytes (scores + top-k scratch)",
    ]
    return lines


def _split_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "time split of FP8 selection (raw chunked kernels; traffic = scores written once + read "
        "once at the measured bandwidth)",
        f"{'S':>6} {'H':>3} {'backend':>8} | {'prep':>6} {'score':>8} {'top-k':>8} {'e2e':>8} "
        f"{'pkg adds':>8} | {'written GiB':>11} {'read':>6} {'traffic':>8} {'share':>6} "
        f"{'top-k reads':>11} | {'fused x traffic':>15} {'max':>5} | build fused",
    ]
    for r in rows:
        for backend in ("cudnn", "deepgemm"):
            x = r.get(backend)
            if x is None:
                continue
            lines.append(
                f"{r['seq']:>6} {r['heads']:>3} {backend:>8} | {r['prep_fp8_ms']:>6.3f} "
                f"{x['score_ms']:>8.3f} {x['topk_ms']:>8.3f} {x['e2e_ms']:>8.3f} "
                f"{x['package_ms']:>8.3f} | {x['written_gib']:>11.2f} {x['read_gib']:>6.2f} "
                f"{x['traffic_ms']:>8.3f} {_pct(x['traffic_share']):>6} "
                f"{x['topk_reads']:>11.1f} | {x['fused_speedup_traffic']:>15.2f} "
                f"{x['fused_speedup_max']:>5.2f} | "
                f"{'yes' if x['build_fused'] else 'no'}"
            )
    if rows:
        bw = rows[0]["bandwidth_gbs"]
        lines.append(
            f"bandwidth: write {bw['write']:.0f} GB/s, read {bw['read']:.0f} GB/s (1 GiB fill / "
            f"sum); build fused: traffic > {100 * _FUSED_THRESHOLD:.0f} % of e2e; fused x: e2e / "
            "(e2e - traffic), max: e2e / (prep + score - its writes)"
        )
    return lines


def _thd_select_lines(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[str]:
    """Packed THD: the default backend's selection first, then each backend beside its raw
    chunked kernels."""
    lines = [
        "packed THD, FP8: indexer_select_varlen from prepared operands, the default path "
        "(backend='auto') first (x = package / raw chunked kernels)",
        f"{'T':>6} {'H':>3} {'max len':>7} {'chunks':>6} | {'default':>8} {'select':>8} | "
        f"{'dg raw':>8} {'pkg':>8} {'x':>5} | {'cu raw':>8} {'pkg':>8} {'x':>5} | "
        f"{'picks = raw':>11}",
    ]
    for r in rows:
        t, o = r["times_ms"], r["overhead"]
        name = r["default_backend"]
        mine = t.get("select_dg" if name == "deepgemm" else f"select_{name}")
        eq = r.get("picks_equal_raw", {})
        picks = "/".join(("yes" if eq[b] else "NO") for b in ("deepgemm", "cudnn") if b in eq)
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} {max(r['lens']):>7} {r['chunks']:>6} | {name:>8} "
            f"{_fmt(mine):>8} | {_fmt(t.get('raw_select_dg')):>8} {_fmt(t.get('select_dg')):>8} "
            f"{_fmt(o.get('select_dg'), '.2f'):>5} | {_fmt(t.get('raw_select_cudnn')):>8} "
            f"{_fmt(t.get('select_cudnn')):>8} {_fmt(o.get('select_cudnn'), '.2f'):>5} | "
            f"{picks or '-':>11}"
        )
    sizes = "; ".join(
        f"T={r['seq']}: {', '.join(map(str, r['lens']))}"
        for r in {r["seq"]: r for r in rows}.values()
    )
    lines += [
        f"sequence lengths {sizes} (causal from 0, keys = queries); T >= "
        f"{cfg.get('chunked_from')}: selection only, median of {cfg.get('long_reps')} reps",
        "raw: per chunk DeepGEMM's compressed logits (per-row ks / ke built once on the host) or "
        "cuDNN's THD scores, then indexer_top_k_wrapper(return_val=True); picks = raw: the "
        "package's picks equal the raw kernels' (deepgemm/cudnn)",
    ]
    return lines


def _thd_score_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "packed THD, FP8: indexer_scores_varlen beside the raw kernels (same operands; x = "
        "package / raw)",
        f"{'T':>6} {'H':>3} | {'dg raw':>7} {'clean':>7} {'pkg':>7} {'x':>5} {'x cl':>5} "
        f"{'win':>7} {'x':>5} | {'cu raw':>7} {'pkg':>7} {'x':>5} | {'host us dg raw':>14} "
        f"{'pkg':>6} {'win':>6} {'cu raw':>6} {'pkg':>6}",
    ]
    for r in rows:
        t, o, h = r["times_ms"], r["overhead"], r.get("host_us", {})
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | {_fmt(t.get('raw_score_dg')):>7} "
            f"{_fmt(t.get('raw_score_dg_clean')):>7} {_fmt(t.get('score_dg')):>7} "
            f"{_fmt(o.get('score_dg'), '.2f'):>5} {_fmt(o.get('score_dg_clean'), '.2f'):>5} "
            f"{_fmt(t.get('score_dg_window')):>7} {_fmt(o.get('score_dg_window'), '.2f'):>5} | "
            f"{_fmt(t.get('raw_score_cudnn')):>7} {_fmt(t.get('score_cudnn')):>7} "
            f"{_fmt(o.get('score_cudnn'), '.2f'):>5} | {_fmt(h.get('raw_score_dg'), '.1f'):>14} "
            f"{_fmt(h.get('score_dg'), '.1f'):>6} {_fmt(h.get('score_dg_window'), '.1f'):>6} "
            f"{_fmt(h.get('raw_score_cudnn'), '.1f'):>6} {_fmt(h.get('score_cudnn'), '.1f'):>6}"
        )
    lines.append(
        "dg raw: fp8_fp4_mqa_logits(q, (k, k_scales), w, ks, ke, clean_logits=False, "
        "max_seqlen_k=max len), the compressed uncleaned logits; clean: the same with "
        "clean_logits=True, max_seqlen_k=0, (T, T) with -inf outside the windows; pkg: "
        "(T, max len), -inf past each row's window; win: indexer_scores_varlen(clean=False), "
        "the same scores left uncleaned with each row's length (x: over dg raw); cu raw: "
        "indexer_forward_wrapper with "
        "cu_seqlens_q/k, max_seqlen_q/k; host us: until the call returns, the device idle"
    )
    return lines


def _megatron_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The ``--megatron`` table: Megatron's indexer per backend beside the package's FP8."""
    lines = [
        "Megatron's indexer top-k per dsa_kernel_backend beside the package's FP8 top-k (same "
        "projections; e2e = preprocessing + top-k)",
        f"{'S':>6} {'H':>3} | " + " | ".join(f"{b:>8} {'e2e':>7} {'agree':>6} {'x fp8':>5}"
                                            for b in _MEGATRON_BACKENDS)
        + f" | {'fp8 sel':>7} {'e2e':>7} | {'dg sel':>7} {'e2e':>7}",
    ]  # fmt: skip
    notes: dict[str, str] = {}
    for r in rows:
        t, cells = r["times_ms"], []
        for b in _MEGATRON_BACKENDS:
            row = r["megatron"][b]
            if "skipped" in row:
                notes[b] = row["skipped"]
                cells.append(f"{'skipped':>8} {'-':>7} {'-':>6} {'-':>5}")
            else:
                cells.append(
                    f"{_fmt(row['ms']):>8} {_fmt(row['e2e_ms']):>7} "
                    f"{100 * row['member_agreement']:>5.1f}% {row['vs_fp8']:>5.2f}"
                )
        lines.append(
            f"{r['seq']:>6} {r['heads']:>3} | " + " | ".join(cells)
            + f" | {_fmt(t['select_fp8']):>7} {_fmt(t['e2e_fp8']):>7} | "
            f"{_fmt(t.get('select_fp8_dg')):>7} {_fmt(t.get('e2e_fp8_dg')):>7}"
        )  # fmt: skip
    lines.append(
        "agree: members shared with the package's BF16 picks of the same operands; x fp8: "
        "Megatron e2e / the package's fastest FP8 e2e"
    )
    lines += [f"skipped {b}: {why}" for b, why in notes.items()]
    return lines


def format_tables(report: dict[str, Any]) -> str:
    """The human-readable tables of a :func:`_run_bench` report (times in ms)."""
    cfg = report["config"]
    rows = report.get("results", [])
    full = [r for r in rows if not r["chunked"]]
    lines = [
        f"{report['device']}: B={cfg['batch']} D={_HEAD_DIM} causal, top-k {cfg['topk']}, "
        f"FP8 side rope_fp32={cfg['rope_fp32']}, hadamard={cfg['hadamard']}; median of "
        f"{cfg['reps']} reps (ms)",
    ]
    if rows:
        lines += ["", *_default_lines(rows)]
    if full:
        lines += ["", *_kernel_lines(full)]
        if any("host_us" in r for r in full):
            lines += ["", *_host_lines(full)]
    if rows:
        lines += ["", *_e2e_lines(rows)]
    if report.get("long"):
        lines += ["", *_long_lines(report["long"], cfg.get("long_reps"))]
    if report.get("split"):
        lines += ["", *_split_lines(report["split"])]
    if report.get("thd"):
        lines += ["", *_thd_select_lines(report["thd"], cfg)]
        scored = [r for r in report["thd"] if not r["chunked"]]
        if scored:
            lines += ["", *_thd_score_lines(scored)]
    if report.get("megatron"):
        lines += ["", *_megatron_lines(report["megatron"])]
    return "\n".join(lines)
