"""Inputs and bitwise checks shared by the fused-kernel tests (interpreter and GPU)."""

from __future__ import annotations

import dataclasses
import struct

import torch

from dsa_precision import ENGINE_PROFILES, IndexerPrecisionConfig
from dsa_precision.engines import DEFAULT_ENGINE, EngineProfile
from dsa_precision.operands import ScoringOperands
from dsa_precision.prepare import prepare_indexer_operands
from dsa_precision.preprocess import IndexerPreprocess

ROPE_DIM = 64


@dataclasses.dataclass
class Case:
    """Megatron-layout projections and the preprocessing module that consumes them."""

    pre: IndexerPreprocess
    q: torch.Tensor  # [s, b, h, 128]
    k: torch.Tensor  # [s, b, 128]
    w: torch.Tensor  # [s, b, h]
    freqs: torch.Tensor  # [s or max_len, 1, 1, 64]
    cu_seqlens: torch.Tensor | None = None


def rope_freqs(positions: int, *, device="cpu", base: float = 10000.0) -> torch.Tensor:
    """Megatron's rotate-half angle table ``[positions, 1, 1, 64]`` (float32)."""
    inv = base ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device=device) / ROPE_DIM)
    pos = torch.arange(positions, dtype=torch.float32, device=device)
    return torch.cat([torch.outer(pos, inv)] * 2, -1).view(positions, 1, 1, ROPE_DIM)


def make_preprocess(
    *,
    rope_fp32: bool,
    hadamard: bool,
    interleaved: bool,
    k_norm_fp32: bool = False,
    params: torch.dtype = torch.bfloat16,
    engine: EngineProfile = DEFAULT_ENGINE,
    device="cpu",
) -> IndexerPreprocess:
    pre = IndexerPreprocess(
        128,
        ROPE_DIM,
        rope_interleaved=interleaved,
        rotate_activation=hadamard,
        k_norm_fp32=k_norm_fp32,
        rope_fp32=rope_fp32,
        engine=engine,
    )
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        pre.k_norm.weight.copy_(1.0 + 0.2 * torch.randn(128, generator=g))
        pre.k_norm.bias.copy_(0.2 * torch.randn(128, generator=g))
    # BF16 LayerNorm parameters as in training (Megatron's Float16Module); a module that runs on
    # float32 input (k_norm_fp32, float32 projections) needs float32 ones.
    return pre.to(device=device, dtype=params)


def make_case(
    *,
    seq: int = 8,
    batch: int = 2,
    heads: int = 32,
    rope_fp32: bool = True,
    hadamard: bool = False,
    interleaved: bool = False,
    k_norm_fp32: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    w_dtype: torch.dtype = torch.bfloat16,
    packed: list[int] | None = None,
    engine: EngineProfile = DEFAULT_ENGINE,
    device="cpu",
    seed: int = 0,
) -> Case:
    """Random projections whose magnitudes span ~2**-12 .. 2**8 across heads and lanes."""
    pre = make_preprocess(
        rope_fp32=rope_fp32,
        hadamard=hadamard,
        interleaved=interleaved,
        k_norm_fp32=k_norm_fp32,
        params=torch.float32 if k_norm_fp32 or dtype == torch.float32 else torch.bfloat16,
        engine=engine,
        device=device,
    )
    g = torch.Generator(device=device).manual_seed(seed)
    cu = None
    if packed is not None:
        seq, batch = sum(packed), 1
        cu = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.to(device)
    spread = torch.logspace(-12, 8, heads, base=2.0, device=device).view(1, 1, heads, 1)
    lane = torch.logspace(-3, 3, 128, base=2.0, device=device)
    q = (torch.randn(seq, batch, heads, 128, device=device, generator=g) * spread * lane).to(dtype)
    k = (torch.randn(seq, batch, 128, device=device, generator=g) * 3.0 * lane).to(dtype)
    w = (torch.randn(seq, batch, heads, device=device, generator=g) * heads**-0.5).to(w_dtype)
    positions = max(packed) if packed else seq
    return Case(pre, q, k, w, rope_freqs(positions, device=device), cu)


def float32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def hard_vectors(device="cpu") -> torch.Tensor:
    """float32 ``[n, 128]`` vectors at the edges of the E4M3/UE8M0 rule: amax 0..3 ulps above
    ``448 * 2**e`` (and one below), zeros and sub-floor values, float32 subnormals, +-448, mixed
    signs and signed zeros, E4M3 rounding ties, huge values, and NaN / +-Inf vectors."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for e in (-30, -9, 0, 1, 7, 100):
        boundary = struct.unpack("<I", struct.pack("<f", 448.0 * 2.0**e))[0]
        for ulps in (-1, 0, 1, 2, 3):
            v = torch.randn(128, generator=g) * 448.0 * 2.0**e / 4
            v = v.clamp(-448.0 * 2.0**e / 2, 448.0 * 2.0**e / 2)
            v[int(torch.randint(128, (1,), generator=g))] = float32(boundary + ulps) * (
                -1 if ulps % 2 else 1
            )
            rows.append(v)
    rows.append(torch.zeros(128))
    rows.append(torch.full((128,), -0.0))
    rows.append(torch.randn(128, generator=g) * 1e-6)  # amax below the 1e-4 floor
    sub = torch.randint(1, 1 << 23, (128,), generator=g, dtype=torch.int32)
    rows.append(sub.view(torch.float32) * torch.where(torch.rand(128, generator=g) < 0.5, -1, 1))
    rows.append(torch.tensor([448.0, -448.0] * 64))
    # E4M3 ties after scaling by 2**-e (descale 1 here: amax 448): odd multiples of half-steps.
    ties = (torch.arange(128, dtype=torch.float32) * 2 + 1) * 2.0**-10
    ties[0] = 448.0
    rows.append(ties * torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0))
    rows.append(torch.randn(128, generator=g) * 1e37)
    for bad in (float("nan"), float("inf"), float("-inf")):
        v = torch.randn(128, generator=g)
        v[5] = bad
        rows.append(v)
    return torch.stack(rows).to(device)


def hard_case(
    *,
    heads: int = 32,
    hadamard: bool = False,
    interleaved: bool = False,
    engine: EngineProfile = DEFAULT_ENGINE,
    device="cpu",
) -> Case:
    """Float32 projections carrying :func:`hard_vectors` through an identity RoPE (angle 0:
    cos 1, sin 0), so the quantizer sees them unchanged (up to the Hadamard, when on)."""
    vecs = hard_vectors(device)
    n = vecs.shape[0]
    seq = -(-n // heads) + 1
    q = torch.randn(seq * heads, 128, device=device)
    q[:n] = vecs
    q = q.view(seq, 1, heads, 128)
    pre = make_preprocess(
        rope_fp32=True,
        hadamard=hadamard,
        interleaved=interleaved,
        params=torch.float32,
        engine=engine,
        device=device,
    )
    finite = n - 3  # the last three vectors hold a NaN or an Inf
    with torch.no_grad():  # LayerNorm output = bias: the keys carry (finite) hard lanes too
        pre.k_norm.weight.zero_()
        pre.k_norm.bias.copy_(vecs[(torch.arange(128) * 7) % finite, torch.arange(128)])
    k = torch.randn(seq, 1, 128, device=device)
    w = torch.randn(seq, 1, heads, device=device)
    return Case(pre, q, k, w, torch.zeros(seq, 1, 1, ROPE_DIM, device=device))


def operands(case: Case, impl: str, **kw) -> ScoringOperands:
    config = IndexerPrecisionConfig(
        rope_fp32=case.pre.rope_fp32, scoring_precision="fp8", engine=case.pre.engine
    )
    return prepare_indexer_operands(
        case.pre,
        case.q,
        case.k,
        case.w,
        case.freqs,
        config=config,
        cu_seqlens=case.cu_seqlens,
        impl=impl,
        **kw,
    )


def with_floor(engine: EngineProfile, floor: float) -> EngineProfile:
    """``engine`` with another amax floor for q and k."""
    return dataclasses.replace(
        engine,
        q_quant=dataclasses.replace(engine.q_quant, amax_floor=floor),
        k_quant=dataclasses.replace(engine.k_quant, amax_floor=floor),
    )


# Every registered profile; with the model fields its path needs (Hadamard, RoPE layout).
PROFILES = sorted(ENGINE_PROFILES)


def model_fields(engine: EngineProfile) -> dict[str, bool]:
    return dict(
        hadamard=bool(engine.hadamard),
        interleaved=bool(engine.rope_interleaved),
    )


def _first_mismatches(a: torch.Tensor, b: torch.Tensor, n: int = 4) -> str:
    where = (a != b).nonzero()[:n].tolist()
    return ", ".join(
        f"{tuple(i)}: {a[tuple(i)].item():#x} vs {b[tuple(i)].item():#x}" for i in where
    )


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns, every NaN mapped to one pattern (a NaN's payload is the device's)."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def assert_bit_identical(got: ScoringOperands, ref: ScoringOperands) -> None:
    """E4M3 bytes and descales bit for bit (descale NaN included); folded weights bit for bit
    with NaN compared as NaN; the same BSHD contiguous layout."""
    assert got.precision is ref.precision and got.sm_scale == ref.sm_scale
    for name in ("q", "k", "q_descale", "k_descale", "weights"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert a.is_contiguous(), name
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        elif name == "weights":
            a, b = _bits32(a), _bits32(b)
        else:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), f"{name} differs at {_first_mismatches(a, b)}"


def cancelling_case(
    *,
    hadamard: bool,
    interleaved: bool = False,
    engine: EngineProfile = DEFAULT_ENGINE,
    device="cpu",
) -> Case:
    """BF16 keys whose LayerNorm mean is inexact in float64: ``+-2**60`` beside values near 1.
    Summed in another order than the reference's the mean loses those values; the LayerNorm
    weight (``2**-60`` on the huge lanes, ``2**57`` elsewhere) brings the difference into the
    quantized bytes."""
    seq, heads = 6, 32
    g = torch.Generator().manual_seed(11)
    k = torch.randn(seq, 1, 128, generator=g)
    k[:, 0, 0], k[:, 0, 1] = 2.0**60, -(2.0**60)
    k[1::2, 0, 64], k[1::2, 0, 65] = -(2.0**60), 2.0**60
    huge = k[0, 0].abs() > 1e6
    pre = make_preprocess(
        rope_fp32=True,
        hadamard=hadamard,
        interleaved=interleaved,
        params=torch.float32,
        engine=engine,
        device=device,
    )
    with torch.no_grad():
        pre.k_norm.weight.copy_(torch.where(huge, 2.0**-60, 2.0**57))
        pre.k_norm.bias.zero_()
    q = torch.randn(seq, 1, heads, 128, generator=g)
    return Case(
        pre,
        q.to(device=device, dtype=torch.bfloat16),
        k.to(device=device, dtype=torch.bfloat16),
        torch.randn(seq, 1, heads, generator=g).to(device=device, dtype=torch.bfloat16),
        torch.zeros(seq, 1, 1, ROPE_DIM, device=device),
    )
