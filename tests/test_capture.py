"""Capture adapters, compact format and digest, on synthetic outputs laid out as the engines'
sources produce them (docs/capture.md gives each layout and its source).

References: the picks the synthetic engine output was built from (known rows), the shared
:meth:`TokenLayout.validate_indices`, and the pure-Python digest reference.
"""

import base64
import io
import json

import numpy as np
import pytest
import torch

from dsa_precision.capture import (
    FORMATS,
    VllmStep,
    decode_picks,
    digest_mismatches,
    digest_row_reference,
    digest_rows,
    encode_picks,
    from_sglang,
    from_vllm,
    from_vllm_steps,
    load_engine_output,
    pack_requests,
)
from dsa_precision.picks import TokenLayout

K = 8


def causal_picks(seq: int, k: int = K, seed: int = 0) -> torch.Tensor:
    """``(seq, k)`` int32: row ``i`` holds min(k, i + 1) distinct keys in ``[0, i]`` in a random
    order, ``-1`` after them (the engines' top-k of a causal row)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(seq):
        n = min(k, i + 1)
        keys = torch.randperm(i + 1, generator=g)[:n]
        rows.append(torch.cat((keys, torch.full((k - n,), -1))))
    return torch.stack(rows).to(torch.int32)


def engine_rows(seq: int, layers: int, seed: int, freq: int = 1) -> torch.Tensor:
    """``(seq, layers, k)``: every layer its own picks; with ``freq=2``, SGLang's sharing: layer
    ids 2, 4, ... (0-based) copy layer id - 1 (test_return_indexer_topk.py)."""
    out = torch.stack([causal_picks(seq, seed=seed * 100 + n) for n in range(layers)], dim=1)
    if freq == 2:
        for n in range(2, layers, 2):
            out[:, n] = out[:, n - 1]
    return out


def sglang_response(full: torch.Tensor, completion: int = 3) -> dict:
    """A /generate response: rows of every token but the last, base64 little-endian int32."""
    rows = full[:-1].numpy().astype("<i4")
    return {
        "text": "...",
        "meta_info": {
            "prompt_tokens": full.shape[0] - completion,
            "completion_tokens": completion,
            "indexer_topk": base64.b64encode(rows.tobytes()).decode("ascii"),
            "indexer_topk_num_layers": full.shape[1],
        },
    }


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array.astype(np.int32))
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --- SGLang -------------------------------------------------------------------------------------


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


# --- requests accounted for ---------------------------------------------------------------------


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


# --- vLLM ---------------------------------------------------------------------------------------


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


def _vllm_step(requests, starts, lengths, full, stale=7, kept=None):
    """One step's buffer as sparse_attn_indexer leaves it: rows of the scheduled tokens in batch
    order (query_start_loc), then stale rows from earlier, larger steps."""
    qsl = np.cumsum([0, *lengths]).tolist()
    buffers = {}
    for n in (1, 2):
        rows = [
            full[r][s : s + ln, n - 1] for r, s, ln in zip(requests, starts, lengths, strict=True)
        ]
        stale_rows = torch.full((stale, K + 4), 12345, dtype=torch.int32)  # wider, stale
        body = torch.nn.functional.pad(torch.cat(rows), (0, 4), value=-1)
        buffers[n] = torch.cat((body, stale_rows))
    return VllmStep(requests, qsl, starts, buffers, kept_rows=kept)


def test_vllm_steps_stitch_chunked_prefill_decode_and_speculation():
    full = {"x": engine_rows(10, 2, seed=11), "y": engine_rows(6, 2, seed=12)}
    steps = [
        _vllm_step(["x"], [0], [4], full),  # chunked prefill, chunk 1
        _vllm_step(["y", "x"], [0, 4], [4, 3], full),  # y prefill; x chunk 2
        # decode first: y verifies 1 + 2 drafts, accepts 1 (keeps 2 rows); x decodes 1
        _vllm_step(["x", "y"], [7, 4], [1, 3], full, kept=[1, 2]),
        _vllm_step(["x"], [8], [1], full),
    ]
    out = from_vllm_steps(steps, {"x": 10, "y": 6}, topk=K, order=["x", "y"])
    assert out.cu_seqlens.tolist() == [0, 10, 16]
    assert torch.equal(out.indices[2][:9], full["x"][:9, 1])
    assert torch.equal(out.indices[1][10:16], full["y"][:, 0])  # y's rows cover every token


def test_vllm_prefix_cache_hit_is_named():
    full = {"x": engine_rows(10, 2, seed=13)}
    steps = [_vllm_step(["x"], [4], [5], full)]  # 4 cached tokens: no rows for them
    with pytest.raises(ValueError, match=r"request 'x': positions 0..3 have no rows .*prefix"):
        from_vllm_steps(steps, {"x": 10}, topk=K)


# --- files for agree ----------------------------------------------------------------------------


def test_load_engine_output_reads_saved_responses(tmp_path):
    fulls = [engine_rows(6, 2, seed=14), engine_rows(5, 2, seed=15)]
    path = tmp_path / "sglang.jsonl"
    path.write_text("\n".join(json.dumps(sglang_response(f)) for f in fulls))
    picks = load_engine_output(path, engine="sglang")
    layers = picks.indices
    assert picks.cu_seqlens.tolist() == [0, 6, 11]
    assert torch.equal(layers[2][:5], fulls[0][:5, 1])
    vllm = tmp_path / "vllm.json"
    vllm.write_text(
        json.dumps(
            [
                {
                    "choices": [{"indexer_topk": npy_b64(f[:-1].numpy())}],
                    "usage": {"prompt_tokens": f.shape[0] - 2, "completion_tokens": 2},
                }
                for f in fulls
            ]
        )
    )
    picks_v = load_engine_output(vllm, engine="vllm")
    assert torch.equal(picks_v.cu_seqlens, picks.cu_seqlens)
    assert all(torch.equal(picks_v.indices[n], layers[n]) for n in (1, 2))
    with pytest.raises(ValueError, match=r"vllm.json: .*request 1: 4 rows"):
        broken = json.loads(vllm.read_text())
        broken[1]["usage"]["completion_tokens"] = 5
        vllm.write_text(json.dumps(broken))
        load_engine_output(vllm, engine="vllm")
    with pytest.raises(ValueError, match=r"engine='lmdeploy'"):
        load_engine_output(path, engine="lmdeploy")


# --- compact format -----------------------------------------------------------------------------


def _as_set(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t < 0, 2**40, t.to(torch.int64)).sort(-1).values


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_round_trip_is_exact(fmt):
    idx = causal_picks(200, k=16, seed=16)
    idx[50] = -1  # an empty row
    idx[70, 3:] = -1  # a short row
    packed = encode_picks(idx, fmt, rows_per_chunk=33)  # chunk boundaries inside the stream
    back = decode_picks(packed)
    assert back.dtype == torch.int32 and back.shape == idx.shape
    if fmt == "delta":  # the same set, sorted, padding last
        assert torch.equal(_as_set(back), _as_set(idx))
        assert torch.equal(back, torch.where(_as_set(idx) >= 2**40, -1, _as_set(idx)).int())
    else:  # order preserved
        assert torch.equal(back, idx)


def test_delta_handles_long_sequences_and_saves_bytes():
    seq, k = 70000, 64
    g = torch.Generator().manual_seed(17)
    rows = torch.arange(seq - 300, seq)  # late rows of a 70k-token sequence
    picks = torch.stack([torch.randperm(int(r) + 1, generator=g)[:k] for r in rows[:40]])
    picks[:, 0] = rows[:40]  # the token itself, position > 65535
    packed = encode_picks(picks, "delta")
    assert torch.equal(_as_set(decode_picks(packed)), _as_set(picks))
    assert packed.nbytes < encode_picks(picks, "int32").nbytes * 0.6
    with pytest.raises(ValueError, match=r"format='int16' holds keys up to 32767"):
        encode_picks(picks, "int16")


def test_delta_rows_that_pick_every_key_cost_no_payload():
    idx = causal_picks(8, k=8)  # row i picks all of 0..i: every gap is 0
    packed = encode_picks(idx, "delta")
    assert packed.width.tolist() == [0] * 8 and packed.data.numel() == 1  # the slack word only


def test_encode_rejects_bad_keys():
    with pytest.raises(ValueError, match=r"picks hold -2"):
        encode_picks(torch.tensor([[0, -2]]), "delta")
    with pytest.raises(TypeError, match=r"\(T, k\) int16/int32/int64"):
        encode_picks(torch.zeros(3, 2), "delta")


def test_delta_encode_rejects_a_repeated_key_instead_of_shifting_the_row():
    """A repeated key is a -1 gap: encoded, it decoded as other keys ([3, 3, 5] -> [3, 7, 8])."""
    idx = causal_picks(40, k=6)
    idx[37, 1] = idx[37, 0]
    with pytest.raises(ValueError, match=r"indices: row 37 repeats a key"):
        encode_picks(idx, "delta", rows_per_chunk=16)


# --- digest -------------------------------------------------------------------------------------


def test_digest_matches_the_reference_and_ignores_order_and_padding():
    idx = causal_picks(64, k=16, seed=18).to(torch.int64)
    idx[7] = -1
    d = digest_rows(idx)
    assert d.dtype == torch.int64 and d.shape == (64,)
    assert d.tolist() == [digest_row_reference(r) for r in idx.tolist()]
    shuffled = idx[:, torch.randperm(16, generator=torch.Generator().manual_seed(1))]
    assert torch.equal(digest_rows(shuffled.to(torch.int32)), d)  # order and dtype don't matter
    assert digest_row_reference([]) == 0 == int(d[7])
    # Large keys, and values whose SplitMix products overflow int64 (wraparound arithmetic).
    big = torch.tensor([[2**31 - 1, 65536, 0, -1]])
    assert digest_rows(big).tolist() == [digest_row_reference([2**31 - 1, 65536, 0])]
    assert digest_row_reference([1, 2]) != digest_row_reference([3])  # not just a count


def test_digest_mismatches_counts_rows_per_layer():
    ours = {1: causal_picks(32, seed=19), 3: causal_picks(32, seed=20)}
    engine = {n: digest_rows(t) for n, t in ours.items()}
    changed = ours[3].clone()
    changed[[9, 20], 0] = torch.tensor([-1, -1], dtype=torch.int32)  # two rows lose a key
    masks = digest_mismatches({1: ours[1], 3: changed}, engine)
    assert int(masks[1].sum()) == 0
    assert masks[3].nonzero().flatten().tolist() == [9, 20]
    with pytest.raises(ValueError, match=r"layers differ"):
        digest_mismatches({1: ours[1]}, engine)


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
    steps = [_vllm_step(["x"], [0], [5], full), _vllm_step(["x"], [3], [4], full)]
    with pytest.raises(ValueError, match=r"request 'x': positions 3..4 have rows twice"):
        from_vllm_steps(steps, {"x": 8}, topk=K)


def test_shared_layers_must_name_engine_layers():
    rows = [engine_rows(4, 2, seed=23)[:-1]]
    with pytest.raises(ValueError, match=r"shared=\{2: 5\}: both must be engine layers"):
        pack_requests(rows, [4], shared={2: 5})


def test_capture_imports_no_megatron():
    import subprocess
    import sys

    code = "import sys, dsa_precision.capture; print(any(m.startswith('megatron') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_vllm_step_buffers_and_kept_rows_are_checked():
    full = {"x": engine_rows(8, 2, seed=24)}
    step = _vllm_step(["x"], [0], [5], full, stale=0)
    short = VllmStep(["x"], [0, 5], [0], {n: b[:4] for n, b in step.buffers.items()})
    with pytest.raises(
        ValueError, match=r"layer 1: buffer \(4, 12\) holds fewer than the step's 5"
    ):
        from_vllm_steps([short], {"x": 8}, topk=K)
    with pytest.raises(ValueError, match=r"request 'x': kept_rows=6 but 5 rows"):
        from_vllm_steps([_vllm_step(["x"], [0], [5], full, kept=[6])], {"x": 8}, topk=K)


def test_first_rows_must_cover_every_request():
    rows = {"a": engine_rows(4, 1, seed=25)[:-1]}
    with pytest.raises(ValueError, match=r"first_rows has no entry for request\(s\) \['a'\]"):
        pack_requests(rows, {"a": 4}, first_rows=[0])


def test_engine_digests_verify_training_picks_without_the_payload():
    from dsa_precision.capture import pack_digests

    fulls = {"a": engine_rows(7, 2, seed=26), "b": engine_rows(5, 2, seed=27)}
    # Engine side: digest each request's rows (every token but the last), per layer.
    engine = {r: digest_rows(f[:-1]) for r, f in fulls.items()}  # (n, L) int64
    digests, ran = pack_digests(engine, {"a": 7, "b": 5}, order=["b", "a"])
    assert ran.tolist() == [True] * 4 + [False] + [True] * 6 + [False]
    # Training side: its own picks of the packed micro-batch, one row off in layer 2.
    ours = {n: torch.cat([fulls["b"][:, n - 1], fulls["a"][:, n - 1]]) for n in (1, 2)}
    ours[2] = ours[2].clone()
    ours[2][7, 0] = -1  # request a, token 2 loses a key
    masks = digest_mismatches(ours, digests, ran)
    assert int(masks[1].sum()) == 0  # the last tokens (digest 0 vs a real set) are not counted
    assert masks[2].nonzero().flatten().tolist() == [7]
    with pytest.raises(ValueError, match=r"request 'a': 6 digest rows .* 5 tokens"):
        pack_digests(engine, {"a": 5, "b": 5})


def test_select_all_rows_need_an_explicit_future_keys_drop():
    seq = 5  # shorter than k: a dense "select all" output lists every key of the sequence
    rows = torch.arange(seq).repeat(seq - 1, 1)  # row i: 0..4, keys past i included
    rows = torch.nn.functional.pad(rows, (0, K - seq), value=-1)[:, None].to(torch.int32)
    with pytest.raises(ValueError, match=r"row 0 \(request 0 token 0, position 0"):
        pack_requests([rows], [seq])
    out = pack_requests([rows], [seq], future_keys="drop")
    assert out.indices[1][2].tolist() == [0, 1, 2] + [-1] * (K - 3)  # causal, pads last
    assert out.indices[1][4].tolist() == [-1] * K  # the last token: never run


def test_load_engine_output_names_bad_files(tmp_path):
    with pytest.raises(ValueError, match=r"engine outputs are .json or .jsonl responses"):
        load_engine_output(tmp_path / "x.pt", engine="sglang")
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"x.json: not JSON"):
        load_engine_output(bad, engine="sglang")
    bad.write_text(json.dumps([{"choices": [{}, {}]}]))
    with pytest.raises(ValueError, match=r"response 0: expected one choice"):
        load_engine_output(bad, engine="vllm")


def test_agree_reads_an_engine_output_through_the_adapters(tmp_path, capsys):
    """``agree --infer-format sglang``: the engine's responses against training's replay file of
    the same packed requests; one swapped pick in layer 2 fails the gate there, and only there."""
    from dsa_precision import cli
    from dsa_precision.capture import TopkPicks, save_picks

    fulls = [engine_rows(6, 2, seed=16), engine_rows(5, 2, seed=17)]
    infer = tmp_path / "sglang.jsonl"
    infer.write_text("\n".join(json.dumps(sglang_response(f)) for f in fulls))
    engine = load_engine_output(infer, engine="sglang")
    layers, cu = engine.indices, engine.cu_seqlens
    train = tmp_path / "train.pt"
    save_picks(train, engine)
    args = ["agree", "--train", train, "--infer", infer, "--infer-format", "sglang", "--json"]
    assert cli.main([str(a) for a in args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["configs"]] == ["layer 1", "layer 2", "all"]
    assert all(c["rows_identical"] == 1.0 for c in report["configs"])
    changed = {n: t.clone() for n, t in layers.items()}
    row = int(cu[1]) + 3  # request 1, position 3 (its last token has no picks)
    changed[2][row, 0] = -1
    save_picks(train, TopkPicks(changed, engine.layout))
    assert cli.main([str(a) for a in [*args, "--min-agreement", "1.0"]]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == ["layer 2", "all"]
    infer.write_text("not json")
    assert cli.main([str(a) for a in args]) == 2
    assert "--infer-format sglang" in capsys.readouterr().err


def test_token_layout_check_rows_is_the_row_count_rule_of_picks_and_digests():
    """One row-count rule for picks (check_indices) and engine digests (replay): BSHD a whole
    number of sequences, THD with host cu_seqlens exactly cu_seqlens[-1] rows, the fix named."""
    bshd = TokenLayout(seq_len=4)
    bshd.check_rows("d", 8)
    with pytest.raises(ValueError, match=r"d: 6 token rows are not a whole number .* seq_len=4"):
        bshd.check_rows("d", 6)
    thd = TokenLayout(cu_seqlens=torch.tensor([0, 3, 5]))
    thd.check_rows("d", 5)
    with pytest.raises(ValueError, match=r"d: 6 token rows but cu_seqlens ends at 5; pass five"):
        thd.check_rows("d", 6, fix="pass five")
    with pytest.raises(ValueError, match=r"ends at 5; the picks must hold one row per packed"):
        thd.check_indices("picks", torch.zeros(6, 2, dtype=torch.int32))
