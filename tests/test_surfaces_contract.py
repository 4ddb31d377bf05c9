"""The newest surfaces held to the contract (issue 50): clean=False scores, objects built by hand
(engine profiles, kernel rules, RoPE specs, picks), picks on disk and digests. One row per case:
the exception type and a message naming the argument, the value and the fix; and the inputs
those checks must keep accepting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dsa_precision as dsa
from dsa_precision.capture import load_picks, save_picks
from dsa_precision.capture.digest import digest_mismatches, digest_rows
from dsa_precision.engines import ENGINE_PROFILES, Fp8Rule, vllm_legacy_profile
from dsa_precision.kernels.rules import PreprocessRules
from dsa_precision.picks import TokenLayout, TopkPicks
from dsa_precision.rope import RopeSpec, YarnScaling, _engine_rope_cache

CONFIG = dsa.IndexerPrecisionConfig()
CU = torch.tensor([0, 2, 5])
IDX = torch.tensor([[0], [0], [0], [1], [2]])


def _scores(**kw):
    q, k, w = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.rand(1, 4, 2)
    return lambda: dsa.indexer_scores(q, k, w, config=CONFIG, **kw)


def _scores_varlen(**kw):
    q, k, w = torch.randn(4, 2, 8), torch.randn(4, 8), torch.rand(4, 2)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    return lambda: dsa.indexer_scores_varlen(
        q, k, w, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4, config=CONFIG,
        **kw,
    )  # fmt: skip


def _rules(**kw):
    return lambda: PreprocessRules(**{"q_quant": Fp8Rule(), "k_quant": Fp8Rule(), **kw})


def _yarn(base: float = 10000.0, **kw):
    return lambda: RopeSpec(64, base, YarnScaling(**{"scaling_factor": 40.0,
                                                     "original_max_position_embeddings": 4096,
                                                     **kw}))  # fmt: skip


CASES = [
    # clean=False scores: a truthy non-bool would return the other type
    ("clean a string", _scores(clean="False"), TypeError, r"clean must be a bool, got 'False'"),
    ("clean an int", _scores_varlen(clean=0), TypeError, r"clean must be a bool, got 0"),
    # profiles built by hand
    ("xblock a bool", lambda: vllm_legacy_profile(compiled_tokens=10, sm_count=132, xblock=True),
     TypeError, r"xblock=True \(bool\) must be an integer"),
    ("xblock a float", lambda: vllm_legacy_profile(compiled_tokens=10, sm_count=132, xblock=8.0),
     TypeError, r"xblock=8.0 \(float\) must be an integer"),
    ("tokens a float", lambda: vllm_legacy_profile(compiled_tokens=10.0, sm_count=132, xblock=8),
     ValueError, r"compiled_tokens=10.0 must be a positive integer, got a float"),
    # the kernel's rules
    ("unknown LayerNorm rule", _rules(layer_norm="fp32-tree"), ValueError,
     r"PreprocessRules.layer_norm='fp32-tree' is not a rule the kernel knows; use one of"),
    ("unknown RoPE fma rule", _rules(rope_fma="sin"), ValueError, r"rope_fma='sin' is not a rule"),
    ("quant rule a string", _rules(q_quant="ue8m0"), TypeError, r"q_quant='ue8m0' must be an Fp8Rule"),
    ("rope_dim a float", _rules(rope_dim=64.0), TypeError, r"rope_dim=64.0 \(float\) must be an int"),
    ("flag a string", _rules(fma="no"), TypeError, r"PreprocessRules.fma='no' \(str\) must be a bool"),
    ("table dtype int", _rules(table_dtype=torch.int32), ValueError, r"table_dtype=torch.int32"),
    # RoPE specs no table can be built from
    ("YaRN base 1", _yarn(base=1.0), ValueError,
     r"YaRN's correction range of base=1.0 \(rotary_base\).*cannot be computed"),
    ("YaRN beta 0", _yarn(beta_fast=0), ValueError, r"beta_fast=0 must be positive"),
    ("YaRN beta infinite", _yarn(beta_fast=1e308), ValueError, r"correction range .*beta_fast=1e\+308"),
    ("YaRN magnitude <= 0", _yarn(mscale_all_dim=-10 / math.log(40)), ValueError,
     r"give the magnitude scale .*no cos/sin table is built from it"),
    ("YaRN factor underflows", _yarn(scaling_factor=1e-300), ValueError,
     r"with YaRN scaling_factor=1e-300 gives float32 inverse frequencies \[nan"),
    ("base underflows", lambda: RopeSpec(64, 1e-300), ValueError,
     r"base=1e-300 \(rotary_base\) gives float32 inverse frequencies \[1.0, inf"),
    ("base past float32", lambda: RopeSpec(64, 1e300), ValueError, r"infinite or zero frequencies"),
    # picks built by hand
    ("request ids short", lambda: TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU), request_ids=("a",)),
     ValueError, r"request_ids names 1 requests but cu_seqlens packs 2 sequences"),
    ("request ids a string", lambda: TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU), request_ids="ab"),
     TypeError, r"request_ids is 'ab'; pass a tuple"),
    ("engine rows indices", lambda: TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU),
                                              engine_rows=torch.tensor([0, 1])),
     TypeError, r"engine_rows is a int64 tensor of shape \(2,\); pass a \(T,\) bool mask"),
    ("engine rows short", lambda: TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU),
                                            engine_rows=torch.ones(4, dtype=torch.bool)),
     ValueError, r"engine_rows has 4 entries but cu_seqlens packs 5 tokens"),
    # digests
    ("digests as lists", lambda: digest_mismatches([IDX], [digest_rows(IDX)]), TypeError,
     r"digest_mismatches: ours is list; pass \{layer_number: tensor\}"),
    ("engine rows a list", lambda: digest_mismatches({1: IDX}, {1: digest_rows(IDX)}, [True] * 5),
     TypeError, r"engine_rows is list; pass a \(T,\) bool tensor"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_checks_keep_the_inputs_they_must_accept():
    assert vllm_legacy_profile(compiled_tokens=np.int64(10), sm_count=132, xblock=np.int64(8)).name \
        == "vllm-legacy-xblock8"  # fmt: skip
    assert isinstance(_scores(clean=False)(), dsa.WindowScores)
    assert isinstance(_scores_varlen(clean=True)(), torch.Tensor)
    for engine in ENGINE_PROFILES.values():  # every registered profile's rules still build
        PreprocessRules.carriers(engine)
    spec = RopeSpec(64, 10000.0, YarnScaling(40.0, 4096))  # DeepSeek-V3.2's
    cos, sin = _engine_rope_cache(spec, 16, device="cpu", engine=ENGINE_PROFILES["vllm"])
    assert bool(torch.isfinite(cos).all() and torch.isfinite(sin).all())
    picks = TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU), request_ids=["a", "b"],
                      engine_rows=torch.ones(5, dtype=torch.bool))  # fmt: skip
    assert picks.describe_row(3) == "request 'b' token 1"


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_save_picks_names_what_cannot_be_written(tmp_path, suffix):
    picks = TopkPicks({1: IDX}, TokenLayout(cu_seqlens=CU))
    missing = tmp_path / "missing" / f"picks{suffix}"
    with pytest.raises(ValueError, match=r"the folder .*missing does not exist; create it first"):
        save_picks(missing, picks)
    folder = tmp_path / f"folder{suffix}"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"a directory; pass the path of the file to write"):
        save_picks(folder, picks)
    for key, match in (("1", r"the layer key '1' \(str\) is not a layer number"),
                       (1.0, r"the layer key 1.0 \(float\)"), (0, r"the layer key 0 \(int\)"),
                       (True, r"the layer key True \(bool\)")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            save_picks(tmp_path / f"bad{suffix}", TopkPicks({key: IDX}, picks.layout))
    with pytest.raises(TypeError, match=r"layer 1 holds list; pass \(T, k\) integer picks"):
        save_picks(tmp_path / f"bad{suffix}", TopkPicks({1: [[0]]}, picks.layout))
    # A NumPy integer key is a layer number: saved as layer_03 and read back as 3.
    save_picks(tmp_path / f"np{suffix}", TopkPicks({np.int64(3): IDX}, picks.layout))
    loaded = load_picks(tmp_path / f"np{suffix}")
    assert list(loaded.indices) == [3] and torch.equal(loaded.indices[3], IDX)
