"""Engine profiles: the quantizer and the head-weight fold of every profile against an
independent model of the profile's formula, written from the engines' sources (docs/numerics.md)
in exact rational arithmetic: the power-of-two boundaries, the floors, zeros, subnormal amax and
FP32 carriers; and the profile / model validation.
"""

import dataclasses
import math
import struct
from fractions import Fraction

import pytest
import torch

from dsa_precision import ENGINE_PROFILES, EngineProfile, IndexerPrecisionConfig, quantize_fp8
from dsa_precision.engines import DEFAULT_ENGINE, Fp8Rule
from dsa_precision.prepare import _fold_head_weights

PROFILES = sorted(ENGINE_PROFILES)


# ------------------------------------------------------------------- the independent model


def f32(x: Fraction) -> Fraction:
    """Round an exact rational to the nearest float32 (ties to even), exactly."""
    if x == 0:
        return Fraction(0)
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = math.floor(math.log2(a))
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, -126)  # subnormals share the smallest normal exponent
    step = Fraction(2) ** (e - 23)
    q, r = divmod(a, step)
    if r > step / 2 or (r == step / 2 and q % 2 == 1):
        q += 1
    return sign * q * step


def e4m3(v: Fraction) -> Fraction:
    """Round |v| <= 448 to the nearest float8_e4m3fn value (ties to even), exactly."""
    a = abs(v)
    e = max(math.floor(math.log2(a)) if a else -6, -6)
    while e > -6 and Fraction(2) ** e > a:
        e -= 1
    step = Fraction(2) ** (e - 3)
    q, r = divmod(a, step)
    if r > step / 2 or (r == step / 2 and q % 2 == 1):
        q += 1
    return (-1 if v < 0 else 1) * q * step


def model_descale(amax: Fraction, rule: Fp8Rule) -> Fraction:
    """The engine's formula (docs/numerics.md), evaluated exactly with its float32 roundings."""
    a = max(amax, f32(Fraction(rule.amax_floor)))
    if rule.scale_ratio == "exact":
        e = -200
        while a > 448 * Fraction(2) ** e:
            e += 1
        return Fraction(2) ** e
    if rule.scale_ratio == "divide":
        r = f32(a / 448)
    else:
        r = f32(a * f32(Fraction(1, 448)))
    if rule.scale_format == "fp32":
        return r
    if rule.ue8m0_ceil == "bits":
        e = -200
        while Fraction(2) ** e < r:
            e += 1
        return Fraction(2) ** e
    # exp2(ceil(log2(r))) with a float32 log2 (computed in double, then rounded to float32)
    log2 = float(f32(Fraction(math.log2(r))))
    return Fraction(2) ** math.ceil(log2)


def model_quantize(row: list[float], rule: Fp8Rule) -> tuple[list[Fraction], Fraction]:
    values = [Fraction(v) for v in row]
    s = model_descale(max(abs(v) for v in values), rule)
    if rule.scale_apply == "divide":
        scaled = [f32(v / s) for v in values]
    else:
        inv = f32(1 / s)
        scaled = [f32(v * inv) for v in values]
    return [e4m3(max(min(v, Fraction(448)), Fraction(-448))) for v in scaled], s


def _bits_above(x: float, ulps: int) -> float:
    b = struct.unpack("<I", struct.pack("<f", x))[0] + ulps
    return struct.unpack("<f", struct.pack("<I", b))[0]


def edge_rows() -> torch.Tensor:
    """float32 ``[n, 128]``: amax -1..3 ulps around ``448 * 2**e`` (exact-ratio boundaries) and
    around ``448 * 2**e`` seen through the float32 ratio (log2 band: |e| in 8..40), zeros, amax
    under the floors, subnormals, +-448 and FP32 carriers."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for e in (-40, -30, -12, -9, -4, 0, 3, 20):
        base = 448.0 * 2.0**e
        for ulps in (-1, 0, 1, 2, 3, 5, 12):
            row = (torch.rand(128, generator=g) - 0.5) * base
            row[int(torch.randint(128, (1,), generator=g))] = -_bits_above(base, ulps)
            rows.append(row)
    rows += [torch.zeros(128), torch.full((128,), 1e-7), torch.full((128,), 3e-11)]
    rows.append(torch.tensor([2.0**-140, -(2.0**-149)] * 64))
    rows.append(torch.tensor([448.0, -448.0] * 64))
    rows += [torch.randn(128, generator=g) * 10.0**p for p in (-6, -2, 0, 3)]
    return torch.stack(rows)


@pytest.mark.parametrize("tensor", ["q", "k"])
@pytest.mark.parametrize("name", PROFILES)
def test_quantizer_matches_the_engine_formula(name, tensor):
    rule = getattr(ENGINE_PROFILES[name], f"{tensor}_quant")
    x = edge_rows()
    x8, descale = quantize_fp8(x, rule)
    for i, row in enumerate(x.tolist()):
        values, s = model_quantize(row, rule)
        assert Fraction(descale[i].item()) == s, (name, tensor, i, descale[i].item(), float(s))
        got = [Fraction(v) for v in x8[i].float().tolist()]
        assert got == values, (name, tensor, i)


def test_the_rules_really_differ_at_the_boundaries():
    x = edge_rows()
    descales = {name: quantize_fp8(x, ENGINE_PROFILES[name].q_quant)[1] for name in ENGINE_PROFILES}
    exact = descales["vllm-exact"]
    assert not torch.equal(descales["vllm"], exact)  # log2 band: one binade smaller
    assert bool((descales["vllm"] <= exact).all())
    fp32 = descales["sglang-fused"]
    assert not bool((torch.frexp(fp32)[0] == 0.5).all())  # plain float32 scales
    assert not torch.equal(descales["lmdeploy"], exact)  # floor fl32(1e-6) on tiny vectors


@pytest.mark.parametrize("name", PROFILES)
def test_head_weight_fold_matches_the_engine_order(name):
    engine = ENGINE_PROFILES[name]
    g = torch.Generator().manual_seed(1)
    for heads in (32, 64):
        w = torch.randn(5, heads, generator=g).to(torch.bfloat16).float()
        qs = torch.rand(5, heads, generator=g) * 2.0 ** torch.randint(-20, -5, (5, heads))
        got = _fold_head_weights(w, qs, engine.weights_fold, n_heads=heads, head_dim=128)
        constants = {
            "Ds": f32(Fraction(128**-0.5)),
            "Hs": f32(Fraction(heads**-0.5)),
            "DsHs": f32(Fraction(128**-0.5 * heads**-0.5)),
        }
        for (i, j), value in zip(
            torch.cartesian_prod(torch.arange(5), torch.arange(heads)).tolist(),
            got.flatten().tolist(),
            strict=True,
        ):
            want = Fraction(w[i, j].item())
            for step in engine.weights_fold:
                want = f32(want * (Fraction(qs[i, j].item()) if step == "qs" else constants[step]))
            assert Fraction(value) == want, (name, heads, i, j)


def test_fold_orders_differ_where_h_is_not_a_power_of_four():
    w = torch.randn(64, 32).to(torch.bfloat16).float()
    qs = torch.full((64, 32), 0.37)  # SGLang's plain scales are not powers of two
    folds = {
        steps: _fold_head_weights(w, qs, steps, n_heads=32, head_dim=128)
        for steps in (("Ds", "Hs", "qs"), ("DsHs", "qs"), ("Hs", "qs", "Ds"))
    }
    values = list(folds.values())
    assert not torch.equal(values[0], values[1]) and not torch.equal(values[1], values[2])


# ------------------------------------------------------------------------- validation


def test_vllm_exact_quantizes_as_the_original_contract():
    """``vllm-exact`` (the default before ``vllm``) quantizes q and k as the package's original
    contract, computed here without any rule field: the descale is the smallest power of two
    ``s`` with ``max(amax, fp32(1e-4)) <= 448 * s``, the values ``e4m3(v / s)``."""
    engine = ENGINE_PROFILES["vllm-exact"]
    x = edge_rows()
    floor = f32(Fraction(1e-4))
    for rule in (engine.q_quant, engine.k_quant):
        x8, descale = quantize_fp8(x, rule)
        for i, row in enumerate(x.tolist()):
            a, e = max(max(abs(Fraction(v)) for v in row), floor), -200
            while a > 448 * Fraction(2) ** e:
                e += 1
            assert Fraction(descale[i].item()) == Fraction(2) ** e, i
            got = [Fraction(v) for v in x8[i].float().tolist()]
            assert got == [e4m3(Fraction(v) / Fraction(2) ** e) for v in row], i


def test_default_profile_is_vllms_default_run():
    assert DEFAULT_ENGINE.name == "vllm" and IndexerPrecisionConfig().engine is DEFAULT_ENGINE
    assert DEFAULT_ENGINE.cos_sin_dtype == torch.bfloat16 and DEFAULT_ENGINE.fma
    assert DEFAULT_ENGINE.layernorm == "fp32-ops" and DEFAULT_ENGINE.k_norm_eps == 1e-6
    # The two switches stay stock Megatron.
    config = IndexerPrecisionConfig()
    assert not config.rope_fp32 and not config.fp8


def test_vllm_exact_stays_the_literal_all_fp32_contract():
    exact = ENGINE_PROFILES["vllm-exact"]
    assert exact.q_quant == exact.k_quant == Fp8Rule()
    assert exact.cos_sin_dtype == exact.k_norm_dtype == exact.q_dtype == torch.float32
    assert (exact.layernorm, exact.fma, exact.k_norm_eps) == ("float64", False, None)
    assert exact.hadamard_scale == "float64"


def test_lmdeploy_floor_is_float32():
    """LMDeploy's tl.max promotes the BF16 amax to float32: the floor is fl32(1e-6)."""
    rule = ENGINE_PROFILES["lmdeploy"].q_quant
    assert struct.pack("<f", rule.amax_floor) == struct.pack("<f", 1e-6)
    assert ENGINE_PROFILES["lmdeploy"].k_quant == rule


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cos_sin_dtype=torch.float16), "cos_sin_dtype=torch.float16"),
        (dict(weights_fold=("Ds", "qs")), "weights_fold=.*'Hs'"),
        (dict(weights_fold=("Ds", "Hs", "qs", "qs")), "weights_fold="),
        (dict(weights_dtype="fp16"), "weights_dtype='fp16'"),
        (dict(layernorm="fp16-ops"), "layernorm='fp16-ops'"),
        (dict(hadamard_scale="fp16"), "hadamard_scale='fp16'"),
        (dict(k_norm_eps=0.0), "k_norm_eps=0.0"),
        (dict(k_norm_eps=float("nan")), "k_norm_eps=nan"),
    ],
)
def test_profile_construction_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEFAULT_ENGINE, name="custom", **change)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(scale_ratio="log"), "scale_ratio='log'"),
        (dict(scale_format="fp32"), "scale_format='fp32' is the float32 ratio itself"),
        (dict(amax_floor=0.0), "amax_floor=0.0"),
        (dict(ue8m0_ceil="round"), "ue8m0_ceil='round'"),
    ],
)
def test_rule_construction_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        Fp8Rule(**change)


def test_engine_names_are_validated():
    with pytest.raises(ValueError, match=r"engine='tgi' is not an engine profile; use one of"):
        IndexerPrecisionConfig(engine="tgi")
    custom = dataclasses.replace(DEFAULT_ENGINE, name="custom", q_quant=Fp8Rule(amax_floor=1e-10))
    assert IndexerPrecisionConfig(engine=custom).engine is custom


@pytest.mark.parametrize(
    "name, model, match",
    [
        ("sglang-unfused", dict(rotate_activation=False), "applies the Hadamard rotation"),
        ("vllm", dict(rotate_activation=True), "does not apply the Hadamard rotation"),
        ("sglang-fused", dict(rope_interleaved=False), "path for interleaved indexer RoPE"),
        ("sglang-unfused", dict(rotate_activation=True, rope_interleaved=True), "rotate-half"),
    ],
)
def test_a_model_that_cannot_reproduce_the_engine_is_a_configuration_error(name, model, match):
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine=name)
    fields = dict(rotate_activation=False, rope_interleaved=False) | model
    with pytest.raises(ValueError, match=match):
        config.validate_for_model(indexer_loss_coeff=0.0, n_heads=32, head_dim=128, **fields)


def test_profile_fma_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fma must be a bool, got 1 \(int\); pass True or False"):
        dataclasses.replace(DEFAULT_ENGINE, name="custom", fma=1)


@pytest.mark.parametrize("name", ["vllm", "vllm-eager", "lmdeploy"])
def test_a_model_whose_k_norm_eps_is_not_the_engines_is_a_configuration_error(name):
    """vLLM and LMDeploy hard-code the indexer k_norm epsilon (1e-6); Megatron's k_norm takes
    layernorm_epsilon (1e-5 by default): the message names both values."""
    engine = ENGINE_PROFILES[name]
    problems = engine.model_mismatch(
        rotate_activation=False, rope_interleaved=False, k_norm_eps=1e-5
    )
    assert len(problems) == 1 and "epsilon 1e-06" in problems[0] and "eps=1e-05" in problems[0]
    assert not engine.model_mismatch(
        rotate_activation=False, rope_interleaved=False, k_norm_eps=1e-6
    )
    # vllm-exact is the package's contract, not an engine: any epsilon.
    assert not ENGINE_PROFILES["vllm-exact"].model_mismatch(
        rotate_activation=False, rope_interleaved=False, k_norm_eps=1e-5
    )


def test_validate_for_model_checks_the_k_norm_eps_with_rope_fp32_only():
    fields = dict(indexer_loss_coeff=0.0, n_heads=32, head_dim=128, k_norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"epsilon 1e-06 .* eps=1e-05"):
        IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8").validate_for_model(**fields)
    IndexerPrecisionConfig(scoring_precision="fp8").validate_for_model(**fields)  # Megatron's LN


def test_profiles_are_facts_only():
    """engines.py imports nothing of the package (the facts stand alone)."""
    import ast
    import pathlib

    import dsa_precision.engines as engines

    tree = ast.parse(pathlib.Path(engines.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert all(n.level == 0 and not (n.module or "").startswith("dsa_precision") for n in imports)
    assert all(isinstance(p, EngineProfile) for p in ENGINE_PROFILES.values())


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(inv_freq_device="gpu"), "inv_freq_device='gpu' is not one of"),
        (dict(yarn_mscale="product"), "yarn_mscale='product' is not one of"),
        (dict(rope_type="ntk"), "rope_type='ntk' is not one of"),
        (dict(projection_dtype=torch.int8), "projection_dtype=torch.int8 must be"),
    ],
)
def test_the_rope_table_facts_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineProfile(name="x", summary="x", **fields)


def test_the_rope_table_recipes_of_the_profiles():
    """docs/numerics.md, "RoPE tables": vLLM and SGLang build inv_freq on the device, LMDeploy
    on the CPU (with its own YaRN magnitude rule); vLLM's eager profile is its YaRN path."""
    recipes = {
        name: (p.inv_freq_device, p.yarn_mscale, p.rope_type, p.projection_dtype)
        for name, p in ENGINE_PROFILES.items()
    }
    bf16 = torch.bfloat16
    assert recipes == {
        "vllm-exact": ("device", "ratio", None, None),
        "vllm": ("device", "ratio", None, bf16),
        "vllm-eager": ("device", "ratio", "yarn", bf16),
        "vllm-legacy": ("device", "ratio", None, bf16),
        "sglang-fused": ("device", "ratio", None, bf16),
        "sglang-unfused": ("device", "ratio", None, bf16),
        "lmdeploy": ("cpu", "ratio-if-both", None, bf16),
    }
