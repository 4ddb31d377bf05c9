"""Indexer preprocessing: key LayerNorm -> RoPE -> (Hadamard), query RoPE -> (Hadamard).

Layouts follow Megatron: ``q`` is ``[s, b, h, d]``, ``k`` is ``[s, b, d]``, ``freqs`` is the
``RotaryEmbedding`` output ``[s, 1, 1, rope_dim]`` (float32 angles); the rotation itself is
:mod:`dsa_precision.rope`, the emulated float32 arithmetic :mod:`dsa_precision.exact_math`.

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
                                                             layernorm="fp32-ops" / "fp32-warp")
    cos/sin              cos(freqs), sin(freqs) rounded     the engine's tables from the token
                         to p                                positions (rope_tables given), else
                                                             from freqs; the engine's cache dtype
    k RoPE               p                                   float32 (an engine's fma: one
                                                             product fused, by rope_fma)
    Hadamard (optional)  fast_hadamard_transform in p, or    float32 butterfly
                         float32 butterfly rounded to p
    q, k out             p                                   float32

With ``rope_fp32=False`` the outputs are bit-identical to megatron-core 0.19.2
``DSAIndexer.forward_before_topk`` (unfused RoPE). With ``rope_fp32=True`` nothing after the
projections is rounded to BF16; the scoring step decides the operand precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from .checks import _check_bool, _check_freqs_cover, _check_positive_int, _check_real, _check_tensor
from .engines import DEFAULT_ENGINE, EngineProfile, _engine_profile
from .exact_math import (
    _layer_norm_fp32_warp,
    layer_norm_fp32,
    layer_norm_fp32_ops,
    layer_norm_fp32_welford,
)
from .hadamard import rotate_activation
from .rope import (
    EngineRopeTables,
    RopePositions,
    _apply_rope_tables,
    _thd_token_freqs,
    apply_rope,
    rope_tables,
)

__all__ = ["IndexerPreprocess", "RopeFn", "layer_norm_params"]

# (x [s, b, *, d], freqs, mscale, cu_seqlens) -> x rotated: a model's own RoPE (e.g. Megatron's
# DSAIndexer._apply_rope, which knows about context parallelism and fused TE RoPE).
RopeFn = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]


def layer_norm_params(norm: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
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
    (:func:`layer_norm_params`' checks, without building the zero-centred weight)."""
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


def _indexer_head_weights(
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


def _weights_gemm_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The head-weight projection ``x @ weight.T`` with a float32 output: ``x`` ``[..., hidden]``,
    ``weight`` ``[H, hidden]`` -> ``[..., H]`` float32.

    BF16 (or FP16) operands on CUDA take the call SGLang's unfused indexer makes,
    ``torch.mm(x, weight.t(), out_dtype=torch.float32)`` (cuBLAS with float32 accumulation and
    output, no rounding to BF16; ``srt/layers/attention/dsa/dsa_indexer.py:568``), so the same
    rows of the same operands give the same bits. Elsewhere (no such GEMM on the CPU) the
    float32 product of the widened operands: each product exact, the accumulation order the
    float32 GEMM's.
    """
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return out.view(*x.shape[:-1], weight.shape[0])
    return nn.functional.linear(x.float(), weight.float())


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
        rope_tables: with ``rope_fp32``, the engine's own cos/sin tables
            (:class:`~dsa_precision.rope.EngineRopeTables`, of this ``engine``), read by token
            position: the ``freqs`` and ``mscale`` handed to :meth:`forward` then serve only the
            ``rope_fp32=False`` path and the shape checks. ``None``: the tables of ``freqs``.
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
        rope_tables: EngineRopeTables | None = None,
    ) -> None:
        super().__init__()
        head_dim, rope_dim = (
            _check_positive_int("head_dim", head_dim),
            _check_positive_int("rope_dim", rope_dim),
        )
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(
                f"rope_dim={rope_dim} must be even and in (0, head_dim={head_dim}]; it is "
                "Megatron's qk_pos_emb_head_dim."
            )
        _check_bool("rope_fp32", rope_fp32)
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
        self.engine = _engine_profile(engine)
        self.exact_bf16_rope = exact_bf16_rope
        if rope_tables is not None:
            if not isinstance(rope_tables, EngineRopeTables):
                raise TypeError(f"rope_tables={rope_tables!r} must be EngineRopeTables or None.")
            if not rope_fp32:
                raise ValueError(
                    "rope_tables are the engine's tables of the rope_fp32 path; with "
                    "rope_fp32=False the model's own RoPE runs. Pass rope_fp32=True or no tables."
                )
            if rope_tables.engine != self.engine or rope_tables.rope_dim != rope_dim:
                raise ValueError(
                    f"rope_tables ({rope_tables!r}) are not of engine={self.engine.name!r} and "
                    f"rope_dim={rope_dim}; build them for this preprocessing."
                )
        self.rope_tables = rope_tables
        if rope_fp32:
            eps = getattr(self.k_norm, "eps", None)
            problem = None if eps is None else self.engine.k_norm_eps_mismatch(eps)
            if problem:
                raise ValueError(f"IndexerPreprocess(rope_fp32=True): {problem}.")

    @property
    def k_norm(self) -> nn.Module:
        """The key LayerNorm (owned, or borrowed from the model)."""
        borrowed = self.__dict__.get("_borrowed_k_norm")
        return borrowed[0] if borrowed else cast(nn.Module, self._modules["k_norm"])

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
        positions: RopePositions | None = None,
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
                on a device.
            token_freqs: ``[s, 1, 1, rope_dim]`` angles of every row, used instead of gathering
                ``freqs`` by ``cu_seqlens`` (e.g. context-parallel THD chunks); ``rope_fn`` still
                receives ``freqs`` and ``cu_seqlens``.
            positions: with ``rope_tables``, every row's RoPE position (context-parallel chunks,
                packed sequences); default ``0 .. s - 1``, or per packed sequence by
                ``cu_seqlens`` (:meth:`RopePositions.packed` over ``freqs``' rows).

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
        mscale = _check_real("mscale", mscale)
        _check_tensor("freqs", freqs)
        if token_freqs is not None:
            _check_freqs_cover("token_freqs", token_freqs, q.shape[0])
        elif cu_seqlens is None:
            _check_freqs_cover("freqs", freqs, q.shape[0])
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
        if self.rope_fp32 and self.rope_tables is not None:
            cos, sin = self.engine_rope_rows(positions, s, q.device, freqs, cu_seqlens)
            return self._engine_path(q, k, cos[:, None, None, :], sin[:, None, None, :])
        if token_freqs is None and (self.rope_fp32 or self.rope_fn is None):  # used below
            token_freqs = freqs if cu_seqlens is None else _thd_token_freqs(freqs, cu_seqlens, s)
        if self.rope_fp32:
            assert token_freqs is not None  # set above
            e = self.engine
            cos, sin = rope_tables(token_freqs[:s], mscale, e.cos_sin_dtype)
            return self._engine_path(q, k, cos, sin)

        if self.rope_fn is not None:
            rope_fn = self.rope_fn

            def rope(x: torch.Tensor) -> torch.Tensor:
                return rope_fn(x, freqs, mscale, cu_seqlens)

        else:
            assert token_freqs is not None  # set above
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

    def engine_rope_rows(
        self,
        positions: RopePositions | None,
        rows: int,
        device: torch.device,
        freqs: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[rows, rope_dim]`` of the engine's tables (:attr:`rope_tables`) at
        ``positions`` (default: ``0 .. rows - 1``, or per packed sequence by ``cu_seqlens``
        against ``freqs``' rows), in ``dtype`` (default the engine's RoPE arithmetic dtype): the
        one source of the ``rope_fp32`` tables, for the torch reference and the fused kernel."""
        if self.rope_tables is None:
            raise ValueError(
                "engine_rope_rows needs rope_tables (the engine's tables); this preprocessing "
                "reads the angles it is handed."
            )
        if positions is None:
            if cu_seqlens is None:
                positions = RopePositions.first(rows)
            else:
                positions = RopePositions.packed(cu_seqlens, rows, freqs.shape[0], device=device)
        if positions.rows != rows:
            raise ValueError(
                f"positions has {positions.rows} rows for {rows} rows of q; pass one position "
                "per row."
            )
        return self.rope_tables.rows(positions, device, dtype or self.engine.rope_dtype)

    def _engine_path(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``rope_fp32`` path under the engine's rules with the tables ``cos`` / ``sin``
        (``[s, 1, 1, rope_dim]``, the engine's cache values); float32 out."""
        e = self.engine
        rope = functools.partial(
            _apply_rope_tables,
            cos=cos,
            sin=sin,
            rope_interleaved=self.rope_interleaved,
            fma=e.fma,
            rope_fma=e.rope_fma,
        )
        # Exact upcasts; the LayerNorm in the engine's arithmetic (float64 rounded once, or
        # float32 operation by operation), then its output dtype; RoPE in the engine's arithmetic
        # dtype, its multiply-add contracted where the engine's compiler contracts it.
        if e.layernorm == "fp32-ops":
            k = layer_norm_fp32_ops(k, *layer_norm_params(self.k_norm), fma=e.fma)
        elif e.layernorm in ("fp32-inductor-x1", "fp32-inductor-x8"):
            k = layer_norm_fp32_ops(
                k, *layer_norm_params(self.k_norm), fma=e.fma,
                inductor_xblock=1 if e.layernorm == "fp32-inductor-x1" else 8,
            )  # fmt: skip
        elif e.layernorm in ("fp32-warp", "fp32-warp-up"):
            up = e.layernorm == "fp32-warp-up"
            k = _layer_norm_fp32_warp(
                k, *layer_norm_params(self.k_norm), fma=e.fma, butterfly_up=up
            )
        elif e.layernorm == "fp32-welford":
            k = layer_norm_fp32_welford(k, *layer_norm_params(self.k_norm), fma=e.fma)
        else:
            k = layer_norm_fp32(k, *layer_norm_params(self.k_norm))
        k = k.to(e.k_norm_dtype)
        q = rope(q.to(e.rope_dtype)).to(e.q_dtype)
        k = rope(k.to(e.rope_dtype).unsqueeze(2)).squeeze(2).to(e.k_dtype)
        if self.rotate_activation:
            scale32 = e.hadamard_scale == "float32"
            q = rotate_activation(q.to(torch.float32), fp32=True, scale_fp32=scale32)
            k = rotate_activation(k.to(torch.float32), fp32=True, scale_fp32=scale32)
            q, k = q.to(e.q_dtype), k.to(e.k_dtype)
        return q.to(torch.float32), k.to(torch.float32)
