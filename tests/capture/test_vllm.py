"""vLLM's indexer top-k into TopkPicks: PR 49555's per-request output, NeMo-RL payloads, the 0.33 per-step buffers."""

import pytest
import torch

from dsa_precision.capture import (
    VllmStep,
    from_vllm,
    from_vllm_steps,
    pack_requests,
)

from ..support.engine_outputs import K, engine_rows, npy_b64, vllm_step


def test_vllm_pr49555_output_and_prompt_start():
    full = engine_rows(9, 2, seed=10)
    rows = decode_vllm_indexer_topk_roundtrip(full[:-1])
    out = from_vllm([rows], [9], layer_numbers=[2, 4])  # NeMo-RL style: computing layers only
    assert sorted(out.indices) == [2, 4]
    assert torch.equal(out.indices[4][:8], full[:8, 1])
    with pytest.raises(ValueError, match=r"rows start at position 3; positions 0..2 have no"):
        from_vllm([rows[3:]], [9], first_rows=[3])


def decode_vllm_indexer_topk_roundtrip(rows: torch.Tensor) -> torch.Tensor:
    from dsa_precision.capture import decode_vllm_indexer_topk

    return decode_vllm_indexer_topk(npy_b64(rows.numpy()))


def test_vllm_steps_stitch_chunked_prefill_decode_and_speculation():
    full = {"x": engine_rows(10, 2, seed=11), "y": engine_rows(6, 2, seed=12)}
    steps = [
        vllm_step(["x"], [0], [4], full),  # chunked prefill, chunk 1
        vllm_step(["y", "x"], [0, 4], [4, 3], full),  # y prefill; x chunk 2
        # decode first: y verifies 1 + 2 drafts, accepts 1 (keeps 2 rows); x decodes 1
        vllm_step(["x", "y"], [7, 4], [1, 3], full, kept=[1, 2]),
        vllm_step(["x"], [8], [1], full),
    ]
    out = from_vllm_steps(steps, {"x": 10, "y": 6}, topk=K, order=["x", "y"])
    assert out.cu_seqlens.tolist() == [0, 10, 16]
    assert torch.equal(out.indices[2][:9], full["x"][:9, 1])
    assert torch.equal(out.indices[1][10:16], full["y"][:, 0])  # y's rows cover every token


def test_vllm_prefix_cache_hit_is_named():
    full = {"x": engine_rows(10, 2, seed=13)}
    steps = [vllm_step(["x"], [4], [5], full)]  # 4 cached tokens: no rows for them
    with pytest.raises(ValueError, match=r"request 'x': positions 0..3 have no rows .*prefix"):
        from_vllm_steps(steps, {"x": 10}, topk=K)


def test_nemo_rl_int16_payload_and_validate_off_keeps_host_checks():
    full = engine_rows(6, 2, seed=21).to(torch.int16)  # NeMo-RL accepts int16 payloads
    out = from_vllm([full[:-1]], [6], layer_numbers=[1, 3])
    assert out.indices[3].dtype == torch.int32
    assert torch.equal(out.indices[3][:5], full[:5, 1].to(torch.int32))
    bad = full.clone()
    bad[2, 0, 0] = 4  # not causal: only the data check (validate=True) sees it
    assert pack_requests([bad[:-1]], [6], validate=False).indices[1][2, 0] == 4
    with pytest.raises(ValueError, match=r"5 rows from position 0 .* 9 tokens"):
        pack_requests([bad[:-1]], [9], validate=False)  # coverage is a host fact: always checked


def test_vllm_rows_computed_twice_are_named():
    full = {"x": engine_rows(8, 2, seed=22)}
    steps = [vllm_step(["x"], [0], [5], full), vllm_step(["x"], [3], [4], full)]
    with pytest.raises(ValueError, match=r"request 'x': positions 3..4 have rows twice"):
        from_vllm_steps(steps, {"x": 8}, topk=K)


def test_vllm_step_buffers_and_kept_rows_are_checked():
    full = {"x": engine_rows(8, 2, seed=24)}
    step = vllm_step(["x"], [0], [5], full, stale=0)
    short = VllmStep(["x"], [0, 5], [0], {n: b[:4] for n, b in step.buffers.items()})
    with pytest.raises(
        ValueError, match=r"layer 1: buffer \(4, 12\) holds fewer than the step's 5"
    ):
        from_vllm_steps([short], {"x": 8}, topk=K)
    with pytest.raises(ValueError, match=r"request 'x': kept_rows=6 but 5 rows"):
        from_vllm_steps([vllm_step(["x"], [0], [5], full, kept=[6])], {"x": 8}, topk=K)
