"""The Python snippets of README.md and docs/design.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


def test_readme_megatron_snippet(megatron_parallel):
    import dataclasses

    import dsa_precision.megatron as dsap

    from .test_megatron import fake_sm90, make_config

    (snippet,) = [b for b in python_blocks("README.md") if "DSAPrecisionTransformerConfig" in b]
    base = make_config()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields = {
        k: v
        for k, v in fields.items()
        if not k.startswith("dsa_indexer_r") and "scoring_precision" not in k
    }
    namespace = {"mla_dsa_fields": fields}
    try:
        with fake_sm90():
            exec(snippet, namespace)
        assert namespace["config"].dsa_indexer_precision.short_str() == "rope_fp32+fp8"
        layer = namespace["decoder_spec"].layer_specs[0]
        assert (
            layer.submodules.self_attention.submodules.core_attention.module
            is dsap.PrecisionDSAttention
        )
    finally:
        dsap.uninstall()


class _Recorder:
    def __init__(self):
        self.calls = []

    def add_scalar(self, *args):
        self.calls.append(args)

    def log(self, *args):
        self.calls.append(args)


def test_design_logging_snippet(megatron_parallel, monkeypatch):
    global_vars = pytest.importorskip("megatron.training.global_vars")
    tensorboard, wandb = _Recorder(), _Recorder()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", tensorboard)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
    (snippet,) = [b for b in python_blocks("docs/design.md") if "log_topk_agreement" in b]
    namespace: dict = {}
    exec(snippet, namespace)
    train = torch.tensor([[[0, 1, 2], [3, 4, -1], [-1, -1, -1]]])
    infer = torch.tensor([[[0, 1, 5], [3, 4, -1], [-1, -1, -1]]])
    namespace["track_topk_agreement"](train, infer)  # 4 of 5 picks, 1 of 2 rows
    namespace["track_topk_agreement"](infer, infer)  # 5 of 5, 2 of 2
    namespace["log_topk_agreement"](7)
    namespace["log_topk_agreement"](8)  # nothing tracked since the last log: no output
    want = {"dsa topk member agreement": 0.9, "dsa topk rows identical": 0.75}
    assert tensorboard.calls == [(name, pytest.approx(v), 7) for name, v in want.items()]
    assert wandb.calls == [({k: pytest.approx(v) for k, v in want.items()}, 7)]
