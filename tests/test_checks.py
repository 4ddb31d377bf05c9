"""The shared argument checks (``dsa_precision.checks``) and the public surface they guard:
ints are range-checked before any int32 cast, numbers are numbers, and every public entry point
that quantizes takes the one precision object."""

import inspect

import numpy as np
import pytest
import torch

import dsa_precision
from dsa_precision import IndexerPrecisionConfig, indexer_scores, indexer_select, indexer_topk
from dsa_precision.checks import (
    _INT32_MAX,
    _as_int32_tensor,
    _check_bool,
    _check_int_fits,
    _check_positive_int,
    _check_real,
    _takes_precision_config,
)

from .support.fused_attention import fused_indexer_sparse_attention

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- Python ints


def test_check_bool_takes_only_bools_and_every_flag_uses_it():
    assert _check_bool("flag", True) is True and _check_bool("flag", False) is False
    for bad, kind in ((1, "int"), ("yes", "str"), (np.bool_(True), "bool"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"flag must be a bool, got .* \({kind}\); pass True"):
            _check_bool("flag", bad)
    # the package's own bool flags share it (one message)
    from dsa_precision import EngineProfile, IndexerPreprocess
    from dsa_precision.engines import DEFAULT_ENGINE

    cases = [
        lambda: IndexerPrecisionConfig(rope_fp32=1),
        lambda: IndexerPreprocess(128, 64, rope_fp32="yes"),
        lambda: EngineProfile(**{**DEFAULT_ENGINE.__dict__, "name": "x", "fma": 1}),
        lambda: indexer_select(
            torch.zeros(1, 1, 32, 128),
            torch.zeros(1, 1, 128),
            torch.zeros(1, 1, 32),
            topk=1,
            config=IndexerPrecisionConfig(),
            backend="torch",
            margins=1,
        ),
    ]
    for case in cases:
        with pytest.raises(TypeError, match=r"must be a bool, got .*; pass True or False"):
            case()


def test_check_int_fits_bounds_and_types():
    assert _check_int_fits("n", 7) == 7
    assert _check_int_fits("n", np.int64(7)) == 7 and type(_check_int_fits("n", np.int64(7))) is int
    assert _check_int_fits("n", _INT32_MAX) == _INT32_MAX
    with pytest.raises(ValueError, match=r"n=2147483648 is outside \[0, 2147483647\]; fix it"):
        _check_int_fits("n", 2**31, fix="fix it")
    with pytest.raises(ValueError, match=r"n=-1 is outside \[0, 2147483647\]"):
        _check_int_fits("n", -1)
    assert _check_int_fits("n", 2**40, high=None) == 2**40
    for bad in (True, 3.0, "3", torch.tensor(3)):
        with pytest.raises(TypeError, match=r"n=.* must be a Python int"):
            _check_int_fits("n", bad)


def test_check_positive_int_refuses_floats_even_whole_ones():
    assert _check_positive_int("topk", 3) == 3
    for bad in (2.7, 2.0, 0, -1, False):
        with pytest.raises(ValueError, match=rf"topk={bad!r} must be a positive integer"):
            _check_positive_int("topk", bad)
    with pytest.raises(ValueError, match=r"topk=9 is outside \[1, 8\]"):
        _check_positive_int("topk", 9, high=8)


# -------------------------------------------------------------------------- int tensors


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_as_int32_tensor_casts_in_range_values(dtype):
    t = torch.tensor([0, 5, 9], dtype=dtype)
    got = _as_int32_tensor("t", t, device=CPU, validate=True, high=9)
    assert got.dtype == torch.int32 and got.tolist() == [0, 5, 9]


@pytest.mark.parametrize("value", [2**31, 2**32 + 3, -(2**32) + 1])
def test_as_int32_tensor_checks_before_the_cast(value):
    """The values an int32 cast would wrap into range (2**32 + 3 -> 3) are reported as given."""
    t = torch.tensor([1, value], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"t\[1\]={value} is outside \[0, 9\]; the fix"):
        _as_int32_tensor("t", t, device=CPU, validate=True, high=9, fix="the fix")


def test_as_int32_tensor_names_a_multi_dim_index():
    t = torch.tensor([[0, 1], [2, 40]])
    with pytest.raises(ValueError, match=r"t\[\(1, 1\)\]=40 is outside \[0, 9\]"):
        _as_int32_tensor("t", t, device=CPU, validate=True, high=9)


# ------------------------------------------- the entry points: int64 values past int32


def _carriers(b=1, s=8):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, s, 32, 128, generator=g),
        torch.randn(b, s, 128, generator=g),
        (torch.randn(b, s, 32, generator=g)),
    )


BF16 = IndexerPrecisionConfig()


def test_wrapped_offsets_are_caught_by_validate_and_the_in_range_call_is_unchanged():
    """``2**32 + 3`` used to become offset 3 and pass ``validate=True``; now it is an error,
    while the same call with offset 3 runs (and the int64 tensor is accepted)."""
    q, k, w = _carriers()
    wrapped = torch.tensor([2**32 + 3])
    for call in (
        lambda o: indexer_scores(q, k, w, config=BF16, q_causal_offsets=o, validate=True),
        lambda o: indexer_select(q, k, w, topk=2, config=BF16, q_causal_offsets=o, validate=True),
    ):
        with pytest.raises(ValueError, match=r"q_causal_offsets\[0\]=4294967299 is outside"):
            call(wrapped)
        call(torch.tensor([3]))


def test_wrapped_seq_lens_are_caught_by_validate():
    scores = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=4294967298 is outside \[0, 6\]"):
        indexer_topk(scores, 2, seq_lens=torch.tensor([3, 2**32 + 2]), validate=True)
    picks = indexer_topk(scores, 2, seq_lens=torch.tensor([3, 2]), validate=True)
    assert (picks < torch.tensor([[3], [2]])).all()


def test_python_offset_past_int32_is_an_error_not_a_torch_crash():
    q, k, w = _carriers()
    with pytest.raises(ValueError, match=r"q_causal_offsets=4294967296 is outside \[0, "):
        indexer_scores(q, k, w, config=BF16, q_causal_offsets=2**32)
    # The largest admissible offset still runs: its rows see every key.
    got = indexer_scores(q, k, w, config=BF16, q_causal_offsets=_INT32_MAX - 8)
    assert torch.isfinite(got).all()


# ------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("good", [0.5, 2, np.float32(0.25), np.float64(1.5), np.int64(3)])
def test_check_real_accepts_real_numbers(good):
    assert _check_real("x", good) == float(good)


@pytest.mark.parametrize(
    "bad, exc, pattern",
    [
        ("0.5", TypeError, r"x='0.5' \(str\) must be a real number; pass a Python float"),
        (True, TypeError, r"x=True \(bool\)"),
        (torch.tensor(0.5), TypeError, r"\(Tensor\) must be a real number"),
        (None, TypeError, r"x=None \(NoneType\)"),
        (float("nan"), ValueError, "x=nan must be finite"),
        (float("inf"), ValueError, "x=inf must be finite"),
    ],
)
def test_check_real_refuses_what_is_not_a_finite_number(bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _check_real("x", bad)


def test_check_real_bounds():
    with pytest.raises(ValueError, match=r"x=0\.0 must be positive"):
        _check_real("x", 0.0, positive=True)
    with pytest.raises(ValueError, match="x=-1 must be non-negative"):
        _check_real("x", -1, nonnegative=True)


def test_a_string_sm_scale_fails_alike_on_both_precisions():
    """It used to run on the BF16 path (``float("0.5")``) and crash inside torch on FP8."""
    q, k, w = _carriers()
    for precision in ("bf16", "fp8"):
        config = IndexerPrecisionConfig(scoring_precision=precision)
        with pytest.raises(TypeError, match=r"sm_scale='0.5' \(str\)"):
            indexer_scores(q, k, w, config=config, sm_scale="0.5")


# --------------------------------------------------------- one precision object everywhere

# Public callables that take precision fields by design: the config itself, the engine profile
# (facts), and the preprocessing module (no quantization; built from the config's fields by the
# Megatron integration).
_FIELD_OWNERS = {"IndexerPrecisionConfig", "EngineProfile", "IndexerPreprocess"}
_LOOSE = {"scoring_precision", "engine", "rope_fp32"}
# Every public entry point that quantizes (carriers in, FP8 operands out, or further).
QUANTIZING = [
    "prepare_scoring_operands",
    "prepare_indexer_operands",
    "indexer_scores",
    "indexer_scores_varlen",
    "indexer_select",
    "indexer_select_varlen",
    "fused_indexer_sparse_attention",
]
# Entry points the tests keep beside the package (tests/support), not in it.
TEST_SUPPORT = {"fused_indexer_sparse_attention": fused_indexer_sparse_attention}


def _public_callables():
    """The package's public callables, and the entry points the tests keep beside it."""
    entries = {name: getattr(dsa_precision, name) for name in dsa_precision.__all__}
    for name, obj in {**entries, **TEST_SUPPORT}.items():
        if callable(obj) and name not in _FIELD_OWNERS:
            try:
                yield name, inspect.signature(obj)
            except (TypeError, ValueError):  # no signature (e.g. a C builtin)
                continue


def test_no_public_entry_point_takes_loose_precision_primitives():
    loose = {n: sorted(_LOOSE & set(sig.parameters)) for n, sig in _public_callables()}
    assert not {n: p for n, p in loose.items() if p}


@pytest.mark.parametrize("name", QUANTIZING)
def test_every_quantizing_entry_point_takes_the_config(name):
    entry = TEST_SUPPORT[name] if name in TEST_SUPPORT else getattr(dsa_precision, name)
    param = inspect.signature(entry).parameters["config"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert "IndexerPrecisionConfig" in str(param.annotation)


def test_removed_keywords_say_what_to_pass_now():
    @_takes_precision_config
    def f(*, config=None):
        return config

    assert f(config=BF16) is BF16
    with pytest.raises(TypeError) as info:
        f(scoring_precision="fp8", engine="vllm")
    assert str(info.value) == (
        "f() takes the precision as one object: pass config=IndexerPrecisionConfig("
        "scoring_precision='fp8', engine='vllm') instead of scoring_precision='fp8', "
        "engine='vllm'."
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'precision'"):
        f(precision="fp8")
