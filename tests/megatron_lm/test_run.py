"""tests/megatron_lm/run.py: how a difference between the stock and a swapped run is judged.

A difference is expected only for the field set, test, outcomes and failure message its
``EXPECTED`` entry names; anything else is reported as unexpected (exit code 2). Pure logic: no
Megatron-LM test runs here (docs/megatron.md gives the measured runs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().with_name("run.py")
_SPEC = importlib.util.spec_from_file_location("megatron_tests_run", _PATH)
run = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = run  # its dataclasses look their module up
_SPEC.loader.exec_module(run)

_NODE = (
    run.EAV + "test_attention_variant_dsa.py::TestDSAIndexer::"
    "test_dsa_indexer_rotate_activation_follows_config"
)
_FAILED = ("failed", "AssertionError: assert 0 == 2")


def _rotate(params: str) -> str:
    return run.junit_id(f"{_NODE}[{params}]")


def test_the_rope_fp32_hadamard_difference_is_expected_with_its_reason():
    stock = {_rotate("True-16"): ("passed", ""), _rotate("False-16"): ("passed", "")}
    swapped = {_rotate("True-16"): _FAILED, _rotate("False-16"): ("passed", "")}
    (item,) = run.compare(stock, swapped, "rope_fp32")
    assert item["test"] == _rotate("True-16")
    assert "dsa_precision.hadamard.rotate_activation" in item["expected"]
    assert run.not_observed([item], "rope_fp32", {_NODE.split("::")[0]}) == []


@pytest.mark.parametrize(
    "fields, test, swapped",
    [
        ("none", _rotate("True-16"), _FAILED),  # default fields: Megatron's own path
        ("rope_fp32", _rotate("False-16"), _FAILED),  # no Hadamard asked: nothing to explain
        ("rope_fp32", _rotate("True-16"), ("failed", "RuntimeError: shapes differ")),
        ("rope_fp32", _rotate("True-16"), ("error", "AssertionError: assert 0 == 2")),
    ],
)
def test_any_other_difference_is_unexpected(fields, test, swapped):
    (item,) = run.compare({test: ("passed", "")}, {test: swapped}, fields)
    assert item["expected"] is None


def test_an_expected_difference_that_does_not_occur_is_reported():
    same = {_rotate("True-16"): ("passed", "")}
    assert run.compare(same, same, "rope_fp32") == []
    (entry,) = run.not_observed([], "rope_fp32", {_NODE.split("::")[0]})
    assert entry.node == _NODE
    assert run.not_observed([], "rope_fp32", {"tests/unit_tests/other.py"}) == []
    assert run.not_observed([], "none", {_NODE.split("::")[0]}) == []


def test_field_sets_name_the_modes():
    assert run.swapped_mode("") == run.swapped_mode("none") == "swapped"
    assert run.swapped_mode(" rope_fp32 ") == "swapped+rope_fp32"
    with pytest.raises(SystemExit):
        run.main(["--megatron-lm", str(_PATH.parent), "--fields", "fp8"])


_BF16_NODE = run.EAV + "test_attention_variant_dsa.py::TestDSAttention::test_dsa_forward"
_BF16_FAILED = ("failed", "RuntimeError: expected scalar type BFloat16 but found Float")


def test_a_stock_gpu_failure_rope_fp32_passes_is_expected_on_cuda_only():
    """On the H200 stock Megatron fails some tests in its BF16 indexer path; rope_fp32 replaces
    that path and passes them: expected there, by the stock failure's message, and nowhere else."""
    test = run.junit_id(_BF16_NODE)
    stock, swapped = {test: _BF16_FAILED}, {test: ("passed", "")}
    (item,) = run.compare(stock, swapped, "rope_fp32", cuda=True)
    assert "does not run into it" in item["expected"]
    assert run.compare(stock, swapped, "rope_fp32", cuda=False)[0]["expected"] is None
    assert run.compare(stock, swapped, "none", cuda=True)[0]["expected"] is None
    other = {test: ("failed", "RuntimeError: CUDA error: out of memory")}
    assert run.compare(other, swapped, "rope_fp32", cuda=True)[0]["expected"] is None
    params = {run.junit_id(_BF16_NODE + "[16]"): _BF16_FAILED}  # a test without parameters
    assert (
        run.compare(params, {k: ("passed", "") for k in params}, "rope_fp32", True)[0]["expected"]
        is None
    )


def test_the_expected_differences_not_seen_follow_the_device():
    """On CUDA the Hadamard difference cannot occur (stock fails the test first) and is not
    reported missing; the GPU-only entries are not reported missing on the CPU."""
    ran = {_NODE.split("::")[0]}
    on_cpu = run.not_observed([], "rope_fp32", ran, cuda=False)
    on_gpu = run.not_observed([], "rope_fp32", ran, cuda=True)
    assert [(e.node, e.params) for e in on_cpu] == [(_NODE, r"True-\d+")]
    assert (_NODE, r"True-\d+") not in {(e.node, e.params) for e in on_gpu}
    assert len(on_gpu) == 8 and all(e.cuda for e in on_gpu)


def test_with_transformer_engine_the_gpu_expects_what_the_cpu_does():
    """With TE installed stock passes the BF16 tests on a GPU too: their difference is not
    expected there (nor reported missing), and the Hadamard one is, as on the CPU."""
    ran = {_NODE.split("::")[0]}
    with_te = run.not_observed([], "rope_fp32", ran, cuda=True, te=True)
    assert [(e.node, e.params) for e in with_te] == [(_NODE, r"True-\d+")]
    test = run.junit_id(_BF16_NODE)
    (item,) = run.compare({test: _BF16_FAILED}, {test: ("passed", "")}, "rope_fp32", True, True)
    assert item["expected"] is None
    rotate = run.junit_id(_NODE + "[True-16]")
    stock, swapped = {rotate: ("passed", "")}, {rotate: ("failed", "AssertionError: assert 0 == 2")}
    assert run.compare(stock, swapped, "rope_fp32", cuda=True, te=True)[0]["expected"]
    assert run.compare(stock, swapped, "rope_fp32", cuda=True, te=False)[0]["expected"] is None
