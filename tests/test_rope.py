"""RoPE of the indexer (dsa_precision.rope): per-token angles of packed sequences."""

import itertools

import pytest
import torch


def _positions_reference(cu: list[int]) -> list[int]:
    return [t - a for a, b in itertools.pairwise(cu) for t in range(a, b)]


@pytest.mark.parametrize("cu", [[0, 5], [0, 3, 3, 10], [0, 1, 2, 3, 4], [0, 7, 8, 16]])
def test_thd_token_freqs_restarts_positions_per_sequence(cu):
    from dsa_precision.preprocess import _thd_token_freqs

    freqs = torch.randn(9, 1, 1, 8)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    want = freqs[_positions_reference(cu)] if longest <= 9 else None
    for total in (None, cu[-1]):
        if want is None:
            with pytest.raises(ValueError, match="freqs covers 9 positions but a packed sequence"):
                _thd_token_freqs(freqs, cu_t, total)
            continue
        got = _thd_token_freqs(freqs, cu_t, total)
        assert torch.equal(got, want), (cu, total)
    table = torch.randn(cu[-1], 1, 1, 8)  # one row per packed token: used as is
    assert _thd_token_freqs(table, cu_t, cu[-1]) is table


def test_thd_token_freqs_checks_host_lengths_against_the_rows():
    from dsa_precision.preprocess import _thd_token_freqs

    freqs = torch.randn(8, 1, 1, 8)
    with pytest.raises(ValueError, match=r"packs 6 tokens but the input has 7 packed rows"):
        _thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 7)
    # more packed tokens than rows (a padded tail past the input): the first rows' angles
    assert torch.equal(_thd_token_freqs(freqs, torch.tensor([0, 2, 6]), 3), freqs[[0, 1, 0]])
    with pytest.raises(ValueError, match="total=-1 must be a positive integer"):
        _thd_token_freqs(freqs, torch.tensor([0, 2]), -1)


def test_thd_token_freqs_of_no_rows_and_a_models_own_rope_with_padded_rows():
    from dsa_precision.preprocess import IndexerPreprocess, _thd_token_freqs

    freqs = torch.randn(4, 1, 1, 16)
    assert _thd_token_freqs(freqs, torch.tensor([0]), 0).shape == (0, 1, 1, 16)
    # A model's own RoPE (rope_fn) takes freqs and cu_seqlens itself: rows past cu_seqlens[-1]
    # (padding) are its business, no per-token table is built.
    seen = []

    def rope_fn(x, f, mscale, cu):
        seen.append(cu.tolist())
        return x

    pre = IndexerPreprocess(
        head_dim=64, rope_dim=16, k_norm=torch.nn.LayerNorm(64), rope_fn=rope_fn
    )
    q, k = torch.randn(6, 1, 2, 64), torch.randn(6, 1, 64)
    pre(q, k, freqs, cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32))
    assert seen == [[0, 4, 5], [0, 4, 5]]


# ----------------------------------------------------------------- the engines' own RoPE tables


def _vllm_reference(base, rope_dim: int, n: int, yarn: dict | None = None):
    """vLLM 0.33's cos_sin_cache in float32, written here from its source, line by line
    (``rotary_embedding/base.py`` ``_compute_inv_freq`` / ``_compute_cos_sin_cache``;
    ``deepseek_scaling_rope.py`` and ``common.py`` for YaRN): ``(cos, sin)`` ``[n, R / 2]``."""
    import math

    if yarn is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        t = torch.arange(n, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return freqs.cos(), freqs.sin()
    factor, max_pos = yarn["factor"], yarn["original_max_position_embeddings"]
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)

    def find_dim(num_rotations):
        return (rope_dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(find_dim(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001
    linear = (torch.arange(rope_dim // 2, dtype=torch.float) - low) / (high - low)
    inv_freq_mask = 1 - torch.clamp(linear, 0, 1)
    inv_freq = inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale = float(
        get_mscale(factor, float(yarn["mscale"]))
        / get_mscale(factor, float(yarn["mscale_all_dim"]))
    )
    t = torch.arange(n, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return freqs.cos() * mscale, freqs.sin() * mscale


V32_YARN = dict(
    factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
    mscale_all_dim=1.0,
)  # fmt: skip
ROPES = {  # name: (base, yarn)
    "rope-1e4": (10000, None),
    "rope-1e6 (GLM-5)": (1e6, None),
    "yarn (DeepSeek-V3.2)": (10000, V32_YARN),
}


def _spec(base, yarn):
    from dsa_precision.rope import RopeSpec, YarnScaling

    scaling = None
    if yarn is not None:
        y = dict(yarn)
        scaling = YarnScaling(y.pop("factor"), **y)
    return RopeSpec(64, base, scaling)


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "sglang-fused", "lmdeploy"])
def test_engine_rope_cache_is_the_engines_formula_bit_for_bit(rope, profile):
    """The tables rope_fp32 reads are vLLM's recipe, checked against an independent reference
    written from vLLM's source (float32 ops on the CPU: what a CPU-built engine cache holds);
    LMDeploy's inv_freq on the CPU is the same here, where everything is the CPU."""
    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.rope import _engine_rope_cache

    base, yarn = ROPES[rope]
    n = 65536
    cos, sin = _engine_rope_cache(
        _spec(base, yarn), n, device="cpu", engine=ENGINE_PROFILES[profile]
    )
    ref_cos, ref_sin = _vllm_reference(base, 64, n, yarn)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (n, 32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_yarn_tables_scale_by_the_engines_magnitude():
    """A YaRN magnitude other than 1 is folded into cos / sin in float32 (vLLM's ``cos *
    mscale``); LMDeploy forms it from mscale alone when mscale_all_dim is 0."""
    import math

    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.rope import YarnScaling, _engine_rope_cache

    y = YarnScaling(40.0, 4096, mscale=0.707, mscale_all_dim=0.0)
    g = 0.1 * math.log(40.0)
    assert y.magnitude("ratio") == (0.1 * 0.707 * math.log(40.0) + 1.0) / 1.0
    assert y.magnitude("ratio-if-both") == g + 1.0  # LMDeploy: yarn_get_mscale(factor)
    assert YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0).magnitude() == 1.0
    assert YarnScaling(0.5, 4096, mscale=0.707).magnitude() == 1.0  # no scaling below 1
    spec = _spec(10000, {**V32_YARN, "mscale": 0.707, "mscale_all_dim": 0.0})
    vllm = _engine_rope_cache(spec, 512, device="cpu", engine=ENGINE_PROFILES["vllm"])
    lmd = _engine_rope_cache(spec, 512, device="cpu", engine=ENGINE_PROFILES["lmdeploy"])
    ref = _vllm_reference(10000, 64, 512, {**V32_YARN, "mscale": 0.707, "mscale_all_dim": 0.0})
    assert torch.equal(vllm[0], ref[0]) and torch.equal(vllm[1], ref[1])
    assert not torch.equal(lmd[0], vllm[0])


def test_an_entry_depends_on_its_position_only():
    """The design builds one table per power-of-two length and reads rows of it: an entry must
    not depend on how long the table is (vectorised loops, thread chunks), checked on this CPU
    for vLLM's cache length of DeepSeek-V3.2 (163840) against shorter ones."""
    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.rope import _engine_rope_cache

    spec, e = _spec(10000, V32_YARN), ENGINE_PROFILES["vllm"]
    long_cos, long_sin = _engine_rope_cache(spec, 163840, device="cpu", engine=e)
    for n in (4096, 8191, 37):
        cos, sin = _engine_rope_cache(spec, n, device="cpu", engine=e)
        assert torch.equal(cos, long_cos[:n]) and torch.equal(sin, long_sin[:n]), n


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "lmdeploy"])
def test_engine_tables_gather_the_cache_rows_of_the_positions(profile):
    """EngineRopeTables.rows: the engine's cache rounded to its cos_sin_dtype, in the dtype asked,
    the halves repeated (Megatron's rotate-half layout), at the positions asked."""
    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.rope import EngineRopeTables, RopePositions, _engine_rope_cache

    e = ENGINE_PROFILES[profile]
    spec = _spec(1e6, None)
    tables = EngineRopeTables(spec, e)
    ref_cos, ref_sin = _engine_rope_cache(spec, 300, device="cpu", engine=e)
    ref_cos, ref_sin = ref_cos.to(e.cos_sin_dtype), ref_sin.to(e.cos_sin_dtype)
    cos, sin = tables.rows(RopePositions.first(300), "cpu", e.rope_dtype)
    assert cos.dtype == e.rope_dtype and cos.shape == (300, 64) and cos.is_contiguous()
    assert torch.equal(cos, torch.cat((ref_cos, ref_cos), -1).to(e.rope_dtype))
    assert torch.equal(sin, torch.cat((ref_sin, ref_sin), -1).to(e.rope_dtype))
    index = torch.tensor([7, 0, 299, 7, 150])
    cos_i, sin_i = tables.rows(RopePositions(5, 300, index), "cpu", torch.float32)
    assert torch.equal(cos_i[:, :32], ref_cos[index].float())
    assert torch.equal(sin_i[:, 32:], ref_sin[index].float())
    # Built once per length class and device, shared by every layer: the same storage again.
    again, _ = EngineRopeTables(spec, e).rows(RopePositions.first(10), "cpu", e.rope_dtype)
    assert again.data_ptr() == cos.data_ptr()


def test_rope_positions_of_packed_sequences_are_thd_token_freqs_positions():
    from dsa_precision.rope import RopePositions, _thd_token_freqs

    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    p = RopePositions.packed(cu, 10, 8, device="cpu")
    assert p.index.tolist() == _positions_reference([0, 3, 3, 10]) and p.length == 8
    freqs = torch.randn(8, 1, 1, 4)
    assert torch.equal(freqs[p.index], _thd_token_freqs(freqs, cu, 10))
    # One angle row per packed token: positions are the rows themselves (no index).
    assert RopePositions.packed(cu, 10, 10, device="cpu").index is None
    with pytest.raises(ValueError, match="freqs covers 4 positions but a packed sequence has 7"):
        RopePositions.packed(cu, 10, 4, device="cpu")


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda P: P(5, 4), r"rows=5 positions 0 \.\. 4 are not below length=4"),
        (lambda P: P(-1, 4), r"rows=-1 must be a non-negative integer"),
        (lambda P: P(2, 0), r"length=0 must be a positive integer"),
        (lambda P: P(2, 4, torch.tensor([0, 1], dtype=torch.int32)), r"index must be an int64"),
        (lambda P: P(3, 4, torch.tensor([0, 1])), r"shape \(3,\)"),
    ],
)
def test_rope_positions_name_what_is_wrong(build, match):
    from dsa_precision.rope import RopePositions

    with pytest.raises(ValueError, match=match):
        build(RopePositions)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda S, Y: S(63, 1e4), ValueError, "rope_dim=63 must be even"),
        (lambda S, Y: S(64, 0), ValueError, "base=0 must be positive"),
        (lambda S, Y: S(64, 1e4, "yarn"), TypeError, "must be a YarnScaling or None"),
        (lambda S, Y: Y(40, 4096, mscale=None), TypeError, "mscale=None"),
        (lambda S, Y: Y(0, 4096), ValueError, "scaling_factor=0 must be positive"),
        (lambda S, Y: Y(40, 0), ValueError, "original_max_position_embeddings=0"),
    ],
)
def test_rope_spec_names_what_is_wrong(build, error, match):
    from dsa_precision.rope import RopeSpec, YarnScaling

    with pytest.raises(error, match=match):
        build(RopeSpec, YarnScaling)


def test_preprocess_with_engine_tables_reads_them_not_the_angles():
    """IndexerPreprocess(rope_fp32, rope_tables): the engine's tables at the positions, whatever
    the angles handed in (which then only serve the shape checks); without tables, the angles'."""
    from dsa_precision import ENGINE_PROFILES
    from dsa_precision.preprocess import IndexerPreprocess
    from dsa_precision.rope import EngineRopeTables, RopePositions, _rope_inv_freq

    e = ENGINE_PROFILES["vllm"]
    spec = _spec(10000, None)
    norm = torch.nn.LayerNorm(128, eps=1e-6)
    tables = EngineRopeTables(spec, e)
    ours = IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine=e, rope_tables=tables)
    plain = IndexerPreprocess(128, 64, k_norm=norm, rope_fp32=True, engine=e)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(40, 1, 4, 128, generator=g).bfloat16()
    k = torch.randn(40, 1, 128, generator=g).bfloat16()
    f = torch.outer(torch.arange(40, dtype=torch.float32), _rope_inv_freq(spec, "cpu"))
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    want = plain(q, k, freqs)
    got = ours(q, k, freqs + 1e-3)  # other angles: not read
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Positions of a context-parallel rank: the rows of those positions.
    index = torch.arange(40, 80)
    shifted = ours(q, k, freqs, positions=RopePositions(40, 80, index))
    f80 = torch.outer(torch.arange(80, dtype=torch.float32), _rope_inv_freq(spec, "cpu"))[40:]
    far = plain(q, k, torch.cat((f80, f80), -1)[:, None, None, :])
    assert torch.equal(shifted[0], far[0]) and torch.equal(shifted[1], far[1])
    with pytest.raises(ValueError, match="rope_tables are the engine's tables of the rope_fp32"):
        IndexerPreprocess(128, 64, k_norm=norm, engine=e, rope_tables=tables)
    with pytest.raises(ValueError, match="are not of engine='lmdeploy'"):
        IndexerPreprocess(
            128, 64, k_norm=norm, rope_fp32=True, engine=ENGINE_PROFILES["lmdeploy"],
            rope_tables=tables,
        )  # fmt: skip


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_fma_cos_sin_is_sglangs_contraction_of_the_complex_product(interleaved):
    """rope_fma="cos-sin" on a pair (a, b) with cos c and sin s, as nvcc compiles SGLang's
    ``x_real * c - x_imag * s`` / ``x_real * s + x_imag * c`` (its SASS: FFMA(c, a, -FMUL(s, b)),
    FFMA(s, a, FMUL(c, b))): real fma(a, c, -fl(b s)), imag fma(a, s, fl(b c)); "cos" fuses b c
    on the imaginary lane instead, and the two differ."""
    from dsa_precision.exact_math import fma_fp32
    from dsa_precision.rope import _apply_rope_tables

    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 1, 1, 128, generator=g) * 4
    ang = torch.rand(64, 1, 1, 32, generator=g) * 6
    cos, sin = torch.cat((ang.cos(),) * 2, -1), torch.cat((ang.sin(),) * 2, -1)
    got = _apply_rope_tables(
        x, cos, sin, rope_interleaved=interleaved, fma=True, rope_fma="cos-sin"
    )
    a, b = (x[..., 0:64:2], x[..., 1:64:2]) if interleaved else (x[..., :32], x[..., 32:64])
    c, s = cos[..., :32], sin[..., :32]
    real = fma_fp32(a, c, -(b * s))
    imag = fma_fp32(a, s, b * c)
    assert torch.equal(got[..., :32], real) and torch.equal(got[..., 32:64], imag)
    assert torch.equal(got[..., 64:], x[..., 64:])
    cos_only = _apply_rope_tables(x, cos, sin, rope_interleaved=interleaved, fma=True)
    assert torch.equal(cos_only[..., :32], real) and not torch.equal(cos_only[..., 32:64], imag)
    with pytest.raises(ValueError, match="rope_fma='sin'"):
        _apply_rope_tables(x, cos, sin, fma=True, rope_fma="sin")
