"""Converted engine outputs in the Megatron replay path (CPU): an FP8 layer's own picks, laid
out as SGLang returns them (every token but the last, base64 int32) and as vLLM's per-step
buffer holds them (chunked prefill), go through the adapters into ``engine_topk``; verify then
agrees with them on every row the engine computed, and replay attends exactly those keys.

Reference: the layer's own FP8 selection of the same micro-batch (captured with
``capture_topk``), and the same layer replaying the captured picks directly.
"""

import itertools

import pytest
import torch

pytest.importorskip("megatron.core")

import dsa_precision.megatron as dsap
from dsa_precision.capture import VllmStep, from_sglang, from_vllm_steps

from .megatron_utils import (
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)
from .test_capture import sglang_response

pytestmark = pytest.mark.usefixtures("megatron_parallel", "cpu_rotary")
CU = [0, 5, 16]


def _own_picks(attn, kw):
    with dsap.capture_topk() as captured:
        run_attention(attn, attention_inputs(b=1, packed=True), **kw)
    c = captured[attn.layer_number]
    return c.indices[c.tokens.argsort()]  # (T, k) sequence-relative, packed order


def _sglang(picks):
    responses = [sglang_response(picks[a:b, None], completion=2) for a, b in itertools.pairwise(CU)]
    return from_sglang(responses)


def _vllm(picks):
    topk = picks.shape[1]
    # request 0 prefilled in one step; request 1 in two chunks, beside request 0's last token.
    steps = [
        VllmStep(["r0", "r1"], [0, 4, 10], [0, 0], {1: torch.cat((picks[0:4], picks[5:11]))}),
        VllmStep(["r0", "r1"], [0, 1, 5], [4, 6], {1: torch.cat((picks[4:5], picks[11:15]))}),
    ]
    return from_vllm_steps(steps, {"r0": 5, "r1": 11}, topk=topk, order=["r0", "r1"])


@pytest.mark.parametrize("adapter", [_sglang, _vllm], ids=["sglang", "vllm"])
def test_verify_agrees_fully_with_converted_engine_output(adapter):
    kw = dict(packed_seq_params=packed_params(CU))
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source="verify")
    attn = make_attention(config)
    picks = _own_picks(attn, kw)
    batch = adapter(picks)
    assert batch.cu_seqlens.tolist() == CU
    dsap.topk_metrics(torch.nn.ModuleList([attn]))  # reset
    with dsap.engine_topk(batch.indices, cu_seqlens=batch.cu_seqlens):
        run_attention(attn, attention_inputs(b=1, packed=True), **kw)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    computed = int(batch.engine_rows.sum())
    # SGLang returns no row for each sequence's last token; the vLLM steps above ran r0's.
    assert computed == {_sglang: CU[-1] - 2, _vllm: CU[-1] - 1}[adapter]
    assert m["dsa_topk/layer_01/rows"] == computed
    assert m["dsa_topk/layer_01/member_agreement"] == 1.0
    assert m["dsa_topk/layer_01/rows_identical"] == 1.0


def test_replay_of_converted_sglang_output_attends_the_engine_keys():
    kw = dict(packed_seq_params=packed_params(CU))
    source = make_attention(make_config(dsa_indexer_scoring_precision="fp8"), seed=7)
    picks = _own_picks(source, kw)
    batch = _sglang(picks)
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay"))
    with dsap.engine_topk(batch.indices, cu_seqlens=batch.cu_seqlens):
        converted = run_attention(replaying, attention_inputs(b=1, packed=True), **kw)
    direct_picks = picks.clone()
    direct_picks[~batch.engine_rows] = -1  # the rows SGLang never returns
    with dsap.engine_topk({1: direct_picks}, cu_seqlens=torch.tensor(CU)):
        direct = run_attention(replaying, attention_inputs(b=1, packed=True), **kw)
    assert torch.equal(converted, direct)
    # The rows SGLang never returns attend to nothing: finite outputs and gradients.
    inputs = attention_inputs(b=1, packed=True)
    with dsap.engine_topk(batch.indices, cu_seqlens=batch.cu_seqlens):
        out = run_attention(replaying, inputs, **kw)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(inputs["query"].grad).all()
    assert torch.isfinite(inputs["key"].grad).all()
