"""``agree`` on damaged files, generated (Hypothesis): a file it cannot read exits 2 with one
line on stderr, never a traceback; a damaged file it can still read compares rows (never a pass
on nothing)."""

import contextlib
import io
import json
import pathlib
import tempfile

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from dsa_precision import cli
from dsa_precision.capture import TokenLayout, TopkPicks, save_picks

from ..support.engine_outputs import engine_rows, sglang_response


def _agree(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["agree", *map(str, args), "--json"])
    return code, out.getvalue(), err.getvalue()


def _damage(raw: bytes, data) -> bytes:
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "garbage"]), label="damage")
    if how == "flip" and raw:
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        damaged = bytearray(raw)
        damaged[at] ^= data.draw(st.integers(1, 255), label="xor")
        return bytes(damaged)
    if how == "cut":
        return raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)), label="cut")]
    if how == "extend":
        return raw + data.draw(st.binary(min_size=1, max_size=64), label="extra")
    return data.draw(st.binary(max_size=256), label="garbage")


def _judge(code: int, out: str, err: str) -> None:
    assert "Traceback" not in err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("dsa-precision agree: error: "), err
        return
    assert code in (0, 1), (code, err)
    report = json.loads(out)
    assert all(c["rows"] > 0 for c in report["configs"]), report


def _replay_files(folder: pathlib.Path, suffix: str) -> tuple[pathlib.Path, pathlib.Path]:
    g = torch.Generator().manual_seed(0)
    picks = {
        n: torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(20)]).sort(-1).values
        for n in (1, 2)
    }
    causal = {n: torch.where(p <= torch.arange(20)[:, None], p, -1) for n, p in picks.items()}
    train, infer = folder / f"train{suffix}", folder / f"infer{suffix}"
    save_picks(train, TopkPicks(causal, TokenLayout(seq_len=20)))
    save_picks(infer, TopkPicks(causal, TokenLayout(seq_len=20)))
    return train, infer


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@given(data=st.data())
def test_agree_on_a_damaged_replay_file_is_one_line_or_a_real_comparison(suffix, data):
    pytest.importorskip("safetensors")
    with tempfile.TemporaryDirectory() as folder:
        train, infer = _replay_files(pathlib.Path(folder), suffix)
        infer.write_bytes(_damage(infer.read_bytes(), data))
        _judge(*_agree("--train", train, "--infer", infer))


@given(data=st.data())
def test_agree_on_a_damaged_engine_output_is_one_line_or_a_real_comparison(data):
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        fulls = [engine_rows(6, 2, seed=1), engine_rows(5, 2, seed=2)]
        infer = folder / "sglang.jsonl"
        infer.write_text("\n".join(json.dumps(sglang_response(f)) for f in fulls))
        from dsa_precision.capture import load_engine_output

        train = folder / "train.pt"
        save_picks(train, load_engine_output(infer, engine="sglang"))
        text = infer.read_bytes()
        if data.draw(st.booleans(), label="json-level"):
            records = [json.loads(line) for line in text.splitlines()]
            field = data.draw(st.sampled_from(["prompt_tokens", "completion_tokens",
                                               "indexer_topk", "indexer_topk_num_layers"]))  # fmt: skip
            value = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-3, 40),
                                        st.floats(allow_nan=True), st.text(max_size=8),
                                        st.lists(st.integers(), max_size=3)))  # fmt: skip
            records[data.draw(st.integers(0, 1))]["meta_info"][field] = value
            infer.write_text("\n".join(json.dumps(r) for r in records))
        else:
            infer.write_bytes(_damage(text, data))
        _judge(*_agree("--train", train, "--infer", infer, "--infer-format", "sglang"))
