"""Engine outputs and replay files on disk: load_engine_output, save_picks / load_picks, and agree on an engine's own output."""

import json

import pytest
import torch

from dsa_precision.capture import (
    load_engine_output,
)

from ..support.engine_outputs import engine_rows, npy_b64, sglang_response


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
    with pytest.raises(ValueError, match=r"vllm.json: vllm request 'response 1': 4 rows"):
        broken = json.loads(vllm.read_text())
        broken[1]["usage"]["completion_tokens"] = 5
        vllm.write_text(json.dumps(broken))
        load_engine_output(vllm, engine="vllm")
    with pytest.raises(ValueError, match=r"engine='lmdeploy'"):
        load_engine_output(path, engine="lmdeploy")


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
