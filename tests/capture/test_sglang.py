"""SGLang's return_indexer_topk (/generate meta_info) into TopkPicks: the packed micro-batch, sharing, and errors naming the request, layer and row."""

import pytest
import torch

from dsa_precision.capture import (
    from_sglang,
)
from dsa_precision.picks import TokenLayout

from ..support.engine_outputs import K, causal_picks, engine_rows, sglang_response


def test_sglang_responses_become_the_packed_micro_batch():
    fulls = [engine_rows(11, 3, seed=1), engine_rows(6, 3, seed=2)]
    out = from_sglang([sglang_response(f) for f in fulls])
    assert out.cu_seqlens.tolist() == [0, 11, 17]
    assert sorted(out.indices) == [1, 2, 3]
    layout = TokenLayout(cu_seqlens=out.cu_seqlens)
    for n in (1, 2, 3):
        idx = out.indices[n]
        assert idx.dtype == torch.int32 and idx.shape == (17, K)
        layout.validate_indices(f"layer {n}", idx)
        # Every token but each sequence's last is the engine's row, unchanged.
        assert torch.equal(idx[:10], fulls[0][:10, n - 1])
        assert torch.equal(idx[11:16], fulls[1][:5, n - 1])
        assert (idx[10] == -1).all() and (idx[16] == -1).all()  # never run: empty
    assert out.engine_rows.tolist() == [True] * 10 + [False] + [True] * 5 + [False]


def test_sglang_last_row_self_attends_its_own_position():
    out = from_sglang([sglang_response(engine_rows(5, 1, seed=3))], last_row="self")
    assert out.indices[1][4].tolist() == [4] + [-1] * (K - 1)


def test_sglang_index_sharing_is_checked_and_dropped():
    full = engine_rows(9, 5, seed=4, freq=2)  # engine layers 3, 5 (1-based) copy 2, 4
    out = from_sglang([sglang_response(full)], shared={3: 2, 5: 4})
    assert sorted(out.indices) == [1, 2, 4]
    broken = full.clone()
    broken[6, 4] = causal_picks(9, seed=99)[6]
    with pytest.raises(ValueError, match=r"layer 5: row 6 \(request 0 token 6\) differs from its "):
        from_sglang([sglang_response(broken)], shared={3: 2, 5: 4})


def test_sglang_errors_name_request_layer_and_row():
    full = engine_rows(7, 2, seed=5)
    bad = full.clone()
    bad[3, 1, 0] = 5  # token 3 picks key 5: not causal
    with pytest.raises(ValueError, match=r"sglang layer 2: row 10 \(request 'b' token 3, pos"):
        from_sglang({"a": sglang_response(engine_rows(7, 2, seed=6)), "b": sglang_response(bad)})
    dup = full.clone()
    dup[5, 0, 1] = dup[5, 0, 0]
    with pytest.raises(ValueError, match=r"sglang layer 1: row 5 \(request 0 token 5\) repeats"):
        from_sglang([sglang_response(dup)])


def test_sglang_row_count_must_match_the_tokens():
    response = sglang_response(engine_rows(7, 2, seed=7))
    response["meta_info"]["completion_tokens"] += 1  # the trainer's sequence is one longer
    with pytest.raises(ValueError, match=r"not a whole number|6 rows from position 0"):
        from_sglang([response])
    with pytest.raises(ValueError, match=r"--enable-return-indexer-topk"):
        from_sglang([{"meta_info": {"prompt_tokens": 3, "completion_tokens": 1}}])
