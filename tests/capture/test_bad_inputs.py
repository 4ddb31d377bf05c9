"""Engine data at the edge, tried as a hostile user would: every malformed payload, stream, file
or profile raises ``ValueError`` / ``TypeError`` naming the request, layer, row or field and the
fix; nothing is silently wrong and nothing else escapes (docs/robustness.md, "Engine data")."""

import base64
import io
import json
import os

import numpy as np
import pytest
import torch

from dsa_precision import topk_agreement
from dsa_precision.capture import (
    CompactPicks,
    TokenLayout,
    TopkPicks,
    VllmStep,
    decode_picks,
    decode_vllm_indexer_topk,
    digest_mismatches,
    digest_rows,
    encode_picks,
    from_sglang,
    from_vllm,
    from_vllm_steps,
    load_engine_output,
    load_picks,
    pack_digests,
    pack_requests,
    save_picks,
)
from dsa_precision.engines import EngineProfile, Fp8Rule

I32 = dict(dtype=torch.int32)
GOOD = [[[0, -1]], [[0, 1]], [[2, 1]]]  # 3 rows, 1 layer, k = 2: a request of 4 tokens


def _b64(rows) -> str:
    return base64.b64encode(np.asarray(rows, dtype="<i4").tobytes()).decode()


def _npy(rows, dtype: str = "<i4") -> str:
    buf = io.BytesIO()
    np.save(buf, np.asarray(rows).astype(dtype))
    return base64.b64encode(buf.getvalue()).decode()


def _sglang(rows=GOOD, layers=1, prompt=3, completion=1, payload=None) -> dict:
    return {"meta_info": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "indexer_topk": _b64(rows) if payload is None else payload,
        "indexer_topk_num_layers": layers,
    }}  # fmt: skip


def _step(ids=(0,), qsl=(0, 1), computed=(0,), buffers=None, kept=None) -> VllmStep:
    buffers = {1: torch.tensor([[0, -1]], **I32)} if buffers is None else buffers
    return VllmStep(list(ids), list(qsl), list(computed), buffers, kept)


CASES = {
    # SGLang responses
    "sglang float token count": (lambda: from_sglang([_sglang(prompt=2.5, completion=1.5)]),
                                 ValueError, r"response 0 prompt_tokens=2.5 must be an int"),
    "sglang bool layer count": (lambda: from_sglang([_sglang(layers=True)]),
                                ValueError, r"indexer_topk_num_layers=True must be an int"),
    "sglang payload not text": (lambda: from_sglang([_sglang(payload=5)]),
                                TypeError, r"response 0 indexer_topk: expected a base64 string"),
    "sglang payload not base64": (lambda: from_sglang([_sglang(payload="AA!A")]),
                                  ValueError, r"response 0 indexer_topk: not base64"),
    "sglang payload short bytes": (lambda: from_sglang([_sglang(payload=base64.b64encode(b"abc").decode())]),
                                   ValueError, r"decodes to 3 bytes, not whole int32 values"),
    "sglang token count vs payload": (lambda: from_sglang([_sglang(prompt=4)], topk=2),
                                      ValueError, r"token count gives 4 rows"),
    "sglang response is a list": (lambda: from_sglang([[1, 2]]), ValueError, r"response 0 has no meta_info"),
    "sglang shared not a mapping": (lambda: from_sglang([_sglang()], shared="x"),
                                    TypeError, r"shared='x': pass \{layer: source_layer\}"),
    # vLLM payloads and steps
    "vllm float npy": (lambda: decode_vllm_indexer_topk(_npy(np.zeros((2, 1, 2)), "<f4")),
                       TypeError, r"got a NumPy float32 array"),
    "vllm npz archive": (lambda: decode_vllm_indexer_topk(base64.b64encode(
                             (lambda b: (np.savez(b, a=np.zeros(2)), b.getvalue())[1])(io.BytesIO())
                         ).decode()), ValueError, r"a \.npz archive"),
    "vllm key past int32": (lambda: decode_vllm_indexer_topk(_npy(np.full((2, 1, 2), 2**33), "<i8")),
                            ValueError, r"row 0 \(token 0\) holds 8589934592"),
    "vllm uint64 beyond keys": (lambda: decode_vllm_indexer_topk(_npy(np.full((1, 1, 1), 2**63 + 5, dtype=np.uint64), "<u8")),
                                ValueError, r"beyond any key"),
    "vllm payload None": (lambda: decode_vllm_indexer_topk(None), TypeError, r"expected a base64 string"),
    "vllm rows as lists": (lambda: from_vllm([[[[0, -1]]]], [2]), TypeError, r"vllm request 0: expected a \(n, L, k\)"),
    "vllm one step not a list": (lambda: from_vllm_steps(_step(), {0: 2}, topk=2),
                                 TypeError, r"wrap one step in a list"),
    "vllm duplicate request ids": (lambda: from_vllm_steps([_step(ids=(0, 0), qsl=(0, 1, 1), computed=(0, 1))], {0: 3}, topk=2),
                                   ValueError, r"request id\(s\) 0 scheduled twice"),
    "vllm query_start_loc decreasing": (lambda: from_vllm_steps([_step(ids=(0, 1), qsl=(0, 1, 0), computed=(0, 0))], {0: 2, 1: 2}, topk=2),
                                        ValueError, r"query_start_loc \[0, 1, 0\] must start at 0 and never decrease"),
    "vllm fractional query_start_loc": (lambda: from_vllm_steps([_step(qsl=(0, 1.5))], {0: 2}, topk=2),
                                        ValueError, r"query_start_loc\[1\]=1.5 must be an int"),
    "vllm kept_rows length": (lambda: from_vllm_steps([_step(kept=[1, 1])], {0: 2}, topk=2),
                              ValueError, r"kept_rows has 2 entries for 1 requests"),
    "vllm rows computed twice": (lambda: from_vllm_steps([_step(), _step()], {0: 2}, topk=2),
                                 ValueError, r"positions 0..0 have rows twice \(steps 0 and 1\)"),
    # packing
    "pack rows on meta": (lambda: pack_requests([torch.zeros(1, 1, 2, device="meta", **I32)], [2]),
                          ValueError, r"request 0 is on meta"),
    "pack int64 key past int32": (lambda: pack_requests([torch.tensor([[[2**32, -1]]])], [2], validate=False),
                                  ValueError, r"request 0.*holds 4294967296"),
    "pack digests of int32": (lambda: pack_digests([torch.zeros(1, 1, **I32)], [2]),
                              TypeError, r"digests must be a \(n, L\) int64 tensor"),
    "pack digests object array": (lambda: pack_digests([np.array([[None]], dtype=object)], [2]),
                                  TypeError, r"NumPy object array .*pickled objects are never read"),
    # compact frames
    "compact long payload": (lambda: CompactPicks("int32", (1, 2), torch.zeros(3, **I32)),
                             ValueError, r"the payload is long"),
    "compact short delta stream": (lambda: CompactPicks("delta", (2, 2), torch.zeros(1, **I32), torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int16), bits=64),
                                   ValueError, r"data is int32 of 1 elements.*needs int32 of 3 \(the payload is short\)"),
    "compact declared rows": (lambda: CompactPicks("delta", (3, 2), torch.zeros(1, **I32), torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int16)),
                              ValueError, r"width is uint8 of 2 elements"),
    "compact without checksum": (lambda: decode_picks(CompactPicks("int32", (1, 2), torch.zeros(2, **I32))),
                                 ValueError, r"without a checksum"),
    "compact bytes not a frame": (lambda: CompactPicks.from_bytes(b"x" * 60), ValueError, r"not a compact picks frame"),
    "compact encode chunk 0": (lambda: encode_picks(torch.zeros(1, 1, **I32), rows_per_chunk=0),
                               ValueError, r"rows_per_chunk=0"),
    # digests
    "digest of a key below -1": (lambda: digest_rows(torch.tensor([[0, -5]])), ValueError, r"row 0 holds -5"),
    "digest widths differ": (lambda: digest_mismatches({1: torch.zeros(2, **I32)}, {1: torch.zeros(2, dtype=torch.int64)}),
                             TypeError, r"our digests of layer 1 must be \(T,\) int64"),
    "engine digests int32": (lambda: digest_mismatches({1: torch.zeros(2, 2, **I32)}, {1: torch.zeros(2, **I32)}),
                             TypeError, r"engine digests of layer 1 must be a \(T,\) int64 tensor .*got torch.int32 \(2,\)"),
    # picks and layouts
    "picks indices a list": (lambda: TopkPicks([1], None), TypeError, r"TopkPicks.indices takes"),
    "picks layout a dict": (lambda: TopkPicks({}, {"seq_len": 3}), TypeError, r"TopkPicks.layout is a TokenLayout"),
    "layout lengths on meta": (lambda: TokenLayout(cu_seqlens=torch.tensor([0, 2], device="meta")),
                               ValueError, r"cu_seqlens is on meta"),
    # profiles
    "profile fma as text": (lambda: EngineProfile("x", "y", fma="false"), TypeError, r"fma must be a bool"),
    "profile hadamard as text": (lambda: EngineProfile("x", "y", hadamard="no"), TypeError, r"hadamard='no' \(str\) must be True, False or None"),
    "profile epsilon as text": (lambda: EngineProfile("x", "y", k_norm_eps="1e-6"), TypeError, r"k_norm_eps='1e-6' \(str\)"),
    "profile rule as bad mapping": (lambda: EngineProfile("x", "y", q_quant={"floor": 1e-4}), TypeError, r"q_quant: .*'floor'"),
    "profile name not text": (lambda: EngineProfile(5, "y"), TypeError, r"EngineProfile.name must be a str"),
    "rule floor as text": (lambda: Fp8Rule(amax_floor="1e-4"), TypeError, r"amax_floor='1e-4' \(str\)"),
}  # fmt: skip


@pytest.mark.parametrize("make, error, match", list(CASES.values()), ids=list(CASES))
def test_bad_engine_data_raises_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_files_name_what_is_wrong_with_them(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"d.jsonl: a directory, not a file"):
        load_engine_output(tmp_path / "d.jsonl", engine="sglang")
    os.symlink(tmp_path / "loop.json", tmp_path / "loop.json")
    with pytest.raises(ValueError, match=r"loop.json: cannot be read \(Too many levels"):
        load_engine_output(tmp_path / "loop.json", engine="sglang")
    os.symlink(tmp_path / "gone.json", tmp_path / "dangling.json")
    with pytest.raises(ValueError, match=r"dangling.json: a dangling symlink"):
        load_engine_output(tmp_path / "dangling.json", engine="sglang")
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"a": _sglang(), "b": _sglang()}))
    with pytest.raises(ValueError, match=r"a JSON object with keys \['a', 'b'\] is not a response"):
        load_engine_output(mapping, engine="sglang")
    lines = tmp_path / "r.jsonl"
    lines.write_text(json.dumps(_sglang()) + "\n\n" + json.dumps(_sglang(payload="A!")) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl: SGLang response 'line 3' indexer_topk: not b"):
        load_engine_output(lines, engine="sglang")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"not UTF-8 text"):
        load_engine_output(tmp_path / "bin.json", engine="sglang")
    upper = tmp_path / "UP.JSON"  # the suffix is read without case, everywhere
    upper.write_text(json.dumps([_sglang()]))
    picks = load_engine_output(upper, engine="sglang")
    save_picks(tmp_path / "P.SAFETENSORS", picks)
    assert torch.equal(load_picks(tmp_path / "P.SAFETENSORS").indices[1], picks.indices[1])
    with pytest.raises(ValueError, match=r"save picks as .pt, .pth or .safetensors, got '.txt'"):
        save_picks(tmp_path / "a.txt", picks)


def test_typed_profile_fields_from_json_are_taken_as_meant():
    """A profile read from JSON: a list for the fold, a mapping for a rule, NumPy scalars for
    numbers -- taken (hashable, equal to the typed profile), never misread."""
    typed = EngineProfile("x", "y", weights_fold=("Ds", "Hs", "qs"), q_quant=Fp8Rule(amax_floor=1e-4),
                          k_norm_eps=1e-6)  # fmt: skip
    loose = EngineProfile("x", "y", weights_fold=["Ds", "Hs", "qs"], q_quant={"amax_floor": 1e-4},
                          k_norm_eps=np.float64(1e-6))  # fmt: skip
    assert loose == typed and hash(loose) == hash(typed)
    assert Fp8Rule(amax_floor=np.float32(0.5)).amax_floor == 0.5


def test_broken_rows_say_why_the_agreement_is_nan():
    got = topk_agreement(torch.tensor([[1, 1], [0, -1]]), torch.tensor([[1, 2], [0, -1]])).as_dict()
    assert got["broken_rows"] == 1 and got["member_agreement"] != got["member_agreement"]
