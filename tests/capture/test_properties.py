"""Property-based tests of every codec and adapter of ``dsa_precision.capture`` (Hypothesis: few
examples in CI, ``DSA_PRECISION_HYPOTHESIS=thorough`` for many).

- the compact formats round-trip any valid picks (any k, keys up to int32, empty rows, ``-1``
  padding anywhere), as objects and as bytes; every single-byte change, truncation and
  extension of a frame's bytes is refused;
- a row's digest is the pure-Python reference's, whatever the order of its keys;
- payloads laid out as the engines document them (SGLang's base64 int32, vLLM's base64 .npy and
  its per-step buffers) pack into exactly the picks they were built from, and a damaged payload
  raises ``ValueError`` / ``TypeError`` naming the request, never anything else.
"""

import base64
import io

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsa_precision.capture import (  # noqa: E402
    CompactPicks,
    VllmStep,
    decode_picks,
    digest_row_reference,
    digest_rows,
    encode_picks,
    from_sglang,
    from_vllm,
    from_vllm_steps,
    pack_requests,
)

from ..support.strategies import causal_requests, pick_rows  # noqa: E402


def _as_sets(picks: torch.Tensor) -> list[set[int]]:
    return [{int(v) for v in row if v >= 0} for row in picks]


def _formats(picks: torch.Tensor) -> list[str]:
    small = not picks.numel() or int(picks.max()) <= 32767
    return ["int32", "delta", *(["int16"] if small else [])]


@given(pick_rows())
def test_every_format_round_trips_any_valid_picks(picks):
    for fmt in _formats(picks):
        frame = encode_picks(picks, fmt)
        back = decode_picks(frame)
        assert back.shape == picks.shape and back.dtype == torch.int32
        if fmt == "delta":  # the same set per row, sorted, padding last
            assert _as_sets(back) == _as_sets(picks)
            assert all(
                row.tolist() == sorted(row.tolist(), key=lambda v: (v < 0, v)) for row in back
            )
        else:
            assert torch.equal(back, picks.to(torch.int32))
        again = CompactPicks.from_bytes(frame.to_bytes())
        assert torch.equal(decode_picks(again), back)


@given(pick_rows(max_rows=8, max_k=6, max_key=5000), st.data())
def test_every_single_byte_change_of_a_frame_is_refused(picks, data):
    for fmt in _formats(picks):
        raw = encode_picks(picks, fmt).to_bytes()
        at = data.draw(st.integers(0, len(raw) - 1), label="byte")
        flip = data.draw(st.integers(1, 255), label="xor")
        damaged = bytearray(raw)
        damaged[at] ^= flip
        with pytest.raises(ValueError, match=r"compact picks|CompactPicks|damaged|frame"):
            CompactPicks.from_bytes(bytes(damaged))


@given(pick_rows(max_rows=8, max_k=6, max_key=5000), st.data())
def test_every_truncation_and_extension_of_a_frame_is_refused(picks, data):
    for fmt in _formats(picks):
        raw = encode_picks(picks, fmt).to_bytes()
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
        with pytest.raises(ValueError, match=r"frame|truncated"):
            CompactPicks.from_bytes(raw[:cut])
        extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
        with pytest.raises(ValueError, match=r"extended"):
            CompactPicks.from_bytes(raw + extra)


@given(pick_rows(max_rows=6, max_k=6, max_key=200), st.data())
def test_a_frame_whose_payload_tensor_was_changed_is_refused_on_the_host(picks, data):
    frame = encode_picks(picks, "delta")
    words = frame.data.clone()
    at = data.draw(st.integers(0, words.numel() - 1))
    words[at] ^= data.draw(st.integers(1, 2**31 - 1))
    damaged = CompactPicks("delta", frame.shape, words, frame.width, frame.count,
                           bits=frame.bits, checksum=frame.checksum)  # fmt: skip
    with pytest.raises(ValueError, match="payload is damaged"):
        decode_picks(damaged)
    with pytest.raises(ValueError, match="payload is damaged"):
        damaged.to("meta")  # a frame leaves the host verified


@given(pick_rows(max_rows=10, max_k=10))
def test_a_rows_digest_is_the_references_in_any_key_order(picks):
    got = digest_rows(picks)
    assert got.tolist() == [digest_row_reference(row.tolist()) for row in picks]
    shuffled = picks[:, torch.randperm(picks.shape[1])] if picks.numel() else picks
    assert torch.equal(digest_rows(shuffled), got)


def _sglang_response(rows: torch.Tensor, completion: int = 1) -> dict:
    return {
        "meta_info": {
            "prompt_tokens": rows.shape[0] + 1 - completion,
            "completion_tokens": completion,
            "indexer_topk": base64.b64encode(rows.numpy().astype("<i4").tobytes()).decode(),
            "indexer_topk_num_layers": rows.shape[1],
        }
    }


def _npy_b64(rows: torch.Tensor, dtype: str = "<i4") -> str:
    buf = io.BytesIO()
    np.save(buf, rows.numpy().astype(dtype))
    return base64.b64encode(buf.getvalue()).decode()


def _packed(rows: list[torch.Tensor], layer: int) -> torch.Tensor:
    """The known picks of one layer, packed, each sequence's last row empty."""
    parts = []
    for r in rows:
        parts += [r[:, layer], torch.full((1, r.shape[2]), -1, dtype=torch.int32)]
    return torch.cat(parts)


@given(causal_requests())
def test_sglang_payloads_pack_into_the_picks_they_were_built_from(requests):
    rows, lens = requests
    k = rows[0].shape[2]
    picks = from_sglang([_sglang_response(r) for r in rows], topk=k)
    assert picks.cu_seqlens.tolist() == np.cumsum([0, *lens]).tolist()
    for layer in range(rows[0].shape[1]):
        assert torch.equal(picks.indices[layer + 1], _packed(rows, layer))
    assert picks.engine_rows.tolist() == [j < n - 1 for n in lens for j in range(n)]


@given(causal_requests(), st.sampled_from(["<i4", ">i4", "<i8", ">i2"]))
def test_vllm_payloads_pack_into_the_picks_they_were_built_from(requests, dtype):
    from dsa_precision.capture import decode_vllm_indexer_topk

    rows, lens = requests
    decoded = [decode_vllm_indexer_topk(_npy_b64(r, dtype)) for r in rows]
    picks = from_vllm(decoded, lens)
    for layer in range(rows[0].shape[1]):
        assert torch.equal(picks.indices[layer + 1], _packed(rows, layer))


@given(causal_requests(max_requests=2), st.integers(1, 4))
def test_vllm_step_buffers_stitch_into_the_picks_they_were_built_from(requests, chunk):
    """Each request prefilled in chunks of ``chunk`` tokens, the steps' buffers holding stale
    rows past their tokens: stitched back, the packed picks are the known ones."""
    rows, lens = requests
    layers, k = rows[0].shape[1:]
    steps, done = [], [0] * len(rows)
    while any(d < r.shape[0] for d, r in zip(done, rows, strict=True)):
        ids, qsl, computed, parts = [], [0], [], []
        for i, r in enumerate(rows):
            if done[i] >= r.shape[0]:
                continue
            take = r[done[i] : done[i] + chunk]
            ids.append(i)
            computed.append(done[i])
            parts.append(take)
            qsl.append(qsl[-1] + take.shape[0])
            done[i] += take.shape[0]
        stacked = torch.cat(parts)  # (N, L, k)
        stale = torch.full((2, layers, k + 1), 7, dtype=torch.int32)
        buffers = {
            n + 1: torch.cat((torch.cat((stacked[:, n], torch.full((stacked.shape[0], 1), -1,
                                                                     dtype=torch.int32)), 1),
                              stale[:, n]))
            for n in range(layers)
        }  # fmt: skip
        steps.append(VllmStep(ids, qsl, computed, buffers))
    picks = from_vllm_steps(steps, dict(enumerate(lens)), topk=k)
    for layer in range(layers):
        assert torch.equal(picks.indices[layer + 1], _packed(rows, layer))


_MUTATIONS = st.sampled_from(["cut", "byte", "extend", "not-base64", "list"])


def _mutate(text: str, how: str, data) -> object:
    if how == "cut":
        return text[: data.draw(st.integers(0, max(len(text) - 1, 0)))]
    if how == "extend":
        return text + data.draw(st.sampled_from(["A", "AAAA", "====", "QUJD"]))
    if how == "not-base64":
        at = data.draw(st.integers(0, max(len(text) - 1, 0)))
        return text[:at] + data.draw(st.sampled_from(["!", "*", " ", "\u00e9"])) + text[at + 1 :]
    if how == "list":
        return list(text[:8])
    raw = bytearray(base64.b64decode(text))
    if raw:
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    return base64.b64encode(bytes(raw)).decode()


@given(causal_requests(max_requests=2), _MUTATIONS, st.data())
def test_damaged_engine_payloads_raise_one_clear_error(requests, how, data):
    """A damaged SGLang or vLLM payload raises ValueError / TypeError naming the request (a
    changed byte may also decode to other valid picks: engine payloads carry no checksum; then
    the picks still pass every check of a valid top-k); never another exception."""
    rows, lens = requests
    responses = [_sglang_response(r) for r in rows]
    victim = data.draw(st.integers(0, len(rows) - 1))
    meta = responses[victim]["meta_info"]
    meta["indexer_topk"] = _mutate(meta["indexer_topk"], how, data)
    try:
        from_sglang(responses, topk=rows[0].shape[2])
    except (ValueError, TypeError) as exc:
        assert f"response {victim}" in str(exc) or f"request {victim}" in str(exc), exc
    payloads = [_npy_b64(r) for r in rows]
    payloads[victim] = _mutate(payloads[victim], how, data)
    try:
        from dsa_precision.capture import decode_vllm_indexer_topk

        decoded = [decode_vllm_indexer_topk(p, name=f"request {i}") for i, p in enumerate(payloads)]
        from_vllm(decoded, lens)
    except (ValueError, TypeError) as exc:
        assert f"request {victim}" in str(exc), exc


@given(causal_requests(max_requests=2), st.integers(0, 3))
def test_pack_requests_refuses_a_key_past_int32_before_narrowing_it(requests, offset):
    rows, lens = requests
    wide = [r.to(torch.int64) for r in rows]
    wide[0][0, 0, 0] = 2**32 + offset  # would narrow to a valid key (offset <= position)
    with pytest.raises(ValueError, match=rf"request 0.*holds {2**32 + offset}"):
        pack_requests(wide, lens, validate=False)
