"""The package as a user meets it: importing it (and scoring on the CPU) touches none of the
optional kernel libraries, ``python -m dsa_precision`` lists and parses its commands, and every
public name resolves and is documented."""

import inspect
import os
import subprocess
import sys

import pytest

import dsa_precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = (
    "megatron",
    "cudnn",
    "triton",
    "transformer_engine",
    "flash_mla",
    "deep_gemm",
    "vllm",
)  # (fast_hadamard_transform is probed at import: an optional accelerator of the Hadamard)

_ISOLATED = f"""
import sys

OPTIONAL = {OPTIONAL!r}
attempts = []


class Block:
    \"\"\"Refuse (and record) every import of an optional kernel library.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            attempts.append(name)
            raise ImportError(f"{{name}} is blocked")
        return None


import torch  # (torch probes some of them itself)

before = set(sys.modules)
sys.meta_path.insert(0, Block())

import dsa_precision
from dsa_precision import IndexerPrecisionConfig as C
from dsa_precision import indexer_scores_varlen, indexer_select, prepare_scoring_operands

q, k, w = torch.randn(1, 6, 32, 128), torch.randn(1, 6, 128), torch.randn(1, 6, 32)
for precision in ("bf16", "fp8"):
    ops = prepare_scoring_operands(q, k, w, config=C(scoring_precision=precision))
    picks = indexer_select(ops, topk=3)
    assert picks.shape == (1, 6, 3), picks.shape
cu = torch.tensor([0, 2, 6], dtype=torch.int32)
s = indexer_scores_varlen(
    q[0], k[0], w[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
    config=C(scoring_precision="fp8"),
)
assert s.shape == (6, 4)
loaded = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in OPTIONAL)
print("attempts", attempts, "loaded", loaded)
"""


def test_import_and_cpu_scoring_touch_no_optional_kernel_library():
    out = subprocess.run(
        [sys.executable, "-c", _ISOLATED], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("attempts [] loaded []"), out.stdout


def test_command_line_lists_and_parses_its_commands(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "dsa_precision", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "not available in this build" not in out.stdout, out.stdout
    from dsa_precision.cli import _COMMANDS, _build_parser, main

    assert set(_COMMANDS) == {"demo", "agree", "bench"}
    for command in _COMMANDS:
        assert command in out.stdout, out.stdout
        with pytest.raises(SystemExit) as exit_:
            _build_parser().parse_args([command, "--help"])
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out, command
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_every_public_name_resolves_once_and_is_documented():
    names = dsa_precision.__all__
    assert len(names) == len(set(names)), "duplicates in __all__"
    undocumented = []
    for name in names:
        obj = getattr(dsa_precision, name)  # AttributeError: exported but missing
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
            undocumented.append(name)
    assert not undocumented, f"public names without a docstring: {undocumented}"
    # The scoring API is exported from the top level, the same objects as in its modules.
    from dsa_precision import operands, prepare, scoring, select, topk

    for module, name in (
        (scoring, "indexer_scores"),
        (scoring, "indexer_scores_varlen"),
        (select, "indexer_select"),
        (select, "indexer_select_varlen"),
        (topk, "indexer_topk"),
        (prepare, "prepare_scoring_operands"),
        (prepare, "prepare_indexer_operands"),
        (operands, "ScoringOperands"),
    ):
        assert name in names and getattr(dsa_precision, name) is getattr(module, name), name


def test_capture_imports_no_megatron():
    import subprocess
    import sys

    code = "import sys, dsa_precision.capture; print(any(m.startswith('megatron') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
