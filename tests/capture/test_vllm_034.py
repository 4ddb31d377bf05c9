"""The vLLM adapters against vLLM 0.34.0's own code paths, run on the CPU from the wheel's files
(a root of ``DSA_ENGINE_KERNELS`` holding the wheel's relative paths; skipped without them):
``compute_skip_topk_layers`` (which layers share top-k), ShardQ's ``zigzag_split`` (which TP rank
computes which prefill rows) and the aux-output connector's ``RoutedExpertsBuffer`` (the channel
NeMo-RL's top-k payload rides). The functions are taken from the files unmodified: the two pure
functions by their definitions alone (their modules import vLLM's distributed runtime), the
connector module whole, with a stand-in for its one vLLM import."""

import ast
import types

import numpy as np
import pytest
import torch

from conformance.loader import ENV_VAR, load_module, package, roots
from dsa_precision.capture import (
    VllmStep,
    check_vllm_engine_config,
    from_vllm,
    from_vllm_steps,
    merge_vllm_shardq_rows,
    vllm_shared_layers,
)

from ..support.engine_outputs import K, engine_rows

UTILS = "vllm/model_executor/models/utils.py"
SHARDQ = "vllm/v1/attention/ops/shardq.py"
ROUTED = "vllm/distributed/aux_output_connector/routed_experts.py"


def _wheel_file(rel: str, needle: str):
    """The first root's ``rel`` that defines ``needle`` (0.34's), else skip with the reason."""
    for root in roots():
        path = root / rel
        if path.is_file() and needle in path.read_text():
            return path
    pytest.skip(f"no root of {ENV_VAR} holds vLLM 0.34.0's {rel} (with {needle!r})")


def _function(rel: str, name: str, **namespace):
    """The top-level function ``name`` of the wheel's file, executed alone in ``namespace``."""
    path = _wheel_file(rel, f"def {name}(")
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    scope = {"__name__": f"_vllm034_{name}", **namespace}
    exec(code, scope)
    return scope[name]


@pytest.mark.parametrize(
    "fields",
    [
        dict(index_topk_freq=2),  # skip offset 2 (vLLM's default): ids 2, 4, ... reuse id - 1
        dict(index_topk_freq=3, index_skip_topk_offset=1),
        dict(index_topk_pattern="FFSFSSF"),
        dict(indexer_types=["full", "shared", "full", "shared", "shared", "full", "shared"]),
    ],
    ids=["freq2", "freq3_offset1", "pattern", "indexer_types"],
)
def test_shared_layers_follow_vllm_034s_compute_skip_topk_layers(fields):
    compute_skip = _function(UTILS, "compute_skip_topk_layers")
    config = types.SimpleNamespace(index_topk=K, num_hidden_layers=7, **fields)
    skip = compute_skip(config)
    assert skip  # every case shares some layer
    shared = vllm_shared_layers(skip, 7)
    assert set(shared) == {i + 1 for i in skip}
    # vLLM 0.34: a skip layer builds no indexer and reads the one buffer as the last computing
    # layer left it. A hook after every attention layer copies what each layer attended to.
    full = engine_rows(9, 7, seed=40)
    buffer = None
    copies = {}
    for i in range(7):
        if i not in skip:
            buffer = full[:, i].clone()
        assert buffer is not None
        copies[i + 1] = buffer.clone()
    step = VllmStep(["x"], [0, 8], [0], {n: torch.nn.functional.pad(b[:8], (0, 2), value=-1)
                                         for n, b in copies.items()})  # fmt: skip
    out = from_vllm_steps([step], {"x": 9}, topk=K, shared=shared)
    assert sorted(out.indices) == [i + 1 for i in range(7) if i not in skip]
    for n in out.indices:
        assert torch.equal(out.indices[n][:8], full[:8, n - 1])
    # The same copies read with a sharing one layer off are refused by the shared check.
    if fields == dict(index_topk_freq=2):
        with pytest.raises(ValueError, match=r"differs from its index-sharing source layer"):
            from_vllm_steps([step], {"x": 9}, topk=K, shared={4: 2})


def test_shared_layers_argument_errors():
    assert vllm_shared_layers([2, 4], 6) == {3: 2, 5: 4}
    assert vllm_shared_layers([2, 3], 5) == {3: 2, 4: 2}
    with pytest.raises(ValueError, match=r"skip layer id 0 has no computing layer before it"):
        vllm_shared_layers([0], 4)
    with pytest.raises(ValueError, match=r"skip layer ids \[6\] are not below num_layers=6"):
        vllm_shared_layers([6], 6)


def test_shardq_rows_merge_back_as_vllm_034_splits_them():
    """Three requests after two decodes, TP 4: each rank's copy is laid out as 0.34's indexer
    metadata builder lays it (decode rows in place, then the rank's own tokens of
    ``zigzag_split``, ascending, from row ``num_decode_tokens``; indexer.py 1551-1589)."""
    zigzag_split = _function(SHARDQ, "zigzag_split", np=np)
    lens = {"d0": 1, "d1": 1, "a": 23, "b": 9, "c": 17}  # scheduled tokens this step
    computed = {"d0": 30, "d1": 12, "a": 0, "b": 0, "c": 5}
    seq = {r: computed[r] + lens[r] + 1 for r in lens}
    full = {r: engine_rows(seq[r], 2, seed=50 + i) for i, r in enumerate(lens)}
    order = list(lens)
    qsl = np.cumsum([0, *lens.values()]).tolist()
    step_rows = {  # the step's buffer in batch order, as TP = 1 would leave it
        n: torch.cat([full[r][computed[r] : computed[r] + lens[r], n - 1] for r in order])
        for n in (1, 2)
    }
    d = 2
    token_ids, per_rank = zigzag_split(np.array([23, 9, 17]), 4)
    assert per_rank.sum() == 49 and per_rank.min() > 0
    starts = np.r_[0, np.cumsum(per_rank)]
    buffers = {}
    for n in (1, 2):
        ranks = []
        for r in range(4):
            local = np.sort(token_ids[starts[r] : starts[r + 1]])  # ascending within a rank
            assert np.array_equal(local, token_ids[starts[r] : starts[r + 1]])
            rows = torch.cat((step_rows[n][:d], step_rows[n][d + torch.from_numpy(local)]))
            stale = torch.full((5, K), 777, dtype=torch.int32)  # rows past the rank's own
            ranks.append(torch.cat((rows, stale)))
        buffers[n] = merge_vllm_shardq_rows(ranks, token_ids, per_rank, d)
        assert torch.equal(buffers[n], step_rows[n])
    step = VllmStep(order, qsl, [computed[r] for r in order], buffers)
    # Every request's earlier rows: one step that computed them (batch order, no sharding).
    before = [r for r in order if computed[r]]
    prior = VllmStep(
        before,
        np.cumsum([0, *(computed[r] for r in before)]).tolist(),
        [0] * len(before),
        {n: torch.cat([full[r][: computed[r], n - 1] for r in before]) for n in (1, 2)},
    )
    out = from_vllm_steps([prior, step], seq, topk=K, order=order)
    for r, start in zip(order, out.cu_seqlens.tolist(), strict=False):
        assert torch.equal(out.indices[2][start : start + seq[r] - 1], full[r][:-1, 1])
    # One rank's copy alone is not the step: its rows sit at other requests' places.
    with pytest.raises(ValueError, match=r"rank_buffers holds 1 copies for 4 ranks"):
        merge_vllm_shardq_rows(ranks[:1], token_ids, per_rank, d)
    with pytest.raises(ValueError, match=r"token_ids \(48 ids\) must be a permutation of 0..48"):
        merge_vllm_shardq_rows(ranks, token_ids[:-1], per_rank, d)


def _routed_experts_module():
    path = _wheel_file(ROUTED, "pending_blocks: Sequence[tuple[int, np.ndarray]]")
    store = types.ModuleType("vllm.distributed.aux_output_connector.store")
    for name in ("BackgroundBlockObjectStore", "BlockObject", "BlockObjectStore"):
        setattr(store, name, type(name, (), {}))
    stubs = {
        "vllm": package("vllm"),
        "vllm.distributed": package("vllm.distributed"),
        "vllm.distributed.aux_output_connector": package("vllm.distributed.aux_output_connector"),
        "vllm.distributed.aux_output_connector.store": store,
    }
    return load_module(path, "_vllm034_routed_experts", stubs)


def test_nemo_rl_payload_through_vllm_034s_routed_experts_read():
    """NeMo-RL's payload rides the routed-experts channel as token-aligned signed int32 rows
    ``(L, K)`` per token (nemo_rl/models/megatron/dsa_topk_replay.py, 2a607e5c4935). 0.34's
    ``RoutedExpertsBuffer`` stages each step's rows, hands back full blocks (which the worker
    keeps as ``pending_blocks`` until their keys arrive) and ``read(request_id, start, end,
    pending_blocks)`` (0.34's new signature) returns the request's rows in token order."""
    routed = _routed_experts_module()
    layer_ids = [0, 1, 3]  # computing layers (vLLM ids), as NeMo-RL selects them
    full = {"x": engine_rows(21, 3, seed=60), "y": engine_rows(7, 3, seed=61)}
    buffer = routed.RoutedExpertsBuffer(
        np.dtype(np.int32), (3, K), block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
        max_concurrent_batches=2,
    )  # fmt: skip
    pending = {"x": [], "y": []}
    steps = [("x", 0, 6), ("y", 0, 6), ("x", 6, 13), ("x", 13, 14), ("x", 14, 20)]
    for r, start, end in steps:  # chunked prefill, then decodes, rows of computed tokens only
        rows = full[r][start:end].numpy()
        pending[r] += buffer.capture(r, start, rows)
    payload = {r: buffer.read(r, 0, len(full[r]) - 1, pending[r]) for r in ("x", "y")}
    assert payload["x"].shape == (20, 3, K) and payload["x"].dtype == np.int32
    packed = np.concatenate([payload["x"], payload["y"]])  # NeMo-RL's packed [T, L, K]
    split = {"x": packed[:20], "y": packed[20:]}
    out = from_vllm(split, {"x": 21, "y": 7}, layer_numbers=[i + 1 for i in layer_ids], topk=K)
    assert sorted(out.indices) == [1, 2, 4]
    assert torch.equal(out.indices[4][:20], full["x"][:20, 2])
    assert torch.equal(out.indices[2][21:27], full["y"][:6, 1])
    assert out.engine_rows.tolist() == [True] * 20 + [False] + [True] * 6 + [False]


@pytest.mark.parametrize(
    ("config", "resolved"),
    [
        ({"indexer_logits_dtype": "float32"}, "float32"),
        ({"indexer_logits_dtype": "auto", "architecture": "GlmMoeDsaForCausalLM"}, "float32"),
        ({"architecture": "DeepseekV32ForCausalLM", "device_capability": (9, 0)}, "float32"),
        ({"device_capability": (9, 0)}, "float32"),
    ],
)
def test_engine_config_fp32_logits_pass(config, resolved):
    assert check_vllm_engine_config(config) == resolved
    out = from_vllm([engine_rows(4, 1, seed=70)[:-1]], [4], engine_config=config)
    assert sorted(out.indices) == [1]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"indexer_logits_dtype": "bfloat16", "device_capability": (9, 0)}, r"explicitly"),
        (
            {"architecture": "DeepseekV32ForCausalLM", "device_capability": (10, 0)},
            r"as 'auto' resolves it for this model on SM100",
        ),
    ],
)
def test_engine_config_bf16_logits_are_refused(config, match):
    with pytest.raises(ValueError, match=match) as info:
        check_vllm_engine_config(config)
    assert "indexer_logits_dtype" in str(info.value) and "replay" in str(info.value)
    step = VllmStep(["x"], [0, 3], [0], {1: engine_rows(4, 1, seed=71)[:3, 0]})
    with pytest.raises(ValueError, match=r"BF16 indexer logits"):
        from_vllm_steps([step], {"x": 4}, topk=K, engine_config=config)


def test_engine_config_auto_needs_what_decides_it():
    with pytest.raises(ValueError, match=r"'auto' without 'device_capability'.*DeepseekV32"):
        check_vllm_engine_config({"architecture": "DeepseekV32ForCausalLM"})
    with pytest.raises(ValueError, match=r"'auto' without 'architecture'"):
        check_vllm_engine_config({"device_capability": (10, 0)})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['logits_dtype'\]"):
        check_vllm_engine_config({"logits_dtype": "float32"})
    with pytest.raises(ValueError, match=r"takes 'auto', 'float32' or 'bfloat16'"):
        check_vllm_engine_config({"indexer_logits_dtype": "fp32"})
    with pytest.raises(ValueError, match=r"device_capability'\]='9.0'"):
        check_vllm_engine_config({"device_capability": "9.0"})
