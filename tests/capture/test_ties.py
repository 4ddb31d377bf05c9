"""The engine side of the tie replay (``dsa_precision.capture.ties``): what it sends, its frame,
and the packing into one micro-batch, against direct computations in the test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_precision import indexer_topk
from dsa_precision.capture import (
    TieRows,
    digest_row_reference,
    digest_rows,
    engine_tie_rows,
    pack_tie_rows,
)

K = 4


def _causal(scores: torch.Tensor) -> torch.Tensor:
    n = scores.shape[0]
    return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


def _engine_picks(scores: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """A valid top-k of every row with ties broken at random (an engine kernel's freedom)."""
    noise = torch.rand(scores.shape, generator=gen)
    order = noise.argsort(-1)
    by_score = torch.sort(scores.gather(-1, order), dim=-1, descending=True, stable=True).indices
    idx = order.gather(-1, by_score)[:, :k]
    lengths = (scores > float("-inf")).sum(-1)
    return torch.where(torch.arange(k) < lengths[:, None], idx, -1).to(torch.int32)


def test_a_set_holding_a_key_twice_is_sent_and_its_frame_refused():
    # Row 0 is a strict top-2 (keys 0, 1); row 1 repeats key 0 (what LMDeploy's bitonic_topk
    # returns on equal scores): its margin is positive (key 0's score over everything left out)
    # but it is no top-k, so it is sent, and the frame names it.
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0], [4.0, 3.0, 1.0, 0.0]])
    picks = torch.tensor([[0, 1], [0, 0]], dtype=torch.int32)
    frame = engine_tie_rows(logits, picks, torch.tensor([4, 4]))
    assert frame.rows.tolist() == [1] and frame.picks.tolist() == [[0, 0]]
    with pytest.raises(ValueError, match=r"row 1 holds a key twice .*bitonic_topk.*TileLang"):
        frame.to_bytes()
    assert engine_tie_rows(logits[:1], picks[:1], torch.tensor([4])).to_bytes()  # a valid set


@settings(max_examples=60, deadline=None)
@given(st.integers(5, 24), st.integers(0, 2**31 - 1), st.sampled_from([2, 3, 6]))
def test_the_rows_sent_are_the_rows_whose_boundary_ties(n, seed, levels):
    gen = torch.Generator().manual_seed(seed)
    scores = _causal(torch.randint(0, levels, (n, n), generator=gen).float())
    picks = _engine_picks(scores, K, gen)
    lengths = torch.arange(1, n + 1)
    frame = engine_tie_rows(scores, picks, lengths)
    tied = []
    for r in range(n):
        visible = sorted(scores[r, : r + 1].tolist(), reverse=True)
        if len(visible) > K and visible[K - 1] == visible[K]:
            tied.append(r)
    assert frame.rows.tolist() == tied
    assert torch.equal(frame.picks, picks[tied])
    assert frame.digests.tolist() == [digest_row_reference(p) for p in picks.tolist()]
    # Training's own exact picks with the sent rows replaced are the engine's, row for row.
    merged = indexer_topk(scores, K, seq_lens=lengths)
    merged[frame.rows] = frame.picks
    assert torch.equal(digest_rows(merged), digest_rows(picks))


def test_windows_of_compressed_logits_are_read_from_their_start():
    # Two rows in one logits buffer, each row's keys from its own column (vLLM's prefill ks).
    logits = torch.tensor([[5.0, 1.0, 1.0, 0.0, 9.0], [9.0, 9.0, 3.0, 2.0, 2.0]])
    picks = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)  # keys (row-relative)
    starts, lengths = torch.tensor([0, 2]), torch.tensor([3, 3])
    frame = engine_tie_rows(logits, picks, lengths, starts=starts)
    # Row 0: keys 0..2 = 5, 1, 1 -> {0, 1} ties with key 2; row 1: keys 0..2 = 3, 2, 2 -> tie.
    assert frame.rows.tolist() == [0, 1]
    frame = engine_tie_rows(logits, picks, torch.tensor([2, 3]), starts=starts)
    assert frame.rows.tolist() == [1]  # row 0 sees two keys: nothing left out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["delta", "int32"]),
)
def test_frames_round_trip_and_refuse_any_damage(n, k, seed, fmt):
    gen = torch.Generator().manual_seed(seed)
    digests = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    rows = (
        torch.randperm(n, generator=gen)[: torch.randint(0, n + 1, (), generator=gen)].sort().values
    )
    picks = (
        torch.stack([torch.randperm(64, generator=gen)[:k] for _ in range(rows.numel())])
        if rows.numel()
        else torch.zeros(0, k, dtype=torch.int64)
    )
    frame = TieRows(digests, rows, picks.to(torch.int32))
    raw = frame.to_bytes(fmt)
    back = TieRows.from_bytes(raw)
    assert torch.equal(back.digests, digests) and torch.equal(back.rows, rows)
    assert torch.equal(back.picks.sort(-1).values, frame.picks.sort(-1).values)
    at = int(torch.randint(0, len(raw), (), generator=gen))
    damaged = bytearray(raw)
    damaged[at] ^= 1 << int(torch.randint(0, 8, (), generator=gen))
    with pytest.raises(ValueError):
        TieRows.from_bytes(bytes(damaged))
    with pytest.raises(ValueError):
        TieRows.from_bytes(raw[:-1])
    with pytest.raises(ValueError):
        TieRows.from_bytes(raw + b"\0")


def test_split_and_cat_follow_the_rows():
    frame = TieRows(
        torch.arange(10), torch.tensor([1, 4, 5, 9]), torch.arange(8, dtype=torch.int32).view(4, 2)
    )
    parts = frame.split([3, 0, 5, 2])
    assert [p.rows.tolist() for p in parts] == [[1], [], [1, 2], [1]]
    assert [p.digests.tolist() for p in parts] == [[0, 1, 2], [], [3, 4, 5, 6, 7], [8, 9]]
    back = TieRows.cat(parts)
    assert torch.equal(back.rows, frame.rows) and torch.equal(back.picks, frame.picks)
    with pytest.raises(ValueError, match="add up to 9"):
        frame.split([4, 5])


def test_packing_places_each_requests_rows():
    a = TieRows(torch.arange(4), torch.tensor([2]), torch.tensor([[0, 1]], dtype=torch.int32))
    b = TieRows(
        torch.arange(10, 16),
        torch.tensor([0, 5]),
        torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
    )
    picks = pack_tie_rows({"b": {3: b}, "a": {3: a}}, {"a": 5, "b": 6}, order=["a", "b"])
    assert picks.sent[3].tolist() == [2, 5, 10]  # a's row 2; b's rows 0 and 5 after a's 5
    assert picks.indices[3].tolist() == [[0, 1], [0, -1], [1, 2]]
    assert picks.digests[3].tolist() == [0, 1, 2, 3, 0, 10, 11, 12, 13, 14, 15]
    assert picks.engine_rows.tolist() == [True] * 4 + [False] + [True] * 6
    assert picks.cu_seqlens.tolist() == [0, 5, 11] and picks.request_ids == ("a", "b")


@pytest.mark.parametrize(
    "requests, lens, kw, match",
    [
        ([{1: "x"}], [3], {}, "expected TieRows"),
        ([{1: None}, {}], [3, 3], {}, "expected TieRows"),
        ([{}], [3], {}, r"expected \{layer_number: TieRows\}"),
        ("two", [3], {}, "mapping"),
        ([{1: 0}], [3], {}, "expected TieRows"),
        ("pair", [3, 3], dict(seq_len=4), "request 0 has 3 tokens"),
        ("pair", [3, 4], {}, "layers"),
        ("k", [3, 3], {}, "different k"),
        ("pair", [3], {}, "seq_lens|request"),
    ],
)
def test_packing_refuses_what_does_not_fit(requests, lens, kw, match):
    one = TieRows(
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 2, dtype=torch.int32),
    )
    if requests == "pair":
        requests = [{1: one}, {1: one} if lens != [3, 4] else {2: one}]
    elif requests == "k":
        other = TieRows(one.digests, one.rows, torch.zeros(0, 3, dtype=torch.int32))
        requests = [{1: one}, {1: other}]
    elif requests == "two":
        requests = 2
    with pytest.raises((TypeError, ValueError), match=match):
        pack_tie_rows(requests, lens, **kw)


def test_bad_frames_and_calls_are_named():
    with pytest.raises(TypeError, match="digests"):
        TieRows(
            torch.zeros(3), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="ascending, distinct"):
        TieRows(
            torch.zeros(3, dtype=torch.int64),
            torch.tensor([2, 1]),
            torch.zeros(2, 2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="one row of k >= 1 picks per row sent"):
        TieRows(
            torch.zeros(3, dtype=torch.int64),
            torch.tensor([1]),
            torch.zeros(2, 2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="not a tie-rows frame"):
        TieRows.from_bytes(b"DSAPICK1" + bytes(40))
    with pytest.raises(TypeError, match=r"picks: expected \(2, k\)"):
        engine_tie_rows(
            torch.zeros(2, 3),
            torch.zeros(3, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int64),
        )
    with pytest.raises(TypeError, match=r"lengths: expected \(2,\) integers"):
        engine_tie_rows(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2))


def test_tied_rows_are_not_a_replay_file(tmp_path):
    from dsa_precision.capture import save_picks

    one = TieRows(
        torch.zeros(3, dtype=torch.int64), torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match=r"tied rows only .*TieRows.to_bytes"):
        save_picks(tmp_path / "p.pt", pack_tie_rows([{1: one}], [3]))
    assert not (tmp_path / "p.pt").exists()


def test_a_damaged_frame_names_its_source_and_wide_keys_are_refused_before_the_cast():
    frame = TieRows(torch.arange(4), torch.tensor([2]), torch.tensor([[0, 1]], dtype=torch.int32))
    raw = bytearray(frame.to_bytes())
    raw[40] ^= 1  # a digest byte
    with pytest.raises(ValueError, match=r"^vllm request 'a' layer 3: tie-rows frame is damaged"):
        TieRows.from_bytes(bytes(raw), source="vllm request 'a' layer 3")
    logits = torch.tensor([[1.0, 1.0, 0.0]])
    picks = torch.tensor([[0, 2**32 + 1]])  # would wrap to key 1 in int32
    with pytest.raises(ValueError, match=r"engine_tie_rows picks: row 0 .*holds 4294967297"):
        engine_tie_rows(logits, picks, torch.tensor([3]))
