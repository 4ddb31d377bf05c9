"""The documentation against the code: README.md and docs/*.md.

- the README's Megatron snippet and the config snippet of docs/megatron.md run as written, and
  the model the README's spec builds trains on the CPU with FP8 scoring (and, with the default
  fields, computes what stock Megatron computes, bit for bit);
- the field table of docs/megatron.md is the config's fields, defaults and flags;
- every relative link and repository path in README.md and docs/*.md resolves;
- every ``dsa_precision.X`` name and ``python -m dsa_precision`` command line of the README (and
  of docs/megatron.md) exists and parses; ``make demo`` / ``make test`` exist and CI runs the
  latter;
- the logging snippet of docs/design.md runs and writes what it promises.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _precision_fields() -> tuple[str, ...]:
    """The dsa-precision fields (the config's own list): everything else of a config is the
    user's MLA + DSA fields."""
    pytest.importorskip("megatron.core")
    from dsa_precision.megatron.config import PRECISION_FIELDS

    return PRECISION_FIELDS


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


def block_with(doc: str, needle: str) -> str:
    (block,) = [b for b in python_blocks(doc) if needle in b]
    return block


# --------------------------------------------------------------------------- Megatron snippets


def _mla_dsa_fields(**overrides) -> dict:
    """The small CPU MLA + DSA config of the Megatron tests, without the dsa-precision fields."""
    from .support.megatron import make_config

    base, ours = make_config(**overrides), _precision_fields()
    return {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(base)
        if f.init and f.name not in ours
    }


def _dsa_cores(spec) -> list:
    return [layer.submodules.self_attention.submodules.core_attention for layer in spec.layer_specs]


def _gpt(config, spec, seed: int = 7):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    return model.bfloat16()


def _unswap(node):
    """The same spec with Megatron's own DSAttention / DSAIndexer."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    import dsa_precision.megatron as dsap

    back = {dsap.PrecisionDSAttention: DSAttention, dsap.PrecisionDSAIndexer: DSAIndexer}
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(
            node, module=back.get(node.module, node.module), submodules=_unswap(node.submodules)
        )
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(
            node, **{f.name: _unswap(getattr(node, f.name)) for f in dataclasses.fields(node)}
        )
    if isinstance(node, list | tuple):
        return type(node)(_unswap(item) for item in node)
    return back.get(node, node) if isinstance(node, type) else node


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None, labels=tokens).float().mean()


def test_readme_megatron_snippet_trains_with_fp8_scoring(megatron_parallel, cpu_rotary):
    import dsa_precision.megatron as dsap
    from dsa_precision import IndexerPrecisionConfig, reset_scoring_calls, scoring_calls

    snippet = block_with("README.md", "DSAPrecisionTransformerConfig")
    assert "install(" not in snippet
    namespace = {"mla_dsa_fields": _mla_dsa_fields(num_layers=2)}
    exec(snippet, namespace)
    config, spec = namespace["config"], namespace["decoder_spec"]
    assert config.dsa_indexer_precision == IndexerPrecisionConfig(True, "fp8", "vllm")
    cores = _dsa_cores(spec)
    assert len(cores) == 2
    assert all(core.module is dsap.PrecisionDSAttention for core in cores)
    assert all(core.submodules.indexer.module is dsap.PrecisionDSAIndexer for core in cores)

    model = _gpt(config, spec)
    tokens = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    reset_scoring_calls()
    with dsap.record_topk() as recorder:
        loss = _loss(model, tokens)
    loss.backward()
    assert torch.isfinite(loss)
    # Both layers selected their top-k with one FP8 scoring call each, and none ran in BF16.
    assert scoring_calls("fp8") == 2 and scoring_calls("bf16") == 0
    assert sorted(recorder.picks.indices) == [1, 2]
    for picks in recorder.picks.indices.values():
        assert picks.shape == (32, config.dsa_indexer_topk)
        row = torch.arange(32)[:, None]
        assert bool(((picks == -1) | ((picks >= 0) & (picks <= row))).all())
    grads = [p.grad for n, p in model.named_parameters() if "indexer" not in n]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)


def test_readme_default_fields_are_stock_megatron_bit_for_bit(megatron_parallel, cpu_rotary):
    """The README's claim: with the defaults, the swapped model is stock Megatron."""
    from dsa_precision import IndexerPrecisionConfig

    snippet = block_with("README.md", "DSAPrecisionTransformerConfig")
    # The snippet with the switches left at their defaults.
    ours = _precision_fields()
    snippet = "\n".join(line for line in snippet.splitlines() if not line.strip().startswith(ours))
    namespace = {"mla_dsa_fields": _mla_dsa_fields(num_layers=2)}
    exec(snippet, namespace)
    config, spec = namespace["config"], namespace["decoder_spec"]
    assert config.dsa_indexer_precision == IndexerPrecisionConfig()
    ours, stock = _gpt(config, spec), _gpt(config, _unswap(spec))
    assert type(stock.decoder.layers[0].self_attention.core_attention).__name__ == "DSAttention"
    stock.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (ours, stock):
        torch.manual_seed(3)  # the same dropout masks (the config keeps Megatron's dropout)
        losses.append(_loss(model, tokens))
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(ours.named_parameters(), stock.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


def test_megatron_doc_config_snippet(megatron_parallel, cpu_rotary):
    import dsa_precision.megatron as dsap
    from dsa_precision import IndexerPrecisionConfig

    namespace: dict = {}
    exec(block_with("docs/megatron.md", "DSAPrecisionTransformerConfig("), namespace)
    config = namespace["config"]
    assert config.dsa_indexer_precision == IndexerPrecisionConfig(True, "fp8", "vllm")
    cores = _dsa_cores(namespace["decoder_spec"])
    assert len(cores) == config.num_layers
    assert all(core.module is dsap.PrecisionDSAttention for core in cores)


def test_megatron_doc_field_table_is_the_config():
    import argparse

    pytest.importorskip("megatron.core")
    import dsa_precision.megatron as dsap

    rows = re.findall(
        r"^\| `(dsa_indexer_\w+)` \| `(--[\w-]+)` \| `([^`]+)` \|",
        (ROOT / "docs/megatron.md").read_text(),
        re.M,
    )
    ours = _precision_fields()
    fields = {
        f.name: f.default
        for f in dataclasses.fields(dsap.DSAPrecisionTransformerConfig)
        if f.name in ours
    }
    parser = dsap.add_dsa_precision_args(argparse.ArgumentParser())
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings[0] != "-h"}
    assert {r[0] for r in rows} == set(fields) and len(rows) == len(fields)
    assert {r[1] for r in rows} == set(flags)
    for field, flag, default in rows:
        assert default == repr(fields[field]).replace("'", '"'), field
        assert flags[flag].dest == field and flags[flag].default == fields[field], flag


# --------------------------------------------------------------------------- links and names


def _github_slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {_github_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    # Repository paths written out (`docs/x.md`, `examples/y.py`, in text or commands), not
    # patterns such as `tests/test_<module>.py`.
    for path in re.findall(
        r"(?<![\w/.-])((?:docs|dsa_precision|conformance|examples|tests|tools|\.ci)/[\w./-]*\w)(?![\w./<{*-])",
        doc.read_text(),
    ):
        if not (ROOT / path).exists():
            broken.append(path)
    assert not broken, f"{doc.name}: {broken}"


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("doc", ["README.md", "docs/megatron.md"])
def test_named_dsa_precision_objects_exist(doc):
    pytest.importorskip("megatron.core")
    names = set(re.findall(r"\bdsa_precision(?:\.\w+)+", (ROOT / doc).read_text()))
    assert names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (AttributeError, ModuleNotFoundError):
            missing.append(name)
        except ImportError:  # the Bridge module, where Megatron-Bridge does not import: its source
            if not _defined_in_source(name):
                missing.append(name)
    assert not missing


def _defined_in_source(name: str) -> bool:
    """Whether ``dsa_precision.<module>[.<top-level name>]`` exists in the package's source."""
    import ast

    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        path = ROOT.joinpath(*parts[:cut]).with_suffix(".py")
        if path.exists():
            rest = parts[cut:]
            if not rest:
                return True
            tree = ast.parse(path.read_text())
            defined = {
                n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)
            } | {
                t.id
                for n in tree.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            return len(rest) == 1 and rest[0] in defined
    return False


def test_readme_names_the_public_api():
    import dsa_precision

    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\bdsa_precision\.(\w+)", text)) - {"megatron"}
    assert named <= set(dsa_precision.__all__), named - set(dsa_precision.__all__)


def test_command_lines_parse():
    from dsa_precision.cli import _COMMANDS, _build_parser

    parser = _build_parser()
    seen = set()
    for doc in ("README.md", "docs/megatron.md"):
        for line in re.findall(r"python -m dsa_precision [^`\n#]*", (ROOT / doc).read_text()):
            argv = shlex.split(line)[3:]
            if not argv or argv[0].startswith("{"):
                continue  # the synopsis, "python -m dsa_precision {demo,agree,bench}"
            assert argv[0] in _COMMANDS, line
            parser.parse_args(argv)
            seen.add(argv[0])
    assert seen == set(_COMMANDS)


def test_readme_make_targets_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", readme, re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert re.search(r"\bmake test\s*$", (ROOT / ".ci/run").read_text(), re.M)
    assert "pytest -q" in re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)


def test_readme_commands_run_in_the_environment_make_creates():
    """``python -m dsa_precision ...`` needs the packages ``make demo`` installs into the Makefile's
    virtual environment: the README's install block activates it right after ``make``."""
    readme = (ROOT / "README.md").read_text()
    venv = re.search(r"^VENV \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "make demo" in b)
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    assert lines[:3] == ["make demo", "make test", f". {venv}/bin/activate"], lines
    first_command = readme.index("python -m dsa_precision")
    assert readme.index(block) < first_command


# --------------------------------------------------------------------------- design.md logging


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
    namespace: dict = {}
    exec(block_with("docs/design.md", "log_topk_agreement"), namespace)
    train = torch.tensor([[[0, 1, 2], [3, 4, -1], [-1, -1, -1]]])
    infer = torch.tensor([[[0, 1, 5], [3, 4, -1], [-1, -1, -1]]])
    namespace["track_topk_agreement"](train, infer)  # 4 of 5 picks, 1 of 2 rows
    namespace["track_topk_agreement"](infer, infer)  # 5 of 5, 2 of 2
    namespace["log_topk_agreement"](7)
    namespace["log_topk_agreement"](8)  # nothing tracked since the last log: no output
    want = {"dsa topk member agreement": 0.9, "dsa topk rows identical": 0.75}
    assert tensorboard.calls == [(name, pytest.approx(v), 7) for name, v in want.items()]
    assert wandb.calls == [({k: pytest.approx(v) for k, v in want.items()}, 7)]


def test_the_docs_count_the_frozen_fields_as_the_code_does():
    from dsa_precision.megatron.config import PRECISION_FIELDS

    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    n = words[len(PRECISION_FIELDS)]
    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs/megatron.md").read_text()
    assert f"{n.capitalize()} `TransformerConfig` fields" in readme
    assert f"the {n} fields are frozen after validation" in guide
    for field in PRECISION_FIELDS:
        assert f"| `{field}` |" in guide, field
