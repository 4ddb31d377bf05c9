"""Converted engine outputs in the Megatron replay path (CPU): an FP8 layer's own picks, laid
out as SGLang returns them (every token but the last, base64 int32) and as vLLM's per-step
buffer holds them (chunked prefill), go through the adapters into ``engine_topk``; verify then
agrees with them on every row the engine computed, and replay attends exactly those keys.

Reference: the layer's own FP8 selection of the same micro-batch (captured with
``record_topk``), and the same layer replaying the captured picks directly. The digest path:
the engine's per-row digests of those picks (``digest_rows`` per request, ``pack_digests``) in
``engine_topk(engine_digests=...)``; verify counts the rows whose digest differs, per layer.
"""

import itertools

import pytest
import torch

import dsa_precision.megatron as dsap
from dsa_precision.capture import VllmStep, digest_rows, from_sglang, from_vllm_steps, pack_digests

from ..support.engine_outputs import sglang_response
from ..support.megatron import (
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)

CU = [0, 5, 16]


def _own_picks(attn, kw):
    with dsap.record_topk() as recorder:
        run_attention(attn, attention_inputs(b=1, packed=True), **kw)
    return recorder.picks.indices[attn.layer_number]  # (T, k) sequence-relative, packed order


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


@pytest.mark.parametrize("last_row", ["empty", "self"])
def test_the_adapters_picks_handed_in_whole_compare_only_the_rows_the_engine_ran(last_row):
    """``engine_topk(batch)``: the TopkPicks carry ``engine_rows``; the last token's filled row
    (``last_row="self"``: one key, its own position, which the layer's own picks differ from) is
    replayed as filled but left out of verify's agreement."""
    kw = dict(packed_seq_params=packed_params(CU))
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source="verify")
    attn = make_attention(config)
    picks = _own_picks(attn, kw)
    responses = [sglang_response(picks[a:b, None], completion=2) for a, b in itertools.pairwise(CU)]
    batch = from_sglang(responses, last_row=last_row)
    assert batch.engine_rows is not None and int((~batch.engine_rows).sum()) == 2
    dsap.topk_metrics(torch.nn.ModuleList([attn]))  # reset
    with dsap.engine_topk(batch) as handed:
        assert torch.equal(handed.engine_rows, batch.engine_rows)
        run_attention(attn, attention_inputs(b=1, packed=True), **kw)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/rows"] == CU[-1] - 2
    assert m["dsa_topk/layer_01/rows_identical"] == 1.0
    # Counted as every row when the engine_rows are dropped: the filled rows then differ.
    if last_row == "self":
        with dsap.engine_topk(batch.indices, cu_seqlens=batch.cu_seqlens):
            run_attention(attn, attention_inputs(b=1, packed=True), **kw)
        m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
        assert m["dsa_topk/layer_01/rows"] == CU[-1]
        assert m["dsa_topk/layer_01/rows_identical"] < 1.0
    # Replay attends the filled rows as handed in: the same output as the bare picks.
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay"))
    with dsap.engine_topk(batch):
        whole = run_attention(replaying, attention_inputs(b=1, packed=True), **kw)
    with dsap.engine_topk(batch.indices, cu_seqlens=batch.cu_seqlens):
        bare = run_attention(replaying, attention_inputs(b=1, packed=True), **kw)
    assert torch.equal(whole, bare)


def test_engine_rows_beside_picks_are_checked_where_they_enter():
    picks = {1: torch.zeros(CU[-1], 2, dtype=torch.int64)}
    cu = torch.tensor(CU)
    with pytest.raises(TypeError, match=r"engine_rows: expected a \(16,\) bool tensor"):
        with dsap.engine_topk(picks, engine_rows=torch.ones(CU[-1] - 1, dtype=torch.bool),
                              cu_seqlens=cu):  # fmt: skip
            pass


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


# --- the digest path: verify without the payload ------------------------------------------------


def _two_layers():
    config = make_config(
        dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source="verify", num_layers=2
    )
    return [make_attention(config, layer_number=n, seed=n) for n in (1, 2)]


def _own(layers, inputs, kw):
    """Each layer's own picks ``(T, k)``, sequence-relative, in token order."""
    with dsap.record_topk() as recorder:
        for attn in layers:
            run_attention(attn, inputs(), **kw)
    return dict(recorder.picks.indices)


def _verify(layers, inputs, kw, **engine):
    model = torch.nn.ModuleList(layers)
    dsap.topk_metrics(model)  # reset
    with dsap.engine_topk(**engine):
        for attn in layers:
            run_attention(attn, inputs(), **kw)
    return dsap.topk_metrics(model)


def _changed(row):
    """A different set of sequence-relative picks for ``row`` (its key 0 dropped or added)."""
    keys = row[row >= 0].tolist()
    other = keys[1:] if 0 in keys else [0, *keys[:-1]]
    return torch.tensor(other + [-1] * (row.numel() - len(other)), dtype=row.dtype)


def test_digests_of_the_layers_own_picks_verify_and_one_changed_row_is_counted():
    layers = _two_layers()
    kw = dict(packed_seq_params=packed_params(CU))
    inputs = lambda: attention_inputs(b=1, packed=True)  # noqa: E731
    picks = _own(layers, inputs, kw)
    # Engine side, per request: SGLang's rows (every token but the last), one digest per layer.
    per_request = [
        torch.stack([digest_rows(picks[n][a : b - 1]) for n in (1, 2)], dim=1)
        for a, b in itertools.pairwise(CU)
    ]
    digests, rows = pack_digests(per_request, [b - a for a, b in itertools.pairwise(CU)])
    assert rows.sum() == CU[-1] - 2
    m = _verify(layers, inputs, kw, engine_digests=digests, engine_rows=rows, cu_seqlens=CU_T)
    for n in (1, 2):
        assert m[f"dsa_topk/layer_{n:02d}/digest_compared_rows"] == CU[-1] - 2
        assert m[f"dsa_topk/layer_{n:02d}/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_01/rows"] == 0  # no picks moved, none compared
    # One engine row of layer 2 changed (row 9: sequence 1, position 4): exactly 1 there.
    bad = {n: d.clone() for n, d in digests.items()}
    bad[2][9] = digest_rows(_changed(picks[2][9]))
    m = _verify(layers, inputs, kw, engine_digests=bad, engine_rows=rows, cu_seqlens=CU_T)
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_02/digest_mismatch_rows"] == 1
    assert m["dsa_topk/all/digest_mismatch_rows"] == 1
    # A row the engine never computed (sequence 0's last token) is not compared.
    bad[1][4] = 12345
    m = _verify(layers, inputs, kw, engine_digests=bad, engine_rows=rows, cu_seqlens=CU_T)
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    # Beside the picks: both comparisons, one forward.
    engine = dict(indices=picks, engine_digests=bad, engine_rows=rows, cu_seqlens=CU_T)
    m = _verify(layers, inputs, kw, **engine)
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_02/digest_mismatch_rows"] == 1
    assert m["dsa_topk/layer_01/member_agreement"] == 1.0


def test_bshd_digests_verify_with_batch_major_token_rows():
    layers = _two_layers()[:1]
    inputs = lambda: attention_inputs(b=2)  # noqa: E731
    picks = _own(layers, inputs, {})
    digests = {1: digest_rows(picks[1])}
    m = _verify(layers, inputs, {}, engine_digests=digests, seq_len=16)
    assert m["dsa_topk/layer_01/digest_compared_rows"] == 32
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    digests[1][16 + 11] = digest_rows(_changed(picks[1][16 + 11]))  # batch row 1, position 11
    m = _verify(layers, inputs, {}, engine_digests=digests, seq_len=16)
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 1


CU_T = torch.tensor(CU)
T = CU[-1]


@pytest.mark.parametrize(
    "engine, err, match",
    [
        (dict(engine_digests={1: torch.zeros(T + 1, dtype=torch.int64)}), ValueError,
         r"engine_digests layer 1: 17 token rows but cu_seqlens ends at 16"),
        (dict(engine_digests={1: torch.zeros(T, dtype=torch.int32)}), TypeError,
         r"engine_digests layer 1: expected \(T,\) int64 row digests, got torch.int32"),
        (dict(engine_digests={1: torch.zeros(T, 4, dtype=torch.int64)}), TypeError,
         r"got torch.int64 \(16, 4\) \(per-row picks\? digest them: digest_rows"),
        (dict(engine_digests={1: torch.zeros(T, dtype=torch.int64)},
              engine_rows=torch.ones(T, dtype=torch.int64)), TypeError,
         r"engine_rows: expected a \(16,\) bool tensor .* got torch.int64 \(16,\)"),
        (dict(engine_digests={1: torch.zeros(T, dtype=torch.int64)},
              indices={1: torch.zeros(T - 1, 2, dtype=torch.int64)}), ValueError,
         r"(cu_seqlens ends at 16|different token counts)"),
        (dict(engine_rows=torch.ones(T, dtype=torch.bool)), ValueError,
         r"needs the engine's picks .* or their digests"),
        ({}, ValueError, r"needs the engine's picks .* or their digests"),
    ],
    ids=["length", "dtype", "picks_as_digests", "rows_dtype", "length_vs_picks", "rows_alone",
         "nothing"],
)  # fmt: skip
def test_bad_digests_are_named_where_they_enter(engine, err, match):
    with pytest.raises(err, match=match), dsap.engine_topk(cu_seqlens=CU_T, **engine):
        pass


def test_digests_in_another_layout_than_the_layers_are_named():
    attn = _two_layers()[0]
    digests = {1: torch.zeros(2 * 8, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"digests of layer 1: seq_len=8, but DSA layer 1 runs"):
        _verify([attn], lambda: attention_inputs(b=1), {}, engine_digests=digests, seq_len=8)
    # BSHD digests for a packed micro-batch.
    kw = dict(packed_seq_params=packed_params(CU))
    digests = {1: torch.zeros(T, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"gives seq_len=16 \(BSHD\), but DSA layer 1 runs packed"):
        _verify([attn], lambda: attention_inputs(b=1, packed=True), kw, engine_digests=digests,
                seq_len=16)  # fmt: skip
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay"))
    with pytest.raises(ValueError, match=r"only digests, no picks, for DSA layer 1: .*replay"):
        _verify([replaying], lambda: attention_inputs(b=1, packed=True), kw,
                engine_digests=digests, cu_seqlens=CU_T)  # fmt: skip
