"""Indexer preprocessing: key LayerNorm -> RoPE -> (Hadamard), query RoPE -> (Hadamard).

Layouts follow Megatron: ``q`` is ``[s, b, h, d]``, ``k`` is ``[s, b, d]``, ``freqs`` is the
``RotaryEmbedding`` output ``[s, 1, 1, rope_dim]`` (float32 angles). The RoPE slice is the first
``rope_dim`` lanes of each vector (DeepSeek's layout); the remaining lanes pass through.

Dtype at every step (``p`` = projection dtype, BF16 in training)::

                         rope_fp32=False (Megatron)          rope_fp32=True
    q from linear_wq_b   p                                   p -> float32 (exact upcast)
    q RoPE               p  (cos/sin rounded to p; products   float32 (cos/sin float32)
                            and sum rounded to p)
    k from linear_wk     p                                   p -> float32 (exact upcast)
    k LayerNorm          k_norm(k) in p, or                  float32: statistics and affine in
                         k_norm(k.float()).to(p) when        float64 from the exact values of k
                         k_norm_fp32                         and the LayerNorm weight and bias,
                                                             rounded to float32 once; or float32
                                                             operation by operation (an engine's
                                                             layernorm="fp32-ops")
    k RoPE               p                                   float32 (an engine's fma: the
                                                             x * cos product fused)
    Hadamard (optional)  fast_hadamard_transform in p, or    float32 butterfly
                         float32 butterfly rounded to p
    q, k out             p                                   float32

With ``rope_fp32=False`` the outputs are bit-identical to megatron-core 0.19.2
``DSAIndexer.forward_before_topk`` (unfused RoPE). With ``rope_fp32=True`` nothing after the
projections is rounded to BF16; the scoring step decides the operand precision.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from ._checks import check_bool, check_freqs_cover, check_positive_int, check_real, check_tensor
from ._device import device_constant, to_device
from .engines import DEFAULT_ENGINE, EngineProfile, engine_profile
from .hadamard import rotate_activation

__all__ = [
    "IndexerPreprocess",
    "apply_rope",
    "fma_fp32",
    "indexer_head_weights",
    "layer_norm_fp32",
    "layer_norm_fp32_ops",
    "pairwise_sum",
    "rope_tables",
    "thd_token_freqs",
    "triton_block_sum",
]

# (x [s, b, *, d], freqs, mscale, cu_seqlens) -> x rotated: a model's own RoPE (e.g. Megatron's
# DSAIndexer._apply_rope, which knows about context parallelism and fused TE RoPE).
RopeFn = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the two halves of the last dimension."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(
    freqs: torch.Tensor, mscale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``freqs``, scaled by ``mscale`` in float32, cast to ``dtype``.

    The one definition of the RoPE tables: :func:`apply_rope` uses it, and so do the fused kernels
    (which must not evaluate trigonometry themselves to stay bit-identical). Megatron rounds
    cos/sin to the compute dtype before the products; so do we (a no-op in FP32).
    """
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


class _Fma32(torch.autograd.Function):
    """Exact float32 fused multiply-add; the gradient of ``a * b + c``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.shapes = (a.shape, b.shape, c.shape)
        a64, b64, c64 = a.double(), b.double(), c.double()
        p = a64 * b64  # exact
        s = p + c64
        bp = s - p
        err = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + err is exact
        bits = s.view(torch.int64)
        # Round to odd: inexact with an even last bit -> one ulp toward the exact value.
        step = torch.where((err > 0) == (s > 0), 1, -1)
        odd = torch.where((err != 0) & (bits & 1 == 0), bits + step, bits)
        return odd.view(torch.float64).to(torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        sa, sb, sc = ctx.shapes
        return (grad * b).sum_to_size(sa), (grad * a).sum_to_size(sb), grad.sum_to_size(sc)


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors with one rounding (a fused multiply-add, ``fma.rn.f32``).

    Computed in float64, where ``a * b`` is exact, with the sum rounded to odd (the float64 sum,
    its error recovered by TwoSum, the last bit forced odd when inexact); rounding that to float32
    is then the correctly rounded result. The same bits on every device; broadcasts;
    differentiable (the gradient of ``a * b + c``).
    """
    a, b, c = torch.broadcast_tensors(a, b, c)
    return _Fma32.apply(a, b, c)


def _rotate(x_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fma: bool) -> torch.Tensor:
    """``x_pe * cos + rotate_half(x_pe) * sin`` in ``x_pe``'s dtype; ``fma``: float32 with the
    first product fused, ``fma(x, cos, fl(rotate_half(x) * sin))`` (vLLM's kernels on Hopper)."""
    if fma and x_pe.dtype == torch.float32:
        return fma_fp32(x_pe, cos, _rotate_half(x_pe) * sin)
    return x_pe * cos + _rotate_half(x_pe) * sin


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    *,
    mscale: float = 1.0,
    rope_interleaved: bool = False,
    table_dtype: torch.dtype | None = None,
    fma: bool = False,
) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` lanes of ``x`` in ``x.dtype``.

    Args:
        x: ``[s, b, *, d]``; its dtype is the compute dtype (every product and sum rounds to it).
        freqs: ``[s, 1, 1, rope_dim]`` float32 angles (broadcast over batch and heads).
        mscale: YaRN magnitude scale folded into cos/sin (in float32, then cast to ``x.dtype``).
        table_dtype: dtype the cos/sin tables are rounded to before the products (an engine's
            cos/sin cache dtype); default ``x.dtype``.
        rope_interleaved: Megatron's ``dsa_indexer_rope_interleaved`` (MLA style): the RoPE lanes
            arrive as (even, odd) pairs and are de-interleaved into halves before rotation, so the
            output RoPE slice is in rotate-half order. (Megatron forbids ``rotary_interleaved``
            with MLA, so the rotation itself is always rotate-half.)
        fma: float32 only: ``fma(x, cos, fl(rotate_half(x) * sin))``, the multiply-add an
            engine's compiler contracts (:attr:`EngineProfile.fma`).

    Returns:
        ``x``'s shape and dtype.
    """
    rope_dim = freqs.shape[-1]
    x_pe, x_pass = x[..., :rope_dim], x[..., rope_dim:]
    if rope_interleaved:
        x_pe = torch.cat((x_pe[..., 0::2], x_pe[..., 1::2]), dim=-1)
    cos, sin = rope_tables(freqs, mscale, table_dtype or x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((_rotate(x_pe, cos, sin, fma), x_pass), dim=-1)


def thd_token_freqs(
    freqs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    total: int | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Per-token RoPE angles ``[total, 1, 1, rope_dim]`` for packed (THD) sequences.

    As Megatron's unfused THD RoPE without context parallelism: positions restart at 0 in each
    sequence, unless ``freqs`` already holds one row per packed token (``freqs.shape[0] ==
    total``), in which case it is used as is.

    Arguments:
        freqs: ``[max_s, 1, 1, rope_dim]`` angles of positions ``0..max_s-1`` (or one row per
            packed token).
        cu_seqlens: ``[n + 1]`` integer cumulative sequence lengths.
        total: the packed token count (the rows of ``q``). ``None``: ``cu_seqlens[-1]``, read on
            the host (a synchronisation when ``cu_seqlens`` is on a device), and then checked.
        validate: check ``cu_seqlens`` on a device too (one synchronisation). On the CPU, or
            with ``total=None``, the lengths the angles are gathered by are always checked: at
            least ``total`` tokens, no sequence longer than ``freqs``. Unchecked, a sequence
            longer than ``freqs`` fails the device's index bounds check.
    """
    validate = check_bool("validate", validate)
    if total is None:
        total = int(cu_seqlens[-1])
        validate = True  # read on the host already: check the lengths too
    total = check_positive_int("total", total) if total else 0
    if freqs.shape[0] == total:
        return freqs  # one row per packed token: cu_seqlens is not needed
    if total == 0:
        return freqs[:0]
    if validate or cu_seqlens.device.type == "cpu":
        _check_packed_lengths(cu_seqlens, total, freqs.shape[0])
    cu = to_device(cu_seqlens, freqs.device, torch.int64)
    rows = torch.arange(total, device=freqs.device)
    # Each row's sequence (rows past cu_seqlens[-1] would map to the last one; checked above).
    sequence = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=cu.numel() - 2)
    return freqs.index_select(0, rows - cu[sequence])


def _check_packed_lengths(cu_seqlens: torch.Tensor, total: int, positions: int) -> None:
    """``ValueError`` unless ``cu_seqlens`` (read on the host) packs at least ``total`` tokens in
    sequences of at most ``positions`` tokens each."""
    cu = cu_seqlens.to(dtype=torch.int64).tolist()
    if len(cu) < 2 or cu[-1] < total:
        raise ValueError(
            f"cu_seqlens {cu} packs {cu[-1] if cu else 0} tokens but the input has {total} "
            "packed rows; pass the cumulative lengths of these rows."
        )
    longest = max(b - a for a, b in itertools.pairwise(cu))
    if longest > positions:
        raise ValueError(
            f"freqs covers {positions} positions but a packed sequence has {longest} tokens; "
            "build freqs for the longest sequence."
        )


def _layer_norm_params(norm: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """``(weight, bias, eps)`` of a LayerNorm module, the weight with ``zero_centered_gamma`` applied.

    Supports ``torch.nn.LayerNorm`` (Megatron's local ``WrappedTorchNorm``) and Transformer
    Engine / Apex LayerNorms (``weight``, ``bias``, ``eps``, optional ``zero_centered_gamma``).
    """
    eps = _check_layer_norm(norm)
    weight = getattr(norm, "weight", None)
    if weight is not None and getattr(norm, "zero_centered_gamma", False):
        weight = weight + 1
    return weight, getattr(norm, "bias", None), eps


def _check_layer_norm(norm: nn.Module) -> float:
    """``TypeError`` unless ``norm`` is a LayerNorm with an ``eps`` (its float); reads no weight
    (:func:`_layer_norm_params`' checks, without building the zero-centred weight)."""
    if "RMSNorm" in type(norm).__name__:
        raise TypeError(
            f"k_norm is {type(norm).__name__}; the DSA indexer key norm is a LayerNorm "
            "(Megatron builds it with normalization='LayerNorm')."
        )
    eps = getattr(norm, "eps", None)
    if eps is None:
        raise TypeError(
            f"k_norm ({type(norm).__name__}) has no 'eps' attribute; rope_fp32 recomputes the "
            "key LayerNorm in FP32 from the module's weight, bias and eps."
        )
    return float(eps)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in a fixed order, keeping it (size 1).

    For a power-of-two width the order is a tree of adjacent pairs: ``x[2i] + x[2i+1]``, then
    the same on the results, and so on. Unlike ``torch.sum``, whose order depends on the device,
    the memory layout and the kernel, this order is part of the definition, so a fused kernel can
    reproduce every rounding. Other widths fall back to ``torch.sum`` (order unspecified).
    """
    n = x.shape[-1]
    if n == 0 or n & (n - 1):
        return x.sum(dim=-1, keepdim=True)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def layer_norm_fp32(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of ``x`` ``[..., d]`` over the last dimension, float32 out.

    Statistics and the affine map are evaluated in float64 from the exact values of ``x``,
    ``weight`` and ``bias`` and rounded to float32 once. The sums of the mean and the variance
    run in the fixed order of :func:`pairwise_sum` (the sum of squares is not exact in float64,
    so a device-chosen reduction order would leak into the last float32 bit once in ~2**29
    values): the result is the same on every device, and a fused kernel reproduces it bit for bit.
    Differentiable.
    """
    d = x.shape[-1]
    x64 = x.to(torch.float64)
    mean = pairwise_sum(x64) / d
    centered = x64 - mean
    var = pairwise_sum(centered * centered) / d
    y = centered / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


# Triton's tl.sum over one 128-vector laid out one element per thread on 4 warps (vLLM's
# fused_norm_rope and LMDeploy's k-cache kernel, num_warps=4): a butterfly over the lanes
# (shfl.bfly 16, 8, 4, 2, 1: element distances 16 ... 1), then over the 4 warp partials read back
# from shared memory (xor 2, 1: distances 64, 32). Each step adds elements this far apart.
TRITON_SUM_DISTANCES_128 = (16, 8, 4, 2, 1, 64, 32)


def _pair_step(x: torch.Tensor, distance: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of one tree step over the last dimension: the elements whose index has
    the bit ``distance`` clear, and their partners ``distance`` further on."""
    n = x.shape[-1]
    y = x.reshape(*x.shape[:-1], n // (2 * distance), 2, distance)
    flat = (*x.shape[:-1], n // 2)
    return y[..., 0, :].reshape(flat), y[..., 1, :].reshape(flat)


def _tree_distances(distances: tuple[int, ...]) -> list[int]:
    """The distances of the same tree after each step removed its index bit (what a reshape of
    the shrinking tensor needs)."""
    out, removed = [], []
    for d in distances:
        bit = d.bit_length() - 1
        out.append(1 << (bit - sum(r < bit for r in removed)))
        removed.append(bit)
    return out


def triton_block_sum(
    x: torch.Tensor, *, squares_of: torch.Tensor | None = None, fma: bool = False
) -> torch.Tensor:
    """float32 sum over the last dimension (128) in the order of :data:`TRITON_SUM_DISTANCES_128`.

    ``squares_of=d``: the sum of ``d * d`` (``x`` unused); with ``fma`` its first step is what a
    contracting compiler emits, ``fma(d_i, d_i, fl(d_j * d_j))`` for the lower lane ``i`` of each
    pair ``(i, j = i + 16)``, the value the warp's lane 0 holds. Returns ``[..., 1]``.
    """
    src = x if squares_of is None else squares_of
    if src.shape[-1] != 128:
        raise ValueError(f"triton_block_sum takes 128-wide vectors, got {tuple(src.shape)}.")
    distances = _tree_distances(TRITON_SUM_DISTANCES_128)
    if squares_of is not None:
        lo, hi = _pair_step(squares_of, distances[0])
        x = fma_fp32(lo, lo, hi * hi) if fma else lo * lo + hi * hi
        distances = distances[1:]
    for d in distances:
        lo, hi = _pair_step(x, d)
        x = lo + hi
    return x


def _rsqrt_fp32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / sqrt(x)`` as the engines' Triton kernels get it: on CUDA ``torch.rsqrt``
    (the hardware's ``rsqrt.approx``, as Triton's ``tl.rsqrt``); elsewhere the IEEE square
    root and the IEEE division (what Triton's interpreter computes)."""
    if x.is_cuda:
        return torch.rsqrt(x)
    return 1.0 / torch.sqrt(x)


def layer_norm_fp32_ops(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    fma: bool,
) -> torch.Tensor:
    """The key LayerNorm float32 operation by operation, as vLLM 0.33's ``fused_norm_rope`` and
    LMDeploy 0.18's k-cache kernel evaluate it (``x``: ``[..., 128]``; float32 out)::

        mean = fl(tree_sum(x) / 128);  d = fl(x - mean)
        var = fl(tree_sum(d * d) / 128);  rstd = rsqrt(fl(var + fl32(eps)))
        y = fl(fl(fl(d * rstd) * w) + b)      (fma: fma(fl(d * rstd), w, b))

    ``tree_sum`` is :func:`triton_block_sum` (the first step of the variance contracted under
    ``fma``); ``rsqrt`` as :func:`_rsqrt_fp32`. Differentiable.
    """
    x = x.to(torch.float32)
    mean = triton_block_sum(x) / 128.0
    d = x - mean
    var = triton_block_sum(d, squares_of=d, fma=fma) / 128.0
    eps32 = device_constant(float(eps), torch.float32, x.device)
    y = d * _rsqrt_fp32(var + eps32)
    w = None if weight is None else weight.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32)
    if w is not None and b is not None and fma:
        return fma_fp32(y, w, b)
    if w is not None:
        y = y * w
    return y if b is None else y + b


def indexer_head_weights(
    w_proj: torch.Tensor, *, n_heads: int, head_dim: int, fp32: bool
) -> torch.Tensor:
    """Per-head indexer weights ``w * H**-0.5 * D**-0.5`` from the ``linear_weights_proj`` output.

    ``fp32=False``: Megatron's order and dtype, ``(w * H**-0.5) * D**-0.5`` in ``w``'s dtype (two
    BF16 roundings in training). ``fp32=True``: the inference engines' order in float32,
    ``(fp32(w) * D**-0.5) * H**-0.5``; with the power-of-two q descale folded in later this is
    exactly vLLM's ``w * q_scale * softmax_scale * n_heads**-0.5``. The two differ whenever
    ``H**-0.5`` is not a power of two (H = 32: ``2**-2.5``).
    """
    if fp32:
        return (w_proj.to(torch.float32) * head_dim**-0.5) * n_heads**-0.5
    return w_proj * (n_heads**-0.5) * head_dim**-0.5


class IndexerPreprocess(nn.Module):
    """Key LayerNorm -> RoPE -> (Hadamard) and query RoPE -> (Hadamard) of the DSA indexer.

    Args:
        head_dim: indexer head width ``d`` (128 for DeepSeek-V3.2 / GLM-5).
        rope_dim: width of the RoPE slice (Megatron's ``qk_pos_emb_head_dim``, 64).
        k_norm: the key LayerNorm module of the model. It is borrowed, not registered: its
            parameters stay with (and are saved by) their owner, so wrapping a model's indexer
            changes no state-dict key. ``None`` creates and owns ``nn.LayerNorm(head_dim,
            eps=k_norm_eps)``.
        k_norm_eps: epsilon of the fresh LayerNorm.
        rope_interleaved: Megatron's ``dsa_indexer_rope_interleaved``.
        rotate_activation: Megatron's ``dsa_indexer_rotate_activation`` (Hadamard on q and k).
        k_norm_fp32: Megatron's ``dsa_indexer_k_norm_fp32`` (LayerNorm on an FP32 upcast, result
            rounded back); implied by ``rope_fp32``.
        rope_fp32: the inference engine's preprocessing after the projections, FP32 unless the
            engine rounds (see the module docstring).
        engine: the engine profile whose preprocessing rules ``rope_fp32`` follows (cos/sin
            cache dtype, LayerNorm arithmetic and output, RoPE arithmetic and contraction, q and
            k rounding). With ``rope_fp32``, a ``k_norm`` whose epsilon is not the engine's
            (:attr:`EngineProfile.k_norm_eps`) raises ``ValueError`` naming both.
        rope_fn: the model's own RoPE for the ``rope_fp32=False`` path (called as
            ``rope_fn(x, freqs, mscale, cu_seqlens)`` on ``[s, b, *, d]``), so that path stays the
            model's bit for bit whatever RoPE kernel the model uses; default :func:`apply_rope`.
        exact_bf16_rope: whether ``rope_fn`` computes what :func:`apply_rope` computes in BF16
            (Megatron's unfused RoPE); ``False`` for a fused RoPE kernel, whose bits the fused
            preprocess + quantize kernel does not reproduce.
    """

    def __init__(
        self,
        head_dim: int,
        rope_dim: int,
        *,
        k_norm: nn.Module | None = None,
        k_norm_eps: float = 1e-6,
        rope_interleaved: bool = False,
        rotate_activation: bool = False,
        k_norm_fp32: bool = False,
        rope_fp32: bool = False,
        engine: EngineProfile = DEFAULT_ENGINE,
        rope_fn: RopeFn | None = None,
        exact_bf16_rope: bool = True,
    ) -> None:
        super().__init__()
        head_dim, rope_dim = (
            check_positive_int("head_dim", head_dim),
            check_positive_int("rope_dim", rope_dim),
        )
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(
                f"rope_dim={rope_dim} must be even and in (0, head_dim={head_dim}]; it is "
                "Megatron's qk_pos_emb_head_dim."
            )
        check_bool("rope_fp32", rope_fp32)
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        if k_norm is None:
            # Registered directly: the read-only ``k_norm`` property below serves both cases.
            self._modules["k_norm"] = nn.LayerNorm(head_dim, eps=k_norm_eps)
        else:
            # A one-element tuple keeps nn.Module from registering the borrowed norm.
            self._borrowed_k_norm = (k_norm,)
        self.rope_fn = rope_fn
        self.rope_interleaved = rope_interleaved
        self.rotate_activation = rotate_activation
        self.k_norm_fp32 = k_norm_fp32
        self.rope_fp32 = rope_fp32
        self.engine = engine_profile(engine)
        self.exact_bf16_rope = exact_bf16_rope
        if rope_fp32:
            eps = getattr(self.k_norm, "eps", None)
            problem = None if eps is None else self.engine.k_norm_eps_mismatch(eps)
            if problem:
                raise ValueError(f"IndexerPreprocess(rope_fp32=True): {problem}.")

    @property
    def k_norm(self) -> nn.Module:
        """The key LayerNorm (owned, or borrowed from the model)."""
        borrowed = self.__dict__.get("_borrowed_k_norm")
        return borrowed[0] if borrowed else self._modules["k_norm"]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rope_dim={self.rope_dim}, rope_fp32={self.rope_fp32}, "
            f"engine={self.engine.name}, rope_interleaved={self.rope_interleaved}, "
            f"rotate_activation={self.rotate_activation}"
        )

    def norm_key(self, k: torch.Tensor) -> torch.Tensor:
        """The key LayerNorm of the ``rope_fp32=False`` path, as Megatron runs it: the module in
        the projection dtype, or on a float32 upcast rounded back when ``k_norm_fp32``."""
        return self.k_norm(k.float()).to(k.dtype) if self.k_norm_fp32 else self.k_norm(k)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        freqs: torch.Tensor,
        *,
        mscale: float = 1.0,
        cu_seqlens: torch.Tensor | None = None,
        token_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Preprocess projected indexer queries and keys.

        Args:
            q: ``[s, b, h, d]`` projected queries (``linear_wq_b`` output, reshaped).
            k: ``[s, b, d]`` projected keys (``linear_wk`` output).
            freqs: ``[s, 1, 1, rope_dim]`` float32 RoPE angles; for packed input the per-sequence
                table ``[max_s, 1, 1, rope_dim]`` (or one row per packed token).
            mscale: YaRN magnitude scale (1.0 for plain RoPE).
            cu_seqlens: ``[n + 1]`` int32 cumulative lengths for packed THD input (``b == 1``);
                checked against ``q`` and ``freqs`` when on the CPU, never read on the host when
                on a device (:func:`thd_token_freqs`).
            token_freqs: ``[s, 1, 1, rope_dim]`` angles of every row, used instead of gathering
                ``freqs`` by ``cu_seqlens`` (e.g. context-parallel THD chunks); ``rope_fn`` still
                receives ``freqs`` and ``cu_seqlens``.

        Returns:
            ``(q, k)``: ``[s, b, h, d]`` and ``[s, b, d]``, in the projection dtype, or float32
            when ``rope_fp32`` (holding the values the engine rounds to).
        """
        if q.ndim != 4 or k.ndim != 3:
            raise ValueError(
                f"q must be [s, b, h, d] and k [s, b, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}."
            )
        # Host checks, the fused kernel's too: numbers are numbers, and the angles cover every
        # token (a single row is never broadcast; packed tables are checked by thd_token_freqs).
        mscale = check_real("mscale", mscale)
        check_tensor("freqs", freqs)
        if token_freqs is not None:
            check_freqs_cover("token_freqs", token_freqs, q.shape[0])
        elif cu_seqlens is None:
            check_freqs_cover("freqs", freqs, q.shape[0])
        s, b, _, d = q.shape
        if k.shape != (s, b, d) or d != self.head_dim:
            raise ValueError(
                f"k {tuple(k.shape)} does not match q {tuple(q.shape)}; expected k of shape "
                f"({s}, {b}, {self.head_dim}) with head_dim={self.head_dim}."
            )
        if freqs.shape[-1] != self.rope_dim:
            raise ValueError(
                f"freqs has rope width {freqs.shape[-1]}, expected rope_dim={self.rope_dim}."
            )
        if cu_seqlens is not None and b != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got q {tuple(q.shape)}.")
        if token_freqs is None and (self.rope_fp32 or self.rope_fn is None):  # used below
            token_freqs = freqs if cu_seqlens is None else thd_token_freqs(freqs, cu_seqlens, s)
        if self.rope_fp32:
            return self._engine_path(q, k, token_freqs[:s], mscale)

        if self.rope_fn is not None:

            def rope(x: torch.Tensor) -> torch.Tensor:
                return self.rope_fn(x, freqs, mscale, cu_seqlens)

        else:
            rope = functools.partial(
                apply_rope,
                freqs=token_freqs[:s],
                mscale=mscale,
                rope_interleaved=self.rope_interleaved,
            )
        q = rope(q)
        k = rope(self.norm_key(k).unsqueeze(2)).squeeze(2)
        if self.rotate_activation:
            q = rotate_activation(q, fp32=False)
            k = rotate_activation(k, fp32=False)
        return q, k

    def _engine_path(
        self, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, mscale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``rope_fp32`` path under the engine's rules; float32 out."""
        e = self.engine
        rope = functools.partial(
            apply_rope,
            freqs=freqs,
            mscale=mscale,
            rope_interleaved=self.rope_interleaved,
            table_dtype=e.cos_sin_dtype,
            fma=e.fma,
        )
        # Exact upcasts; the LayerNorm in the engine's arithmetic (float64 rounded once, or
        # float32 operation by operation), then its output dtype; RoPE in the engine's arithmetic
        # dtype, its multiply-add contracted where the engine's compiler contracts it.
        if e.layernorm == "fp32-ops":
            k = layer_norm_fp32_ops(k, *_layer_norm_params(self.k_norm), fma=e.fma)
        else:
            k = layer_norm_fp32(k, *_layer_norm_params(self.k_norm))
        k = k.to(e.k_norm_dtype)
        q = rope(q.to(e.rope_dtype)).to(e.q_dtype)
        k = rope(k.to(e.rope_dtype).unsqueeze(2)).squeeze(2).to(e.k_dtype)
        if self.rotate_activation:
            scale32 = e.hadamard_scale == "float32"
            q = rotate_activation(q.to(torch.float32), fp32=True, scale_fp32=scale32)
            k = rotate_activation(k.to(torch.float32), fp32=True, scale_fp32=scale32)
            q, k = q.to(e.q_dtype), k.to(e.k_dtype)
        return q.to(torch.float32), k.to(torch.float32)
