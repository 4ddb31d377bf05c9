"""Replay and verify under TP=2 with sequence parallelism and CP=2 (BSHD and packed THD): two
processes on the CPU (gloo, tiny shapes, the torch backend), and the same on two GPUs (NCCL,
cuDNN; ``gpu``, skipped with fewer than two).

Each process first runs the single-process layer (TP = CP = 1, the world data-parallel), then the
same layer (same seed, same weights) under the parallel layout on its shard of the same inputs,
the way Megatron hands them to ``DSAttention.forward``: TP+SP, ``x`` / ``qr`` sequence-local
(the indexer gathers them), the query and key of every row with this rank's heads; CP, the rows
of the rank's zigzag chunks (BSHD) or of every packed sequence's zigzag chunks (THD), keys
all-gathered by Megatron. Checked against the single-process run:

- ``replay_ties`` with FP8 scoring: every row's recorded picks (its own top-k, or the engine's
  for the rows the engine sent) and the layer's counters;

- ``replay``: the attention output of the rank's rows and heads is the single-process one, bit
  for bit. The engine picks one key per token (a random causal key, the other slots ``-1``): the
  softmax is then exactly 1 on it, so the output is that key's latent value, projected -- exact
  arithmetic whatever the BLAS library's blocking or thread count, and a wrong key (another
  token's, another sequence's) changes it;
- ``verify`` with FP8 scoring: the layer's metrics (summed over the CP group; every TP rank holds
  all rows) are the single-process ones: counts exactly, mean margins to float64 rounding. The
  indexer's weights and inputs are small multiples of 1/8, so its GEMMs are exact too and the
  operands do not depend on how rows are split (the package's picks, given the same operands,
  never do).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

from ..support.helpers import free_port, import_example

SEQ, WORLD = 16, 2
CASES = {  # name: (tp, cp, packed cu_seqlens or None)
    "tp2-sp-bshd": (2, 1, None),
    "tp2-sp-thd": (2, 1, [0, 6, 16]),
    "cp2-bshd": (1, 2, None),
    "cp2-thd": (1, 2, [0, 4, 16]),  # each length divisible by 2 * CP
}


def _exact_(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Small multiples of 1/8 (exact products and sums in float32, exact in BF16)."""
    with torch.no_grad():
        return t.copy_(torch.randint(-2, 3, t.shape, generator=g).to(t.dtype) / 8)


def _inputs(packed: bool) -> dict:
    from ..support.megatron import attention_inputs

    g = torch.Generator().manual_seed(11)
    inputs = attention_inputs(sq=SEQ, b=1 if packed else 2, packed=packed)
    for name in ("x", "qr"):
        _exact_(inputs[name], g)
    return inputs


def _engine(cu: list[int] | None, batch: int, topk: int) -> torch.Tensor:
    """``(T, topk)`` engine picks: one random causal key per token, in a random slot."""
    g = torch.Generator().manual_seed(5)
    lengths = [b - a for a, b in itertools.pairwise(cu)] if cu else [SEQ] * batch
    position = torch.cat([torch.arange(n) for n in lengths])
    key = (torch.rand(position.shape, generator=g) * (position + 1)).long()
    picks = torch.full((position.numel(), topk), -1, dtype=torch.int64)
    slot = torch.randint(0, topk, position.shape, generator=g)
    return picks.scatter_(1, slot[:, None], key[:, None])


def _layer(source: str, tp: int, cp: int, fp8: bool, rope_fp32: bool = False):
    from dsa_precision.testing.megatron import local_sp_backend

    from ..support.megatron import make_attention, make_config

    fields = dict(dsa_indexer_topk_source=source, dsa_indexer_topk=4)
    if fp8:
        fields["dsa_indexer_scoring_precision"] = "fp8"
    if rope_fp32:
        fields["dsa_indexer_rope_fp32"] = True
    if tp > 1:
        fields |= dict(tensor_model_parallel_size=tp, sequence_parallel=True)
    if cp > 1:
        fields |= dict(context_parallel_size=cp, cp_comm_type="allgather")
    attn = make_attention(make_config(**fields), seed=3, backend=local_sp_backend())
    g = torch.Generator().manual_seed(13)
    for p in attn.indexer.parameters():
        _exact_(p, g)
    return attn


def _shard(inputs: dict, tp: int, cp: int, cu: list[int] | None, rank: int):
    """This rank's inputs (see the module docstring) and the rows / heads of the output."""
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    from ..support.megatron import HEADS

    out = {k: v.detach().clone() for k, v in inputs.items()}
    rows, heads = slice(None), slice(0, HEADS)
    if tp > 1:
        local = SEQ // tp
        heads = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
        for name in ("x", "qr"):
            out[name] = out[name][rank * local : (rank + 1) * local]
        out["query"] = out["query"][..., heads, :]
        out["up_v_weight"] = out["up_v_weight"][heads]
    if cp > 1:
        if cu is None:
            rows = dsa_layout.build_zigzag_cp_local_positions(SEQ, cp, rank, "cpu")
        else:
            rows = dsa_layout.build_packed_allgather_cp_local_positions(
                torch.tensor(cu), cp, rank, "cpu", output_size=SEQ // cp
            )
        for name in ("query", "key", "x", "qr"):
            out[name] = out[name][rows]
    for name in ("query", "key"):
        out[name] = out[name].contiguous().requires_grad_()
    return out, rows, heads


def _packed_kw(cu: list[int] | None, device: str) -> dict:
    """The layer's ``packed_seq_params`` keyword for packed lengths ``cu`` on ``device`` (none
    for BSHD)."""
    from ..support.megatron import packed_params

    if not cu:
        return {}
    psp = packed_params(cu)
    cu_dev = psp.cu_seqlens_q.to(device)
    return {
        "packed_seq_params": dataclasses.replace(psp, cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev)
    }


def _run(attn, inputs, engine, cu, device, **metrics_kw):

    import dsa_precision.megatron as dsap

    from ..support.megatron import run_attention

    attn = attn.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    kw = _packed_kw(cu, device)
    layout = dict(cu_seqlens=torch.tensor(cu)) if cu else dict(seq_len=SEQ)
    with torch.no_grad(), dsap.engine_topk({1: engine}, **layout):
        out = run_attention(attn, inputs, **kw)
    return out, dsap.topk_metrics(torch.nn.ModuleList([attn]), **metrics_kw)


def _case(name: str, rank: int, device: str) -> dict:
    from megatron.core import parallel_state

    from ..support.megatron import V_DIM

    tp, cp, cu = CASES[name]
    inputs = _inputs(packed=cu is not None)
    engine = _engine(cu, 1 if cu else 2, topk=4)
    result = {}
    for source, fp8 in (("replay", False), ("verify", True)):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        ref, ref_metrics = _run(_layer(source, 1, 1, fp8), inputs, engine, cu, device)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        group = parallel_state.get_context_parallel_group() if cp > 1 else None
        mine, rows, heads = _shard(inputs, tp, cp, cu, rank)
        out, metrics = _run(_layer(source, tp, cp, fp8), mine, engine, cu, device, group=group)
        want = ref[..., heads.start * V_DIM : heads.stop * V_DIM] if tp > 1 else ref
        result[source] = dict(
            equal=torch.equal(out, want[rows]),
            max_diff=float((out.float() - want[rows].float()).abs().max()),
            metrics=metrics,
            ref_metrics=ref_metrics,
        )
    result["replay_ties"] = _ties(inputs, engine, cu, tp, cp, rank, device)
    result["rope_fp32"] = _rope_fp32_rows(inputs, cu, tp, cp, rank, device)
    return result


def _ties(inputs: dict, engine: torch.Tensor, cu, tp: int, cp: int, rank: int, device: str):
    """replay_ties (FP8) under the parallel layout against one process: the picks each row
    attends to (recorded, by global token) and the layer's metrics (summed over the CP group)."""
    from megatron.core import parallel_state

    import dsa_precision.megatron as dsap

    from ..support.megatron import run_attention

    # Every row's digest, the picks of every third row of each sequence (the toy's payload).
    lengths = [b - a for a, b in itertools.pairwise(cu)] if cu else [SEQ] * (engine.shape[0] // SEQ)
    payload = import_example("toy_glm5_train").tie_rows(
        {1: engine}, lengths, 1 / 3, seq_len=None if cu else SEQ
    )
    kw = _packed_kw(cu, device)
    runs = []
    for layout_tp, layout_cp in ((1, 1), (tp, cp)):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(layout_tp, 1, context_parallel_size=layout_cp)
        group = parallel_state.get_context_parallel_group() if layout_cp > 1 else None
        mine, _, _ = _shard(inputs, layout_tp, layout_cp, cu, rank)
        attn = _layer("replay_ties", layout_tp, layout_cp, True).to(device)
        mine = {k: v.to(device) for k, v in mine.items()}
        with torch.no_grad(), dsap.engine_topk(payload), dsap.record_topk() as rec:
            run_attention(attn, mine, **kw)
        metrics = dsap.topk_metrics(torch.nn.ModuleList([attn]), group=group)
        runs.append((rec.picks, metrics))
    (ref, ref_metrics), (got, metrics) = runs
    tokens = slice(None) if got.tokens is None else got.tokens.cpu()
    return dict(
        picks_equal=torch.equal(got.indices[1].cpu(), ref.indices[1].cpu()[tokens]),
        metrics=metrics,
        ref_metrics=ref_metrics,
    )


def _rope_fp32_rows(inputs: dict, cu, tp: int, cp: int, rank: int, device: str) -> dict:
    """rope_fp32's preprocessed q and k of this rank's rows against the single-process rows: the
    engine's tables read at the rank's positions (zigzag chunks, per packed sequence)."""
    from megatron.core import parallel_state

    kw = _packed_kw(cu, device)
    outs = []
    for layout_tp, layout_cp in ((1, 1), (tp, cp)):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(layout_tp, 1, context_parallel_size=layout_cp)
        mine, rows, _ = _shard(inputs, layout_tp, layout_cp, cu, rank)
        indexer = _layer("compute", layout_tp, layout_cp, False, rope_fp32=True).indexer
        indexer = indexer.to(device)
        with torch.no_grad():
            q, k, _ = indexer.forward_before_topk(mine["x"].to(device), mine["qr"].to(device), **kw)
        outs.append((q, k, rows))
    (q0, k0, _), (q, k, rows) = outs
    return dict(q_equal=torch.equal(q, q0[rows]), k_equal=torch.equal(k, k0[rows]))


def _worker(rank: int, port: int, path: str, device: str) -> None:
    import contextlib

    import torch.distributed as dist

    from dsa_precision.testing.megatron import megatron_on_cpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":  # two GPUs: NCCL, NVLink multicast off
        os.environ.update(
            NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
        )
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=WORLD)
    try:
        with megatron_on_cpu() if device == "cpu" else contextlib.nullcontext():
            results = {name: _case(name, rank, device) for name in CASES}
        torch.save(results, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path_factory, device: str) -> list[dict]:
    import torch.multiprocessing as mp

    path = str(tmp_path_factory.mktemp("replay_parallel") / "results")
    mp.spawn(_worker, args=(free_port(), path, device), nprocs=WORLD, join=True)
    return [torch.load(f"{path}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def parallel(request, tmp_path_factory):
    if request.param == "cuda" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs (nvidia-h200-x2), found {torch.cuda.device_count()}")
    return _spawn(tmp_path_factory, request.param)


@pytest.mark.parametrize("case", CASES)
def test_replay_output_is_the_single_process_output(parallel, case):
    for rank, results in enumerate(parallel):
        r = results[case]["replay"]
        assert r["equal"], f"{case}, rank {rank}: max |diff| {r['max_diff']:.3e}"


def _assert_same_metrics(got: dict, want: dict, case: str, rank: int) -> None:
    """Counts exactly, mean margins to float64 rounding, NaN (nothing compared) in both."""
    assert got.keys() == want.keys() and want, (case, rank, got, want)
    for key, value in want.items():
        if value != value:  # NaN: no rows compared (replay_ties' own picks), in both runs
            assert got[key] != got[key], (case, rank, key, got[key])
        elif "margin" in key:
            assert got[key] == pytest.approx(value, rel=1e-12), (case, rank, key)
        else:
            assert got[key] == value, (case, rank, key, got[key], value)


@pytest.mark.parametrize("case", CASES)
def test_verify_metrics_are_the_single_process_metrics(parallel, case):
    for rank, results in enumerate(parallel):
        r = results[case]["verify"]
        got, want = r["metrics"], r["ref_metrics"]
        assert want["dsa_topk/layer_01/rows"] == SEQ * (1 if "thd" in case else 2)
        _assert_same_metrics(got, want, case, rank)


@pytest.mark.parametrize("case", CASES)
def test_replay_ties_picks_and_metrics_are_the_single_process_ones(parallel, case):
    """Each rank's rows attend to the picks one process merges (its own top-k, the engine's
    for the rows sent), and the replay_ties counters summed over the CP group are one process's."""
    for rank, results in enumerate(parallel):
        r = results[case]["replay_ties"]
        assert r["picks_equal"], (case, rank)
        got, want = r["metrics"], r["ref_metrics"]
        assert want["dsa_topk/layer_01/replayed_rows"] == (10 if case.endswith("bshd") else 5)
        _assert_same_metrics(got, want, case, rank)


@pytest.mark.parametrize("case", CASES)
def test_rope_fp32_preprocessing_of_each_rank_is_the_single_process_rows(parallel, case):
    for rank, results in enumerate(parallel):
        assert results[case]["rope_fp32"] == dict(q_equal=True, k_equal=True), (case, rank)
