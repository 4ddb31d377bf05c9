"""pack_requests: per-request engine rows into one packed micro-batch, every request accounted for, layers and coverage checked."""

import pytest
import torch

from dsa_precision.capture import (
    pack_requests,
)

from ..support.engine_outputs import K, engine_rows


def test_every_request_is_accounted_for():
    rows = {"a": engine_rows(4, 1, seed=8)[:-1], "b": engine_rows(5, 1, seed=9)[:-1]}
    lens = {"a": 4, "b": 5}
    out = pack_requests(rows, lens, order=["b", "a"])
    assert out.request_ids == ("b", "a") and out.cu_seqlens.tolist() == [0, 5, 9]
    assert torch.equal(out.indices[1][:4], rows["b"][:, 0])
    with pytest.raises(ValueError, match=r"no rows for request\(s\) \['c'\]"):
        pack_requests(rows, lens | {"c": 3}, order=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"rows for request\(s\) \['b'\] that the micro-batch"):
        pack_requests(rows, lens, order=["a"])
    with pytest.raises(ValueError, match=r"request 'a': 3 rows from position 0 .* 6 tokens"):
        pack_requests(rows, {"a": 6, "b": 5})
    with pytest.raises(ValueError, match=r"seq_lens has no length for request\(s\) \['b'\]"):
        pack_requests(rows, {"a": 4})


def test_layer_axes_must_agree():
    rows = [engine_rows(4, 2, seed=1)[:-1], engine_rows(4, 3, seed=2)[:-1]]
    with pytest.raises(ValueError, match=r"request 1: \(3, 8\) \(layers, k\) but request 0"):
        pack_requests(rows, [4, 4])
    with pytest.raises(ValueError, match=r"more than topk=4"):
        pack_requests(rows[:1], [4], topk=4)


def test_shared_layers_must_name_engine_layers():
    rows = [engine_rows(4, 2, seed=23)[:-1]]
    with pytest.raises(ValueError, match=r"shared=\{2: 5\}: both must be engine layers"):
        pack_requests(rows, [4], shared={2: 5})


def test_first_rows_must_cover_every_request():
    rows = {"a": engine_rows(4, 1, seed=25)[:-1]}
    with pytest.raises(ValueError, match=r"first_rows has no entry for request\(s\) \['a'\]"):
        pack_requests(rows, {"a": 4}, first_rows=[0])


def test_select_all_rows_need_an_explicit_future_keys_drop():
    seq = 5  # shorter than k: a dense "select all" output lists every key of the sequence
    rows = torch.arange(seq).repeat(seq - 1, 1)  # row i: 0..4, keys past i included
    rows = torch.nn.functional.pad(rows, (0, K - seq), value=-1)[:, None].to(torch.int32)
    with pytest.raises(ValueError, match=r"row 0 \(request 0 token 0, position 0"):
        pack_requests([rows], [seq])
    out = pack_requests([rows], [seq], future_keys="drop")
    assert out.indices[1][2].tolist() == [0, 1, 2] + [-1] * (K - 3)  # causal, pads last
    assert out.indices[1][4].tolist() == [-1] * K  # the last token: never run
