"""dsa_precision.megatron.logprobs on the toy GLM-5-like model (examples/toy_glm5_train.py, tiny,
MoE), CPU: the engine's picks are those of a model of rope_fp32+fp8's fields and the engine
profile, recorded on the same weights.

- rope_fp32+fp8 with the engine's profile picks the engine's keys in every layer, and then
  delta = log p_train - log p_rollout is exactly 0 on every token (BSHD and packed THD);
- a configuration whose picks differ is reported with the layers, counts and first tokens where
  they differ, as a direct comparison of its recorded picks finds them, and its figures are those
  of two forwards computed here;
- rows the engine never ran are not compared; the errors name the argument and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsa_precision.megatron as dsap
from dsa_precision.megatron.logprobs import format_reports, logprob_mismatch, replay_logprobs
from dsa_precision.picks import TokenLayout, TopkPicks

from ..support.helpers import import_example
from ..support.megatron import packed_params

SEQ, BATCH = 96, 2


def _args(engine: str = "vllm") -> argparse.Namespace:
    return argparse.Namespace(tiny=True, device="cpu", topk=32, engine=engine, seed=1234,
                              seq=SEQ, batch=BATCH, lr=1e-3)  # fmt: skip


def _toy(args: argparse.Namespace, **fields) -> torch.nn.Module:
    toy = import_example("toy_glm5_train")
    return toy.build_model(args, toy.model_config(args, **fields))[0]


def _tokens(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def _engine_picks(args, weights, tokens, forward=None, layout=None) -> TopkPicks:
    toy = import_example("toy_glm5_train")
    engine = _toy(args, **toy.ENGINE)
    engine.load_state_dict(weights)
    with torch.no_grad(), dsap.record_topk() as recorder:
        if forward is None:
            engine(tokens, _positions(tokens), None)
        else:
            forward(engine)
    picks = recorder.picks
    return picks if layout is None else TopkPicks(dict(picks.indices), layout)


def _models(args, name: str):
    """(model of configuration ``name``, the replaying model), the same weights."""
    toy = import_example("toy_glm5_train")
    model = _toy(args, **toy.CONFIGS[name])
    replay = _toy(args, **toy.CONFIGS["replay"])
    replay.load_state_dict(model.state_dict())
    return model, replay


def _logprobs(model, tokens, labels, **kw) -> torch.Tensor:
    """float32 log-softmax of the logits at the labels, computed here."""
    with torch.no_grad():
        logits = model(tokens, _positions(tokens), None, **kw).float()
    return torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]


@pytest.mark.parametrize("engine", ["vllm", "lmdeploy"])
def test_matched_profile_gives_exactly_zero_dlogp_on_every_token(engine):
    args = _args(engine)
    model, replay = _models(args, "rope_fp32+fp8")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    report = logprob_mismatch(model, tokens, picks, replay_model=replay, name="rope_fp32+fp8")
    assert report.picks_identical
    assert [layer.rows_differing for layer in report.layers] == [0, 0]
    assert report.picks["rows_identical"] == 1.0 and report.picks["member_agreement"] == 1.0
    assert torch.equal(report.delta, torch.zeros_like(report.delta))  # exactly, every token
    m = report.logprobs
    assert m.tokens == BATCH * (SEQ - 1) and m.tokens_differing == 0
    assert (m.abs_mean, m.abs_p99, m.abs_max, m.delta_mean, m.kl_k3) == (0, 0, 0, 0, 0)
    assert all(v == 0 for v in m.clipped.values())
    assert report.differences() == [] and report.first_logprob_differing == ()
    # The two forwards, computed here: equal token for token.
    labels = torch.roll(tokens, -1, dims=-1)
    with dsap.engine_topk(picks):
        rollout = _logprobs(replay, tokens, labels)
    assert torch.equal(_logprobs(model, tokens, labels), rollout)
    json.dumps(report.as_dict())  # JSON-ready


def test_differing_picks_are_named_by_layer_and_token_as_a_direct_comparison_finds_them():
    args = _args()
    model, replay = _models(args, "baseline")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    report = logprob_mismatch(model, tokens, picks, replay_model=replay, name="baseline",
                              first_tokens=5)  # fmt: skip
    with torch.no_grad(), dsap.record_topk() as recorder:
        model(tokens, _positions(tokens), None)
    own = recorder.picks.indices
    assert not report.picks_identical
    for layer in report.layers:
        mine, theirs = own[layer.layer].tolist(), picks.indices[layer.layer].tolist()
        rows = [r for r in range(len(mine)) if set(mine[r]) - {-1} != set(theirs[r]) - {-1}]
        assert layer.rows_differing == len(rows) > 0, layer.layer
        assert layer.first_differing == tuple((r // SEQ, r % SEQ) for r in rows[:5])
        assert all(position >= 32 for _, position in layer.first_differing)  # top-32 of <= 32
        assert layer.agreement["rows_identical"] == pytest.approx(1 - len(rows) / len(mine))
    lines = report.differences()
    first = report.layers[0].first_differing[0]
    assert any(f"baseline: layer 1: {report.layers[0].rows_differing} of" in x for x in lines)
    assert any(f"{first[0]}:{first[1]}" in x for x in lines), lines
    # Its figures: those of the two forwards computed here.
    labels = torch.roll(tokens, -1, dims=-1)
    with dsap.engine_topk(picks):
        rollout = _logprobs(replay, tokens, labels)
    delta = (_logprobs(model, tokens, labels).double() - rollout.double())[:, :-1]
    torch.testing.assert_close(report.delta[:, :-1], delta, rtol=0, atol=2e-6)
    assert bool((report.delta[:, -1] == 0).all())  # no next token: not compared
    m = report.logprobs
    assert m.abs_max == pytest.approx(float(delta.abs().max()), abs=2e-6) and m.abs_max > 0
    assert m.abs_mean == pytest.approx(float(delta.abs().mean()), abs=2e-6)
    assert m.delta_mean == pytest.approx(float(delta.mean()), abs=2e-6)
    nonzero = (delta.reshape(-1) != 0).nonzero()[:5, 0].tolist()
    assert report.first_logprob_differing == tuple((r // (SEQ - 1), r % (SEQ - 1)) for r in nonzero)
    table = report.table()
    assert table.splitlines()[1].startswith("layer 1") and table.splitlines()[-1].startswith("all")
    assert "baseline" in format_reports([report])


def test_rollout_logprobs_computed_once_give_the_same_report():
    args = _args()
    model, replay = _models(args, "fp8")
    tokens = _tokens(9)
    picks = _engine_picks(args, model.state_dict(), tokens)
    rollout = replay_logprobs(replay, tokens, picks)
    a = logprob_mismatch(model, tokens, picks, replay_model=replay)
    b = logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout)
    assert a.as_dict() == b.as_dict() and torch.equal(a.delta, b.delta)
    assert model.training and replay.training  # back in their own mode


def test_packed_sequences_name_their_sequence_and_position():
    args = _args()
    cu = [0, 60, 96]
    tokens = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(60), torch.arange(36)])[None]
    psp = packed_params(cu)

    def forward(m):
        return m(tokens, positions, None, packed_seq_params=psp)

    layout = TokenLayout(cu_seqlens=torch.tensor(cu))
    for name in ("rope_fp32+fp8", "baseline"):
        model, replay = _models(args, name)
        picks = _engine_picks(args, model.state_dict(), tokens, forward, layout)
        report = logprob_mismatch(model, tokens, picks, replay_model=replay, forward=forward,
                                  name=name)  # fmt: skip
        assert report.logprobs.tokens == 94 and report.logprobs.sequences == 2  # 2 ends left out
        if name == "rope_fp32+fp8":
            assert report.picks_identical and torch.equal(
                report.delta, torch.zeros_like(report.delta)
            )
            continue
        assert not report.picks_identical
        places = [w for layer in report.layers for w in layer.first_differing]
        assert all(0 <= s < 2 and 0 <= p < (60, 36)[s] for s, p in places), places
    with pytest.raises(ValueError, match="PackedSeqParams"):
        logprob_mismatch(model, tokens, picks, replay_model=replay)  # no forward for THD


def test_rows_the_engine_never_ran_are_not_compared():
    """A sequence's last token, which an engine never runs: its row is not compared when
    ``engine_rows`` says so, nor when it is empty (topk_agreement's rows); filled with its own
    position (``last_row="self"``) and not marked, it is compared and differs."""
    args = _args()
    model, _ = _models(args, "rope_fp32+fp8")
    tokens = _tokens()
    recorded = _engine_picks(args, model.state_dict(), tokens)
    last = torch.zeros(BATCH * SEQ, dtype=torch.bool)
    last[SEQ - 1 :: SEQ] = True
    own_position = torch.full((1, 32), -1)
    own_position[0, 0] = SEQ - 1
    rollout = torch.zeros(BATCH, SEQ)
    for filler, marked, differ in (
        (-1, True, False), (own_position, True, False), (-1, False, False),
        (own_position, False, True),
    ):  # fmt: skip
        indices = {n: torch.where(last[:, None], filler, t) for n, t in recorded.indices.items()}
        picks = TopkPicks(indices, TokenLayout(seq_len=SEQ), engine_rows=~last if marked else None)
        report = logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout)
        assert report.picks_identical is not differ, (filler, marked)
        if differ:
            assert [layer.first_differing for layer in report.layers] == [
                ((0, SEQ - 1), (1, SEQ - 1))
            ] * 2
        elif marked:
            assert all(layer.agreement["rows"] == BATCH * (SEQ - 1) for layer in report.layers)


def test_errors_name_the_argument_and_the_fix():
    args = _args()
    model, replay = _models(args, "baseline")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    with pytest.raises(ValueError, match=r"replay_model .* or rollout_logprobs, exactly one"):
        logprob_mismatch(model, tokens, picks)
    with pytest.raises(ValueError, match="exactly one"):
        logprob_mismatch(model, tokens, picks, replay_model=replay,
                         rollout_logprobs=torch.zeros(BATCH, SEQ))  # fmt: skip
    with pytest.raises(ValueError, match=r"dsa_indexer_topk_source \['compute'\].*'replay'"):
        logprob_mismatch(model, tokens, picks, replay_model=model)
    with pytest.raises(ValueError, match="model's DSA layers \\[1, 2\\] replay"):
        logprob_mismatch(replay, tokens, picks, rollout_logprobs=torch.zeros(BATCH, SEQ))
    other, _ = _models(_args(), "baseline")
    with torch.no_grad():
        next(other.parameters()).add_(1)
    replay.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match=r"parameter 'embedding.* differs .*load_state_dict"):
        logprob_mismatch(model, tokens, picks, replay_model=replay)
    with pytest.raises(ValueError, match=r"tokens have shape \(2, 95\) but the picks seq_len=96"):
        logprob_mismatch(model, tokens[:, 1:], picks, rollout_logprobs=torch.zeros(BATCH, 95))
    with pytest.raises(ValueError, match="no dsa-precision DSA layer"):
        logprob_mismatch(torch.nn.Linear(2, 2), tokens, picks, rollout_logprobs=tokens.float())
    with pytest.raises(ValueError, match="picks hold no layer 2"):
        logprob_mismatch(model, tokens, TopkPicks({1: picks.indices[1]}, picks.layout),
                         rollout_logprobs=torch.zeros(BATCH, SEQ))  # fmt: skip


# ------------------------------------------------- the report's inputs: selectors and labels


def test_row_selectors_are_masks_never_indices():
    """engine_rows and loss_mask given as row indices (or a 0/1 float mask) are refused by name;
    read as the other they would compare the wrong rows."""
    args = _args()
    model, _ = _models(args, "baseline")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    rollout = torch.zeros(BATCH, SEQ)
    with pytest.raises(TypeError, match=r"engine_rows is a int64 tensor .*not row indices"):
        TopkPicks(dict(picks.indices), picks.layout, engine_rows=torch.tensor([0, 1]))
    wrong_rows = dataclasses.replace(picks)  # engine_rows of the wrong length, set past the check
    object.__setattr__(wrong_rows, "engine_rows", torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"picks.engine_rows is .*pass a \(192,\) bool mask"):
        logprob_mismatch(model, tokens, wrong_rows, rollout_logprobs=rollout)
    for mask in (torch.tensor([0, 1]), torch.ones(BATCH, SEQ)):
        with pytest.raises(ValueError, match=r"loss_mask is a torch\.(int64|float32) .*bool mask"):
            logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout, loss_mask=mask)


@settings(max_examples=6)
@given(st.data())
def test_selected_tokens_are_those_of_a_direct_computation(data):
    """loss_mask, ignored labels (-100) and the last token of each sequence: the report compares
    exactly the tokens a direct computation selects, with the figures of the log-probs computed
    here (the rollout's given)."""
    args = _args()
    model, _ = _model_once(args)
    tokens = _tokens()
    picks = _picks_once(args, model, tokens)
    n = BATCH * SEQ
    loss_mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    ignored = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    loss_mask, ignored = loss_mask.view(BATCH, SEQ), ignored.view(BATCH, SEQ)
    labels = torch.where(ignored, -100, torch.roll(tokens, -1, dims=-1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rollout = -torch.rand(BATCH, SEQ, generator=g) * 8
    report = logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout, labels=labels,
                              loss_mask=loss_mask)  # fmt: skip
    own = _logprobs(model, tokens, labels.clamp(min=0))
    chosen = loss_mask & ~ignored
    want = (own.double() - rollout.double())[chosen]
    m = report.logprobs
    assert m.tokens == int(chosen.sum()) and torch.equal(report.mask, chosen)
    if not chosen.any():
        assert math.isnan(m.abs_mean) and "no token compared" in report.differences()[0]
        return
    assert m.abs_max == pytest.approx(float(want.abs().max()), abs=1e-6)
    assert m.abs_mean == pytest.approx(float(want.abs().mean()), abs=1e-6)


_ONCE: dict = {}


def _model_once(args):
    if "model" not in _ONCE:
        _ONCE["model"] = _models(args, "baseline")
    return _ONCE["model"]


def _picks_once(args, model, tokens):
    if "picks" not in _ONCE:
        _ONCE["picks"] = _engine_picks(args, model.state_dict(), tokens)
    return _ONCE["picks"]


def test_labels_past_the_vocabulary_and_bad_arguments_are_refused_before_any_figure():
    args = _args()
    model, _ = _models(args, "baseline")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    rollout = torch.zeros(BATCH, SEQ)
    labels = torch.roll(tokens, -1, dims=-1)
    labels[1, 7] = 10**6
    with pytest.raises(ValueError, match=r"labels\[1, 7\] = 1000000 is past the vocabulary"):
        logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout, labels=labels)
    for kw, error, match in (
        (dict(labels=labels.float()), ValueError, r"labels is a torch\.float32 tensor"),
        (dict(first_tokens=-1), ValueError, r"first_tokens=-1 is outside"),
        (dict(check_weights="no"), TypeError, r"check_weights must be a bool"),
        (dict(clip_ranges=[(0.2, 0.2)]), TypeError, r"clip_ranges is a list"),
        (dict(name=3), TypeError, r"name is .*a str"),
    ):
        with pytest.raises(error, match=match):
            logprob_mismatch(model, tokens, picks, rollout_logprobs=rollout, **kw)
    with pytest.raises(ValueError, match=r"tokens is a torch\.float32 tensor"):
        logprob_mismatch(model, tokens.float(), picks, rollout_logprobs=rollout)
    with pytest.raises(ValueError, match=r"rollout_logprobs is a torch\.int64 tensor"):
        logprob_mismatch(model, tokens, picks, rollout_logprobs=tokens)


def test_a_list_of_model_chunks_is_a_model():
    """Megatron's list of model chunks (virtual pipeline parallelism): the report of a one-chunk
    list is the module's; several chunks need a forward running them; topk_metrics reads every
    chunk's layers."""
    args = _args()
    model, replay = _models(args, "rope_fp32+fp8")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    single = logprob_mismatch(model, tokens, picks, replay_model=replay)
    chunks = logprob_mismatch([model], tokens, picks, replay_model=[replay])
    assert chunks.as_dict() == single.as_dict()
    assert torch.equal(chunks.delta, single.delta)
    with pytest.raises(ValueError, match=r"the model is 2 model chunks .*pass forward="):
        logprob_mismatch([model, model], tokens, picks, rollout_logprobs=torch.zeros(BATCH, SEQ))
    with pytest.raises(TypeError, match=r"model is .*list of its model chunks"):
        logprob_mismatch("model", tokens, picks, rollout_logprobs=torch.zeros(BATCH, SEQ))


def test_chunks_as_a_tuple_and_several_chunks_with_their_forward():
    """A tuple of chunks is a model as a list is; several chunks run by the caller's forward (it
    gets the chunks as given) give the one module's log-probs, every chunk in eval mode during
    the call and back in its own mode after; a chunk that is not a module is refused by name."""
    args = _args()
    model, replay = _models(args, "rope_fp32+fp8")
    second = _toy(args, **import_example("toy_glm5_train").CONFIGS["replay"])
    second.train(False)  # the modes to be restored: replay training, second eval
    tokens = _tokens(7)
    picks = _engine_picks(args, model.state_dict(), tokens)
    single = replay_logprobs(replay, tokens, picks)
    assert torch.equal(replay_logprobs((replay,), tokens, picks), single)
    modes = []

    def forward(chunks):  # a pipeline schedule's forward, here: the first chunk does it all
        assert isinstance(chunks, list) and chunks[1] is second
        modes.append((chunks[0].training, chunks[1].training))
        return chunks[0](tokens, _positions(tokens), None)

    assert torch.equal(replay_logprobs([replay, second], tokens, picks, forward=forward), single)
    assert modes == [(False, False)] and replay.training and not second.training
    report = logprob_mismatch((model,), tokens, picks, replay_model=(replay,))
    assert report.as_dict() == logprob_mismatch(model, tokens, picks, replay_model=replay).as_dict()
    with pytest.raises(ValueError, match=r"the model is 2 model chunks .*pass forward="):
        replay_logprobs((replay, second), tokens, picks)
    for bad in ([replay, "chunk"], (), []):
        with pytest.raises(TypeError, match=r"replay_model is .*list of its model chunks"):
            replay_logprobs(bad, tokens, picks)
    with pytest.raises(TypeError, match=r"^model is tuple; pass the model"):
        logprob_mismatch((model, None), tokens, picks, replay_model=replay)


def test_custom_clip_ranges_are_printed_in_the_tables():
    args = _args()
    model, replay = _models(args, "baseline")
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    report = logprob_mismatch(model, tokens, picks, replay_model=replay,
                              clip_ranges={"ppo_0.3": (0.3, 0.3)})  # fmt: skip
    for text in (report.table(), format_reports([report])):
        assert "clip ppo_0.3" in text and "clip 0.2" not in text.splitlines()[0]
    other = logprob_mismatch(model, tokens, picks, replay_model=replay, name="default")
    with pytest.raises(ValueError, match=r"format reports measured with the same clip_ranges"):
        format_reports([report, other])


def test_topk_metrics_reads_every_chunk_of_a_list():
    """topk_metrics of Megatron's list of model chunks: the module's metrics, not an
    AttributeError; anything but modules is refused by name."""
    args = _args()
    toy = import_example("toy_glm5_train")
    model = _toy(args, **{**toy.CONFIGS["baseline"], "dsa_indexer_topk_source": "verify"})
    tokens = _tokens()
    picks = _engine_picks(args, model.state_dict(), tokens)
    got = []
    for form in (model, [model], (model,)):
        with torch.no_grad(), dsap.engine_topk(picks):
            model(tokens, _positions(tokens), None)
        got.append(dsap.topk_metrics(form))
    assert got[0]["dsa_topk/all/rows"] > 0 and got[0] == got[1] == got[2]
    with pytest.raises(TypeError, match=r"or Megatron's list of its model chunks, got list"):
        dsap.topk_metrics([model, "chunk"])
