"""``dsa_indexer_topk_source="replay_ties"`` in the Megatron drop-ins (CPU), with planted ties.

Ties are planted where the engine's choice is truly free: a token whose hidden state is zero has
zero indexer weights, so its row scores exactly 0 on every key (all tied). The engine side is
``engine_tie_rows`` on the layer's own scores, with an engine top-k that breaks ties at random
(as vLLM's kernels do); checked against: Megatron's replay of the engine's full picks (same output
and gradients, bit for bit), hand counts of the rows sent, tied and undecided, and the same layer
with no ties (nothing sent, its own picks).
"""

import dataclasses

import pytest
import torch

import dsa_precision.megatron as dsap
from dsa_precision import indexer_scores, indexer_topk
from dsa_precision.capture import TieRows, engine_tie_rows, pack_tie_rows
from dsa_precision.picks import TokenLayout, TopkPicks

from ..support.megatron import (
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)

SEQ, TOPK = 16, 8
FP8 = dict(dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
ZEROED = (10, 13)  # positions whose hidden state is zero: rows that score 0 on every key


def _inputs(b: int, packed: bool, zeroed=ZEROED):
    inp = attention_inputs(b=b, packed=packed)
    with torch.no_grad():
        for pos in zeroed:
            inp["x"][pos] = 0  # (S, b, hidden): every sequence's token at pos
    return inp


def _scores(attn, inp, packed_seq_params=None):
    """The layer's exact scores per sequence: a list of (S_i, S_i) float32."""
    ops = attn.indexer.scoring_operands(inp["x"], inp["qr"], packed_seq_params)
    if packed_seq_params is None:
        return list(indexer_scores(ops))
    from dsa_precision import indexer_scores_varlen

    cu = packed_seq_params.cu_seqlens_q.long()
    longest = packed_seq_params.max_seqlen_q
    full = indexer_scores_varlen(
        ops, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest
    )
    return [full[a:b, : b - a] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


def _engine_topk(scores: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """A valid top-k of every row that breaks ties at random: (S, k) int32, -1 padding."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(scores.shape, generator=g)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for r in range(scores.shape[0]):
        valid = [c for c in range(scores.shape[1]) if scores[r, c] > float("-inf")]
        ranked = sorted(valid, key=lambda c: (-float(scores[r, c]), float(noise[r, c])))
        picks = sorted(ranked[:k])
        out[r, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
    return out


def _engine_side(per_seq_scores, seed=5, drop=()):
    """Per request: (full engine picks (S, k), TieRows of its S - 1 rows the engine ran)."""
    picks, ties = [], []
    for i, s in enumerate(per_seq_scores):
        p = _engine_topk(s, TOPK, seed + i)
        n = s.shape[0] - 1  # the engine never runs a sequence's last token
        tr = engine_tie_rows(s[:n], p[:n], torch.arange(1, n + 1))
        keep = torch.tensor([int(r) not in drop for r in tr.rows.tolist()], dtype=torch.bool)
        tr = TieRows(tr.digests, tr.rows[keep], tr.picks[keep])
        picks.append(p)
        ties.append({1: tr})
    return picks, ties


def _full_picks(picks):
    """The picks full replay would hand in: the engine's top-k of every row (the last token's,
    which the engine never runs, untied in these inputs: the layer's own)."""
    return torch.cat(picks)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_tied_rows_take_the_engines_picks_and_match_full_replay(packed):
    b = 1 if packed else 2
    cu = [0, 2, 16] if packed else None
    kw = dict(packed_seq_params=packed_params(cu)) if packed else {}
    attn = make_attention(make_config(dsa_indexer_topk_source="replay_ties", **FP8))
    per_seq = _scores(attn, _inputs(b, packed), kw.get("packed_seq_params"))
    picks, ties = _engine_side(per_seq)
    lens = [s.shape[0] for s in per_seq]
    sent = sum(t[1].rows.numel() for t in ties)
    tied_positions = {p for p in ZEROED if p < SEQ}
    # The rows sent are exactly the zeroed rows past the first top-k keys (all-tied scores).
    expected = sum(
        1
        for a, n in zip([0, *lens], lens, strict=False)
        for p in tied_positions
        if (not packed and TOPK <= p < n - 1) or (packed and a <= p < a + n - 1 and p - a >= TOPK)
    )
    assert sent == expected > 0
    tie_picks = pack_tie_rows(ties, lens, seq_len=None if packed else SEQ)
    full = _full_picks(picks)
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay", **FP8))
    layout = dict(cu_seqlens=torch.tensor(cu)) if packed else dict(seq_len=SEQ)
    a, c = _inputs(b, packed), _inputs(b, packed)
    dsap.topk_metrics(torch.nn.ModuleList([attn]))  # reset
    with dsap.engine_topk(tie_picks):
        out_ties = run_attention(attn, a, **kw)
    with dsap.engine_topk({1: full}, **layout):
        out_full = run_attention(replaying, c, **kw)
    assert torch.equal(out_ties, out_full)
    out_ties.float().sum().backward()
    out_full.float().sum().backward()
    assert torch.equal(a["query"].grad, c["query"].grad)
    assert torch.equal(a["key"].grad, c["key"].grad)
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/replayed_rows"] == sent
    assert m["dsa_topk/layer_01/tied_rows"] == sent  # the layer finds the same rows tied
    assert m["dsa_topk/layer_01/undecided_rows"] == 0
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_01/digest_compared_rows"] == sum(n - 1 for n in lens)


def test_a_tied_row_the_engine_did_not_send_is_counted_never_guessed():
    attn = make_attention(make_config(dsa_indexer_topk_source="replay_ties", **FP8))
    computing = make_attention(make_config(**FP8))
    per_seq = _scores(attn, _inputs(2, False))
    picks, ties = _engine_side(per_seq, drop=(13,))  # row 13 of each sequence not sent
    dsap.topk_metrics(torch.nn.ModuleList([attn]))
    with dsap.engine_topk(pack_tie_rows(ties, [SEQ, SEQ], seq_len=SEQ)):
        out = run_attention(attn, _inputs(2, False))
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/replayed_rows"] == 2  # row 10 of each sequence
    assert m["dsa_topk/layer_01/tied_rows"] == 4
    assert m["dsa_topk/layer_01/undecided_rows"] == 2
    # The engine broke row 13's ties at random, training toward the lower keys: they differ.
    own = [sorted(range(TOPK))] * 2
    engine_13 = [sorted(p[13].tolist()) for p in picks]
    assert engine_13 != own
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 2
    # Row 13 kept the layer's own picks: the output there is the computing layer's.
    plain = run_attention(computing, _inputs(2, False))
    assert torch.equal(out[13], plain[13])


def test_without_ties_nothing_is_sent_and_the_layer_keeps_its_own_picks():
    attn = make_attention(make_config(dsa_indexer_topk_source="replay_ties", **FP8))
    computing = make_attention(make_config(**FP8))
    per_seq = _scores(attn, _inputs(2, False, zeroed=()))
    _, ties = _engine_side(per_seq)
    assert all(t[1].rows.numel() == 0 for t in ties)
    dsap.topk_metrics(torch.nn.ModuleList([attn]))
    with dsap.engine_topk(pack_tie_rows(ties, [SEQ, SEQ], seq_len=SEQ)):
        out = run_attention(attn, _inputs(2, False, zeroed=()))
    assert torch.equal(out, run_attention(computing, _inputs(2, False, zeroed=())))
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/replayed_rows"] == 0
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_01/digest_compared_rows"] == 2 * (SEQ - 1)


def test_replay_ties_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match=r"replay_ties.*dsa_indexer_scoring_precision='fp8'"):
        make_config(dsa_indexer_topk_source="replay_ties")
    attn = make_attention(make_config(dsa_indexer_topk_source="replay_ties", **FP8))
    with pytest.raises(RuntimeError, match="'replay_ties' needs the engine's picks"):
        run_attention(attn, _inputs(2, False))
    # Every row's picks (no tied rows): replay_ties needs pack_tie_rows' form.
    with dsap.engine_topk({1: torch.zeros(2 * SEQ, 1, dtype=torch.int32)}, seq_len=SEQ):
        with pytest.raises(ValueError, match=r"not the engine's tied rows.*pack_tie_rows"):
            run_attention(attn, _inputs(2, False))
    # Tied rows to a replaying layer: replay needs every row.
    per_seq = _scores(attn, _inputs(2, False))
    _, ties = _engine_side(per_seq)
    replaying = make_attention(make_config(dsa_indexer_topk_source="replay", **FP8))
    with dsap.engine_topk(pack_tie_rows(ties, [SEQ, SEQ], seq_len=SEQ)):
        with pytest.raises(ValueError, match=r"tied rows only.*'replay_ties'"):
            run_attention(replaying, _inputs(2, False))


def test_tied_rows_are_checked_where_they_enter():
    per_seq = [torch.zeros(SEQ, SEQ).masked_fill(torch.ones(SEQ, SEQ).triu(1).bool(), -torch.inf)]
    _, ties = _engine_side(per_seq)
    picks = pack_tie_rows(ties, [SEQ])
    late = dict(picks.sent)
    late[1] = late[1].flip(0)  # not ascending
    with pytest.raises(ValueError, match="ascending, distinct and in"):
        with dsap.engine_topk(dataclasses.replace(picks, sent=late)):
            pass
    future = {1: picks.indices[1].clone()}
    future[1][0, 0] = SEQ  # a key past the row's position
    with pytest.raises(ValueError, match="causal"):
        with dsap.engine_topk(dataclasses.replace(picks, indices=future)):
            pass
    missing = TopkPicks(picks.indices, TokenLayout(seq_len=SEQ), digests=None, sent=picks.sent)
    with pytest.raises(ValueError, match="the three for the same layers"):
        with dsap.engine_topk(missing):
            pass


def test_verify_tells_tied_rows_from_strict_ones():
    """verify with the engine's picks of planted ties (another valid top-k of the zeroed rows)
    and one strict row changed (a key below its k-th score taken): the monitor counts the first
    as flipped on a tied boundary, the second as flipped on a strict one (precision)."""
    attn = make_attention(make_config(dsa_indexer_topk_source="verify", **FP8))
    per_seq = _scores(attn, _inputs(2, False))
    picks = [_engine_topk(s, TOPK, seed=11 + i) for i, s in enumerate(per_seq)]
    own = [indexer_topk(s, TOPK) for s in per_seq]  # the layer's own rule, ties to the lower key
    engine, mine = torch.cat(picks).sort(-1).values, torch.cat(own).sort(-1).values
    tied = int((engine != mine).any(-1).sum())
    assert tied > 0  # the zeroed rows broke their ties another way
    engine = torch.cat(picks)
    row = 15  # sequence 0, position 15: strict boundary (not a zeroed row)
    unpicked = sorted(set(range(16)) - set(engine[row].tolist()))
    engine[row, 0] = unpicked[0]
    dsap.topk_metrics(torch.nn.ModuleList([attn]))
    with dsap.engine_topk({1: engine}, seq_len=SEQ):
        run_attention(attn, _inputs(2, False))
    m = dsap.topk_metrics(torch.nn.ModuleList([attn]))
    assert m["dsa_topk/layer_01/flipped_tied_rows"] == tied
    assert m["dsa_topk/layer_01/flipped_precision_rows"] == 1
