"""Top-k replay, verification, monitoring and capture in the Megatron drop-ins (CPU).

Checked against: a stock Megatron skip layer handed the same indices through its index-share
holder (replay feeds exactly those indices to Megatron's sparse attention, values and gradients),
hand counts of the metrics, the exact scores of the layer's operands (margins), and the same run
without indices (monitoring changes nothing).
"""

import pytest
import torch

import dsa_precision.megatron as dsap
from dsa_precision import indexer_scores

from ..support.megatron import (
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)

SEQ = 16


def _captured(attn, inputs, **kw):
    """The layer's recorded picks, (T, k) in token order."""
    with dsap.record_topk() as recorder:
        run_attention(attn, inputs, **kw)
    return recorder.picks.indices[attn.layer_number]


def _engine(capture, batch):
    """The recorded picks as engine indices: (T, k), tokens batch-major."""
    return capture.reshape(batch * SEQ, -1)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_replay_attends_exactly_the_engine_keys(packed):
    batch = 1 if packed else 2
    kw = dict(packed_seq_params=packed_params([0, 5, 16])) if packed else {}
    # Engine picks: those of an FP8 layer of another seed (a different, valid causal selection).
    other = make_attention(make_config(dsa_indexer_scoring_precision="fp8"), seed=7)
    engine = _captured(other, attention_inputs(b=batch, packed=packed, seed=3), **kw)
    indices = engine
    layout = dict(cu_seqlens=torch.tensor([0, 5, 16])) if packed else dict(seq_len=SEQ)
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay"))
    stock = make_attention(
        make_config(make_config().__class__.__mro__[1], dsa_indexer_topk_freq=2),
        stock=True,
        layer_number=2,
    )
    a, b = attention_inputs(b=batch, packed=packed), attention_inputs(b=batch, packed=packed)
    with dsap.engine_topk({1: indices}, **layout):
        out_a = run_attention(replaying, a, **kw)
    # Megatron's own reader of index-shared picks, handed the same keys (its coordinates).
    picks = indices.view(batch, SEQ, -1) if not packed else indices.unsqueeze(0)
    if packed:
        starts = torch.repeat_interleave(torch.tensor([0, 5]), torch.tensor([5, 11]))
        picks = torch.where(picks >= 0, picks + starts[None, :, None].to(picks.dtype), picks)
    carrier = kw.get("packed_seq_params")
    stock._get_index_share_topk_holder(carrier, None)[1] = picks.to(torch.int32)
    out_b = run_attention(stock, b, **kw)
    assert torch.equal(out_a, out_b)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    assert torch.equal(a["query"].grad, b["query"].grad)
    assert torch.equal(a["key"].grad, b["key"].grad)


def test_replay_skips_the_indexer_and_needs_the_indices():
    from dsa_precision import reset_scoring_calls, scoring_calls

    attn = make_attention(make_config(dsa_indexer_topk_source="replay"))
    with pytest.raises(RuntimeError, match=r"layer 1: .*'replay' needs the engine's picks"):
        run_attention(attn, attention_inputs())
    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 1)  # each token its own position
    reset_scoring_calls()
    with dsap.engine_topk({1: picks}, seq_len=SEQ):
        run_attention(attn, attention_inputs())
    assert scoring_calls() == 0


def test_replayed_picks_are_shared_by_index_sharing_layers():
    config = make_config(dsa_indexer_topk_source="replay", dsa_indexer_topk_freq=2, num_layers=2)
    first, second = make_attention(config), make_attention(config, layer_number=2)
    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 1)
    with dsap.engine_topk({1: picks}, seq_len=SEQ):  # layer 2 computes nothing: no indices needed
        run_attention(first, attention_inputs())
        assert torch.equal(second._get_index_share_topk_holder(None)[1][0, :, 0], torch.arange(SEQ))


def test_verify_metrics_are_a_hand_count():
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source="verify")
    attn = make_attention(config)
    inp = attention_inputs()
    ours = _engine(_captured(attn, inp), batch=2)
    engine = ours.clone()
    # Flip picks in three rows: replace one valid key by another valid, unpicked one.
    changed = {}
    for row in (9, 28, 31):  # positions 9, 12, 15: more visible keys than picks
        pos = row % SEQ
        unpicked = sorted(set(range(pos + 1)) - set(engine[row].tolist()))
        engine[row, 0] = unpicked[0]
        changed[row] = 1
    engine[28, 1] = sorted(set(range(28 % SEQ + 1)) - set(engine[28].tolist()))[0]
    changed[28] = 2
    _, margins = attn.compute_topk(inp["query"], inp["x"], inp["qr"], None, margins=True)
    flipped_margins = margins.reshape(-1)[sorted(changed)].double()
    assert not flipped_margins.isnan().any()
    dsap.topk_metrics(torch.nn.ModuleList([attn]))  # reset
    with dsap.engine_topk({1: engine}, seq_len=SEQ):
        run_attention(attn, inp)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    members = int((engine >= 0).sum())
    flipped = sum(changed.values())
    assert m["dsa_topk/layer_01/member_agreement"] == pytest.approx((members - flipped) / members)
    assert m["dsa_topk/layer_01/rows_identical"] == pytest.approx((2 * SEQ - 3) / (2 * SEQ))
    assert m["dsa_topk/layer_01/flipped_per_row"] == pytest.approx(flipped / (2 * SEQ))
    assert m["dsa_topk/layer_01/flipped_max"] == 2 and m["dsa_topk/all/rows"] == 2 * SEQ
    assert m["dsa_topk/layer_01/margin_mean"] >= 0
    # The mean margin over exactly the rows whose sets differ from the engine's.
    assert m["dsa_topk/layer_01/margin_mean_flipped"] == pytest.approx(
        float(flipped_margins.mean())
    )
    assert dsap.topk_metrics(torch.nn.ModuleList([attn])) == {}  # read resets


def test_verify_margins_are_the_gap_at_the_k_th_score():
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk=4)
    attn = make_attention(config)
    inp = attention_inputs(b=1)
    _, margins = attn.compute_topk(inp["query"], inp["x"], inp["qr"], None, margins=True)
    scores = indexer_scores(attn.indexer.scoring_operands(inp["x"], inp["qr"]))[0]
    top = scores.sort(-1, descending=True).values
    exact = top[:, 3] - top[:, 4]
    defined = torch.isfinite(exact)
    assert torch.equal(defined, ~torch.isnan(margins[0]))
    torch.testing.assert_close(margins[0][defined], exact[defined], rtol=1e-5, atol=1e-6)


def test_verify_against_captured_picks_agrees_fully_and_changes_no_bits():
    config = make_config(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
    attn = make_attention(config)
    inp = attention_inputs()
    engine = _engine(_captured(attn, inp), batch=2)
    plain = run_attention(attn, attention_inputs())
    with dsap.engine_topk({1: engine}, seq_len=SEQ):  # compute mode: monitored at no cost
        monitored = run_attention(attn, attention_inputs())
    assert torch.equal(plain, monitored)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/member_agreement"] == 1.0
    assert m["dsa_topk/layer_01/rows_identical"] == 1.0
    # One engine pick of row 15 (position 15: 16 visible keys, 8 picked) swapped for an unpicked
    # key: the monitor counts exactly that, and the layer still attends its own picks.
    other = engine.clone()
    other[15, 0] = sorted(set(range(16)) - set(engine[15].tolist()))[0]
    with dsap.engine_topk({1: other}, seq_len=SEQ):
        assert torch.equal(run_attention(attn, attention_inputs()), plain)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    members = int((engine >= 0).sum())
    assert m["dsa_topk/layer_01/member_agreement"] == pytest.approx((members - 1) / members)
    assert m["dsa_topk/layer_01/rows_identical"] == pytest.approx((2 * SEQ - 1) / (2 * SEQ))


def test_bf16_verify_keeps_megatrons_path_and_measures_the_package_selection():
    base = make_attention(make_config())
    verify = make_attention(make_config(dsa_indexer_topk_source="verify"))
    engine = _engine(_captured(verify, attention_inputs()), batch=2)
    with dsap.engine_topk({1: engine}, seq_len=SEQ):
        out = run_attention(verify, attention_inputs())
    assert torch.equal(out, run_attention(base, attention_inputs()))  # Megatron attends as before
    m = dsap.topk_metrics(torch.nn.ModuleList([verify]))
    assert m["dsa_topk/layer_01/rows_identical"] == 1.0
    other = engine.clone()  # one pick of row 20 (position 4: 5 visible keys) made unknown to it
    other[20] = torch.where(other[20] == other[20, 0], -1, other[20])
    with dsap.engine_topk({1: other}, seq_len=SEQ):
        assert torch.equal(run_attention(verify, attention_inputs()), out)
    m = dsap.topk_metrics(torch.nn.ModuleList([verify]))
    assert m["dsa_topk/layer_01/rows_identical"] == pytest.approx((2 * SEQ - 1) / (2 * SEQ))


I64 = dict(dtype=torch.int64)


@pytest.mark.parametrize(
    "indices, layout, err, match",
    [
        ({1: torch.zeros(32, 4)}, dict(seq_len=SEQ), TypeError, r"layer 1: expected a \(T, k\) int"),
        ({1: torch.zeros(30, 4, dtype=torch.int32)}, dict(seq_len=SEQ), ValueError, "whole number"),
        ({0: torch.zeros(32, 1, **I64)}, dict(seq_len=SEQ), ValueError, "1-based layer"),
        ([torch.zeros(32, 1, **I64)], dict(seq_len=SEQ), TypeError, r"layer_number: \(T, k\)"),
        ({1: torch.zeros(16, 1, **I64)}, dict(cu_seqlens=torch.tensor([0, 9])), ValueError, "cu_seqlens ends at 9"),
        ({1: torch.zeros(16, 1, **I64)}, {}, ValueError, "cu_seqlens .* or seq_len"),
        ({1: torch.zeros(16, 1, **I64)}, dict(seq_len=0), ValueError, "seq_len=0 must be positive"),
        ({1: torch.zeros(16, 1, **I64)}, dict(seq_len=16.0), TypeError, r"seq_len=16\.0 \(float\) must be an int"),
        ({1: torch.zeros(16, 1, **I64)}, dict(cu_seqlens=[0, 16]), TypeError, "cu_seqlens must be a 1-D"),
        ({1: torch.zeros(16, 1, **I64)}, dict(cu_seqlens=torch.tensor([[0, 16]])), ValueError, r"shape \(1, 2\); expected a 1-D"),
        ({1: torch.zeros(16, 1, **I64)}, dict(cu_seqlens=torch.tensor([0, 9, 5, 16])), ValueError, r"entry 2 = 5\): it must start at 0 and never decrease"),
        ({1: torch.zeros(16, 1, **I64, device="meta")}, dict(seq_len=SEQ), ValueError, "layer 1 is on meta; hold the picks on the CPU"),
    ],
)  # fmt: skip
def test_bad_engine_indices_are_named_without_validation(indices, layout, err, match):
    """Host facts: checked by default (no synchronisation), named, never a raw torch error."""
    with pytest.raises(err, match=match):
        with dsap.engine_topk(indices, validate=False, **layout):
            pass


DATA_ERRORS = [
    (torch.full((32, 2), 5), r"layer 1: row 0 \(position 0 in its sequence\).*causal"),
    (torch.zeros(32, 2, **I64), "layer 1: row 0 repeats a key"),
]


@pytest.mark.parametrize("value", [-2, 2**32 + 3], ids=["below -1", "past int32"])
def test_host_picks_are_range_checked_in_their_own_dtype_always(value):
    """Picks held on the CPU are host data: their key range is checked in every step, before
    any int32 cast (a key past int32 would wrap to another key), naming the layer and the row."""
    picks = torch.zeros(32, 2, **I64)
    picks[7, 1] = value
    with pytest.raises(ValueError, match=rf"engine_topk layer 1: row 7 holds {value}; a key is -1"):
        with dsap.engine_topk({1: picks}, seq_len=SEQ):
            pass


@pytest.fixture
def validation_switch(monkeypatch):
    monkeypatch.delenv(dsap.replay._VALIDATE_ENV, raising=False)
    yield monkeypatch
    dsap.set_replay_validation(None)


@pytest.mark.parametrize("picks, match", DATA_ERRORS)
def test_data_checks_are_a_debug_opt_in(validation_switch, picks, match):
    with dsap.engine_topk({1: picks}, seq_len=SEQ):  # the step: no data check
        assert not dsap.replay._current_handed_in().validate
    for switch_on in (
        lambda: None,  # validate=True below
        lambda: dsap.set_replay_validation(True),
        lambda: validation_switch.setenv(dsap.replay._VALIDATE_ENV, "1"),
    ):
        dsap.set_replay_validation(None)
        switch_on()
        explicit = {} if dsap.replay._replay_validation_enabled() else dict(validate=True)
        with pytest.raises(ValueError, match=match):
            with dsap.engine_topk({1: picks}, seq_len=SEQ, **explicit):
                pass
    dsap.set_replay_validation(False)  # beats the environment
    with dsap.engine_topk({1: picks}, seq_len=SEQ):
        assert not dsap.replay._current_handed_in().validate
    with pytest.raises(TypeError, match=r"set_replay_validation\(enabled='yes'\)"):
        dsap.set_replay_validation("yes")


def _run_replay(engine, layout, *, packed_layer=None, b=2, validate=False):
    attn = make_attention(make_config(dsa_indexer_topk_source="replay"))
    kw = dict(packed_seq_params=packed_params(packed_layer)) if packed_layer else {}
    with dsap.engine_topk({1: engine}, validate=validate, **layout):
        return run_attention(attn, attention_inputs(b=b, packed=bool(packed_layer)), **kw)


def _own_position_picks(rows_per_seq):
    return torch.cat([torch.arange(n) for n in rows_per_seq]).view(-1, 1)


@pytest.mark.parametrize(
    "picks, layout, packed_layer, match",
    [
        # BSHD, batch 2 x 16 tokens: 4 engine sequences of 8 tokens are another layout.
        (_own_position_picks([8] * 4), dict(seq_len=8), None, r"layer 1: seq_len=8, but DSA layer 1 runs sequences of 16 tokens"),
        (_own_position_picks([16]), dict(seq_len=SEQ), None, r"layer 1: 16 token rows, but DSA layer 1 runs 2 sequences of 16 tokens \(32 rows\)"),
        (_own_position_picks([5, 11]), dict(cu_seqlens=torch.tensor([0, 5, 16])), None, r"gives cu_seqlens \(packed THD\), but DSA layer 1 runs BSHD sequences; pass seq_len=16"),
        # THD, the layer packs [0, 5, 16].
        (_own_position_picks([16]), dict(seq_len=SEQ), [0, 5, 16], r"gives seq_len=16 \(BSHD\), but DSA layer 1 runs packed THD tokens; pass cu_seqlens="),
        (_own_position_picks([8, 8]), dict(cu_seqlens=torch.tensor([0, 8, 16])), [0, 5, 16], r"cu_seqlens\[1\] = 8, but DSA layer 1's PackedSeqParams have 5 there"),
        (_own_position_picks([16]), dict(cu_seqlens=torch.tensor([0, 16])), [0, 5, 16], r"cu_seqlens holds 1 sequences, but DSA layer 1's PackedSeqParams hold 2"),
    ],
)  # fmt: skip
def test_replay_checks_the_picks_against_the_layers_own_layout(picks, layout, packed_layer, match):
    """Valid picks of another layout are refused where the layer reads them (host facts; CPU
    cu_seqlens values), with validation off: they would attend to other tokens' keys."""
    b = 1 if packed_layer else 2
    with pytest.raises(ValueError, match=match):
        _run_replay(picks, layout, packed_layer=packed_layer, b=b)


def test_the_layers_own_layout_replays():
    """The same checks pass on the micro-batch's own layout (BSHD and THD)."""
    assert _run_replay(_own_position_picks([16, 16]), dict(seq_len=SEQ)).isfinite().all()
    thd = dict(cu_seqlens=torch.tensor([0, 5, 16]))
    out = _run_replay(_own_position_picks([5, 11]), thd, packed_layer=[0, 5, 16], b=1)
    assert out.isfinite().all()


def test_more_picks_than_the_layers_topk_are_named():
    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 9).clamp(max=0)  # 9 > dsa_indexer_topk=8
    with pytest.raises(ValueError, match=r"layer 1 holds 9 keys per token, .*topk=8"):
        _run_replay(picks, dict(seq_len=SEQ))


def test_a_missing_layer_is_named_when_the_layer_runs():
    attn = make_attention(make_config(dsa_indexer_topk_source="replay"), layer_number=3)
    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 1)
    with dsap.engine_topk({1: picks}, seq_len=SEQ):
        with pytest.raises(KeyError, match=r"no indices for DSA layer 3 \(it has layers \[1\]\)"):
            run_attention(attn, attention_inputs())


def test_config_validation_and_flag():
    import argparse

    with pytest.raises(ValueError, match=r"dsa_indexer_loss_coeff=0\.1: dsa_indexer_topk_source="):
        make_config(dsa_indexer_topk_source="replay", dsa_indexer_loss_coeff=0.1)
    with pytest.raises(ValueError, match=r"dsa_indexer_topk_source='engine' is not a top-k source"):
        make_config(dsa_indexer_topk_source="engine")
    parser = dsap.add_dsa_precision_args(argparse.ArgumentParser())
    assert (
        parser.parse_args(["--dsa-indexer-topk-source", "verify"]).dsa_indexer_topk_source
        == "verify"
    )


def test_replay_files_round_trip(tmp_path):
    from dsa_precision.capture import TokenLayout, TopkPicks, load_picks, save_picks

    picks = {1: torch.randint(0, 3, (8, 2)), 3: torch.randint(0, 3, (8, 2))}
    for name in ("r.pt", "r.safetensors"):
        layout = TokenLayout(cu_seqlens=torch.tensor([0, 3, 8]))
        save_picks(tmp_path / name, TopkPicks(picks, layout))
        loaded = load_picks(tmp_path / name)
        assert sorted(loaded.indices) == [1, 3] and torch.equal(loaded.indices[3], picks[3])
        assert torch.equal(loaded.cu_seqlens, torch.tensor([0, 3, 8]))


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_verify_scores_once_per_chunk(packed):
    from dsa_precision import reset_scoring_calls, scoring_calls

    kw = dict(packed_seq_params=packed_params([0, 5, 16])) if packed else {}
    batch = 1 if packed else 2
    layout = dict(cu_seqlens=torch.tensor([0, 5, 16])) if packed else dict(seq_len=SEQ)
    calls = {}
    for source in ("compute", "verify"):
        config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source=source)
        attn = make_attention(config)
        inp = attention_inputs(b=batch, packed=packed)
        engine = _captured(attn, attention_inputs(b=batch, packed=packed), **kw)
        indices = engine
        reset_scoring_calls()
        with dsap.engine_topk({1: indices}, **layout):
            run_attention(attn, inp, **kw)
        calls[source] = scoring_calls(precision="fp8")
        m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
        assert m["dsa_topk/layer_01/member_agreement"] == 1.0
    # One chunk here: verify, margins included, scores exactly as often as compute.
    assert calls == {"compute": 1, "verify": 1}


def test_every_row_in_order_is_the_picks_themselves_copied():
    """One CP rank, the whole sequence: rows(positions=None) are the picks as handed in, in the
    layer's (batch, rows, topk) layout, padded to topk, a copy; the same as the rows gathered by
    their positions."""
    from dsa_precision.picks import TokenLayout

    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, SEQ, (2 * SEQ, 3), generator=g)  # int64 picks, 3 of topk 4
    with dsap.engine_topk({1: idx}, seq_len=SEQ):
        engine = dsap.replay._current_handed_in()
        own = TokenLayout(seq_len=SEQ)
        fast = engine.rows(1, None, 2, 4, own, device=torch.device("cpu"))
        by_position = engine.rows(1, torch.arange(SEQ), 2, 4, own)
        assert fast.dtype == torch.int32 and fast.shape == (2, SEQ, 4)
        assert torch.equal(fast, by_position)
        assert torch.equal(fast[..., :3], idx.view(2, SEQ, 3).to(torch.int32))
        assert (fast[..., 3] == -1).all()
        full = engine.rows(1, None, 2, 3, own, device=torch.device("cpu"))
        full.fill_(7)  # the caller's copy: the engine's picks stay
        assert torch.equal(engine.rows(1, None, 2, 3, own, device=torch.device("cpu")),
                           idx.view(2, SEQ, 3).to(torch.int32))  # fmt: skip
    with dsap.engine_topk({1: idx.to(torch.int32)}, cu_seqlens=torch.tensor([0, 32])):
        packed = dsap.replay._current_handed_in()
        with pytest.raises(ValueError, match="positions=None"):
            packed.rows(1, None, 1, 4, TokenLayout(cu_seqlens=torch.tensor([0, 32])),
                        device=torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("recompute", ["reentrant", "non_reentrant"])
def test_a_recomputed_forward_is_counted_once(recompute):
    """Activation checkpointing reruns a verifying layer's forward in the backward, inside the
    same engine_topk block: the monitor counts the micro-batch's rows once, as eagerly."""
    from megatron.core.transformer.enums import AttnMaskType
    from torch.utils.checkpoint import checkpoint

    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_source="verify")
    rows = {}
    for mode in (None, recompute):
        attn = make_attention(config)
        inp = attention_inputs(b=2)
        engine = _engine(_captured(attn, attention_inputs(b=2)), batch=2)
        args = (inp["query"], inp["key"], inp["x"], inp["qr"], inp["up_v_weight"])

        def fn(q, k, x, qr, up_v, attn=attn):
            return attn(
                q, k, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v
            )

        with dsap.engine_topk({1: engine}, seq_len=SEQ):
            out = (
                fn(*args)
                if mode is None
                else checkpoint(fn, *args, use_reentrant=mode == "reentrant")
            )
            out.float().square().sum().backward()
        rows[mode] = dsap.topk_metrics(torch.nn.ModuleList([attn]))["dsa_topk/layer_01/rows"]
    assert rows[recompute] == rows[None] == 2 * SEQ  # every row of both sequences, once


def test_picks_handed_in_for_an_index_sharing_layer_are_refused():
    """Megatron's sharing layer reuses its source's top-k and would ignore its own picks: the
    layer says so (a host fact) instead of silently replaying its source's."""
    config = make_config(dsa_indexer_topk_source="replay", dsa_indexer_topk_freq=2, num_layers=2)
    first, second = make_attention(config), make_attention(config, layer_number=2)
    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 1)
    with dsap.engine_topk({1: picks, 2: picks}, seq_len=SEQ):
        run_attention(first, attention_inputs())
        with pytest.raises(
            ValueError, match=r"picks for DSA layer 2, which reuses layer 1's top-k"
        ):
            run_attention(second, attention_inputs())


def test_layer_keys_are_layer_numbers_numpy_integers_included():
    import numpy as np

    picks = torch.arange(SEQ).view(SEQ, 1).repeat(2, 1)
    with dsap.engine_topk({np.int64(1): picks}, seq_len=SEQ) as handed:
        assert list(handed.indices) == [1] and type(next(iter(handed.indices))) is int
    for key in (True, 1.0, "1", np.int64(0)):
        with pytest.raises(ValueError, match=r"Megatron's 1-based layer numbers .*layer_number"):
            with dsap.engine_topk({key: picks}, seq_len=SEQ):
                pass
