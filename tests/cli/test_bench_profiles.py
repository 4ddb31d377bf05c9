"""``python -m dsa_precision bench``'s measurement code on the CPU, on the fakes of cuDNN and
DeepGEMM (tests/support/fake_cudnn.py, tests/support/fake_deepgemm.py) with a timer that only counts calls: every
profile (default, ``--long``, ``--split``) runs end to end, times the raw kernels it claims to (one
raw scoring launch per chunk), and prints its table. Timings themselves need the H200."""

import argparse

import pytest
import torch

from dsa_precision.cli import bench

from ..support import fake_cudnn
from ..support.fake_deepgemm import FakeMqaLogits, install


class _CountingTimer:
    """Calls each function once; every call 'takes' 1 ms."""

    def __init__(self, reps, warmup):
        self.calls = 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return 1.0

    def host_us(self, fn):
        fn()
        return 10.0


@pytest.fixture
def cpu_bench(monkeypatch):
    dsa = fake_cudnn.install(monkeypatch)
    dg = FakeMqaLogits(mode="operands")
    install(monkeypatch, dg)
    monkeypatch.setattr(bench, "_DEVICE", "cpu")
    monkeypatch.setattr(bench, "Timer", _CountingTimer)
    monkeypatch.setattr(bench, "_BANDWIDTH_BYTES", 1 << 12)
    monkeypatch.setattr(bench, "_peak_extra_mib", lambda fn: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "_check_environment", lambda cfg: None)
    monkeypatch.setattr(bench, "_verify", lambda work: {"operands_bit_identical": True})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    prep = bench._Workload.prep
    monkeypatch.setattr(bench._Workload, "prep", lambda self, fp8, impl="auto": prep(self, fp8))
    return dsa, dg


def _cfg(**kw):
    base = dict(seqs=(), heads=(32,), topk=16, reps=1, warmup=0, chunked_from=10**9)
    return bench._BenchConfig(**(base | kw))


def test_default_profile_times_both_backends_beside_their_kernels(cpu_bench):
    _, dg = cpu_bench
    report = bench._run_bench(_cfg(seqs=(256,)))
    (r,) = report["results"]
    t = r["times_ms"]
    for key in ("raw_score_dg", "raw_score_dg_clean", "score_fp8_deepgemm",
                "score_fp8_deepgemm_window", "e2e_fp8_dg", "raw_topk", "raw_topk_val",
                "topk"):  # fmt: skip
        assert t[key] == 1.0, key
    assert r["overhead"]["score_dg"] == r["overhead"]["score_dg_window"] == 1.0
    assert r["e2e_bound_dg"] > 0
    assert set(r["host_us"]) == {"raw_score_fp8", "score_fp8", "raw_topk_val", "topk",
                                 "select_fp8", "raw_score_dg", "select_fp8_dg"}  # fmt: skip
    assert report["long"] == [] and report["split"] == []
    # the raw DeepGEMM calls: compressed uncleaned (the select's input) and cleaned full scores
    raw = [c for c in dg.calls if c["q"].shape[0] == 256]
    assert {(c["max_seqlen_k"], c["clean_logits"]) for c in raw} >= {(256, False), (0, True)}
    text = bench.format_tables(report)
    assert "dg raw" in text and "dg fp8" in text and "long context" not in text
    assert "host us per call" in text


def test_long_profile_times_the_chunked_kernels(cpu_bench):
    dsa, dg = cpu_bench
    chunk_bytes = 64 * 512 * 12  # 64-row chunks of S = 512
    report = bench._run_bench(_cfg(long_seqs=(512,), chunk_bytes=chunk_bytes))
    assert report["results"] == []
    (r,) = report["long"]
    assert r["chunks"] == 8 and r["chunk_rows"] == 64
    for key in ("raw_bf16", "raw_fp8", "raw_fp8_dg", "select_fp8_dg", "e2e_fp8_dg"):
        assert r["times_ms"][key] == 1.0, key
    assert set(r["peak_extra_mib"]) == {
        f"{w}_{k}" for w in ("select", "e2e") for k in ("bf16", "fp8", "fp8_dg")
    }
    # Each raw or package select launches once per 64-row chunk, cuDNN and DeepGEMM.
    assert len(dg.calls) % 8 == 0 and all(c["q"].shape[0] == 64 for c in dg.calls)
    assert len(dsa.forward_calls) % 8 == 0
    assert all(c["q"].shape[1] == 64 for c in dsa.forward_calls)
    assert r["bound_fp8_dg"] == 1.0 and r["of_bound_fp8"] == 1.0
    assert "long context" in bench.format_tables(report)


def test_split_profile_reports_the_traffic_share_and_the_decision(cpu_bench):
    done = []
    cfg = _cfg(split_seqs=(256,), chunk_bytes=128 * 256 * 12)
    report = bench._run_bench(cfg, lambda r: done.append(sorted(k for k in r if r[k])))
    assert done == [["config", "device", "split", "versions"]]  # once, after the split profile
    (r,) = report["split"]
    assert r["chunks"] == 2
    for backend in ("cudnn", "deepgemm"):
        x = r[backend]
        assert x["score_ms"] == x["raw_select_ms"] == x["e2e_ms"] == 1.0
        assert x["read_gib"] == 256 * 257 // 2 * 4 / 2**30
        # Bandwidth 4 KiB per ms: the scores' traffic dwarfs the 1 ms e2e, so build it.
        assert x["traffic_share"] > bench._FUSED_THRESHOLD and x["build_fused"]
    assert r["cudnn"]["written_gib"] == 256 * 256 * 4 / 2**30  # -inf included
    assert r["deepgemm"]["written_gib"] == r["deepgemm"]["read_gib"]  # the windows only
    text = bench.format_tables(report)
    assert "time split" in text and "yes" in text


def _parse(*argv):
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_profiles_are_separate_flags(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "_run_bench", lambda cfg, on_profile: seen.append(cfg) or {})
    monkeypatch.setattr(bench, "format_tables", lambda report: "")
    runs = ((), ("--long",), ("--split", "--split-seq", "4096"), ("--long-seq", "32768"),
            ("--seq", "8192", "--long", "--split"), ("--thd",), ("--thd", "--long"),
            ("--thd-seq", "4096", "--thd-weights", "1", "2"),
            ("--seq", "8192", "--long", "--split", "--thd"))  # fmt: skip
    for argv in runs:
        bench._main(_parse(*argv))
    default, long, split, long_seq, everything, thd, thd_long, thd_seq, all_four = seen
    assert not default.thd_seqs and not everything.thd_seqs
    # --thd alone: only the packed profile, at 8192 and 16384 tokens, four uneven sequences.
    assert thd.seqs == () and not thd.long_seqs and thd.thd_seqs == (8192, 16384)
    assert thd.thd_weights == (4, 1, 3, 2)
    assert thd_long.long_seqs == bench._LONG_SEQS
    assert thd_long.thd_seqs == (8192, 16384, *bench._LONG_SEQS)  # the long sizes, select only
    assert thd_seq.seqs == () and thd_seq.thd_seqs == (4096,) and thd_seq.thd_weights == (1, 2)
    assert all_four.seqs == (8192,) and all_four.long_seqs and all_four.split_seqs
    assert all_four.thd_seqs == (8192, 16384, *bench._LONG_SEQS)
    assert default.seqs == (8192, 16384) and not default.long_seqs and not default.split_seqs
    assert long.seqs == () and long.long_seqs == bench._LONG_SEQS and long.long_reps == 5
    assert split.seqs == () and split.split_seqs == (4096,)
    assert long_seq.long_seqs == (32768,)
    assert everything.seqs == (8192,) and everything.long_seqs and everything.split_seqs


def test_thd_profile_times_both_backends_beside_their_raw_kernels(cpu_bench):
    dsa, dg = cpu_bench
    report = bench._run_bench(_cfg(thd_seqs=(300,), chunk_bytes=64 * 120 * 12))
    assert report["results"] == [] and report["long"] == []
    (r,) = report["thd"]
    assert r["lens"] == [120, 30, 90, 60] and r["chunks"] == 5  # 64-row chunks of max len 120
    assert r["default_backend"] == "deepgemm"  # DeepGEMM importable: 'auto' takes it for FP8
    assert r["check"] == {
        "scores_bit_identical": ["deepgemm clean", "deepgemm", "deepgemm clean=False", "cudnn"]
    }
    assert r["picks_equal_raw"] == {"cudnn": True, "deepgemm": True}
    for key in ("raw_score_dg", "raw_score_dg_clean", "score_dg", "score_dg_window",
                "raw_score_cudnn", "score_cudnn", "raw_select_dg", "select_dg", "raw_select_cudnn",
                "select_cudnn"):  # fmt: skip
        assert r["times_ms"][key] == 1.0, key
    assert set(r["overhead"]) == {"score_dg", "score_dg_clean", "score_dg_window", "score_cudnn",
                                  "select_dg", "select_cudnn"}  # fmt: skip
    assert set(r["host_us"]) == {"raw_score_dg", "score_dg", "score_dg_window", "raw_score_cudnn",
                                 "score_cudnn"}  # fmt: skip
    # The raw DeepGEMM calls: each row's window in the packed keys, as a DeepGEMM user builds
    # them: ks = its sequence's first key, ke = ks + its position + 1.
    starts = [0] * 120 + [120] * 30 + [150] * 90 + [240] * 60
    local = [i + 1 for n in (120, 30, 90, 60) for i in range(n)]
    whole = [c for c in dg.calls if c["q"].shape[0] == 300]
    assert {(c["max_seqlen_k"], c["clean_logits"]) for c in whole} == {(120, False), (0, True)}
    for c in whole:
        assert c["ks"].tolist() == starts
        assert c["ke"].tolist() == [s + n for s, n in zip(starts, local, strict=True)]
    # Chunked selection: every raw and package launch takes one chunk of at most 64 rows.
    chunks = [c for c in dg.calls if c["q"].shape[0] != 300]
    assert chunks and all(c["q"].shape[0] <= 64 and c["max_seqlen_k"] == 120 for c in chunks)
    thd = [c for c in dsa.forward_calls if c["thd"]]
    assert {c["max_seqlen_k"] for c in thd} == {120}
    assert all(c["cu_seqlens_k"].tolist() == [0, 120, 150, 240, 300] for c in thd)
    # The chunk of rows [128, 192): sequence 1 (rows 120-149) cut at its row 8, sequence 2 from 0.
    cut = [c for c in thd if c["cu_seqlens_q"].tolist() == [0, 0, 22, 64, 64]]
    assert len(cut) >= 2 and all(c["offsets"] == [128, 8, 0, 0] for c in cut)  # raw and package
    text = bench.format_tables(report)
    assert "packed THD" in text and "T=300: 120, 30, 90, 60" in text


def test_thd_profile_at_long_sizes_times_selection_only(cpu_bench):
    _, dg = cpu_bench
    report = bench._run_bench(_cfg(thd_seqs=(300,), chunked_from=256))
    (r,) = report["thd"]
    assert r["chunked"] and r["check"] is None and "host_us" not in r
    assert set(r["times_ms"]) == {"raw_select_dg", "select_dg", "raw_select_cudnn", "select_cudnn"}
    assert all(c["max_seqlen_k"] == 120 for c in dg.calls)  # no cleaned (T, T) logits
    text = bench.format_tables(report)
    assert "indexer_select_varlen" in text and "indexer_scores_varlen" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--thd-seq", "3"), "--thd-seq 3 with --thd-weights [4, 1, 3, 2] leaves an empty "
         "sequence ([1, 0, 0, 2]); pass a larger T or fewer sequences."),
        (("--thd", "--thd-weights", "2", "0"), "--thd-weights [2, 0]: give one or more positive "
         "integers."),
        (("--thd-seq", "0"), "--thd-seq values must be >= 1."),
    ],
)  # fmt: skip
def test_bad_packings_are_refused_by_name(monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    args = _parse(*argv)
    with pytest.raises(bench.CliError) as err:
        bench._main(args)
    assert str(err.value) == message


def test_megatron_profile_runs_megatrons_pytorch_indexer_beside_the_package(cpu_bench):
    """``--megatron`` on the CPU: Megatron's PyTorch indexer (``fused_qk_topk_naive``) runs for
    real and selects what the package's BF16 path selects; its fused backends need CUDA and
    are kept with that reason; the package's FP8 rows are timed."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    report = bench._run_bench(_cfg(megatron_seqs=(256,)))
    assert report["results"] == [] and report["long"] == []
    (r,) = report["megatron"]
    none, cudnn, tilelang = (r["megatron"][b] for b in ("none", "cudnn", "tilelang"))
    assert none["ms"] == 1.0 and none["e2e_ms"] == 2.0  # the timer: 1 ms a call
    assert 0.0 <= none["member_agreement"] <= 1.0  # against the fake cuDNN's picks here
    assert none["vs_fp8"] == 2.0
    assert cudnn == {"skipped": "dsa_kernel_backend='cudnn' needs a CUDA device"}
    assert tilelang == {"skipped": "dsa_kernel_backend='tilelang' needs a CUDA device"}
    assert set(r["times_ms"]) == {"prep_bf16", "select_fp8", "e2e_fp8", "select_fp8_dg",
                                  "e2e_fp8_dg"}  # fmt: skip
    text = bench.format_tables(report)
    assert "Megatron's indexer top-k per dsa_kernel_backend" in text
    assert "skipped tilelang: dsa_kernel_backend='tilelang' needs a CUDA device" in text


def test_megatron_profile_is_its_own_flag(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "_run_bench", lambda cfg, on_profile: seen.append(cfg) or {})
    monkeypatch.setattr(bench, "format_tables", lambda report: "")
    for argv in (("--megatron",), ("--megatron-seq", "4096", "--seq", "8192")):
        bench._main(_parse(*argv))
    alone, both = seen
    assert alone.seqs == () and alone.megatron_seqs == (8192, 16384)
    assert both.seqs == (8192,) and both.megatron_seqs == (4096,)


def test_megatrons_pytorch_indexer_is_called_in_its_layout(monkeypatch):
    """The call the ``none`` row times selects, on the bench's operands, the keys of the
    package's exact BF16 reference (both score the same BF16 operands in float32)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from dsa_precision import indexer_select, topk_agreement
    from dsa_precision.cli import bench_megatron

    monkeypatch.setattr(bench, "_DEVICE", "cpu")
    work = bench._Workload(_cfg(), 192, 32, torch.Generator().manual_seed(0))
    q16, k16 = work.pre16(work.q, work.k, work.freqs)
    picks = bench_megatron._megatron_topk("none", q16, k16, work.w16, 16, 192)()
    exact = indexer_select(work.prep(False), topk=16, backend="torch")
    assert picks.shape == exact.shape == (1, 192, 16)
    agreement = topk_agreement(picks.to(exact.dtype), exact).as_dict()
    assert agreement["member_agreement"] >= 0.999, agreement
