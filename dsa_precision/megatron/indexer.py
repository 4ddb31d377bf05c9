"""``PrecisionDSAIndexer``: megatron-core's ``DSAIndexer`` with the dsa-precision numerics.

The dsa-precision fields are decided once, when the indexer is built (the config freezes them);
the Megatron fields its preprocessing follows are read per forward, as Megatron reads them:

- default fields: every method is Megatron's, unchanged;
- ``dsa_indexer_rope_fp32``: ``forward_before_topk`` keeps key LayerNorm -> RoPE -> Hadamard in
  FP32 under the engine profile's rules, with the engine's own cos/sin tables built from the
  token positions (:class:`~dsa_precision.rope.EngineRopeTables`: independent of where Megatron
  computed its ``inv_freq``, of ``use_cpu_initialization``, of context parallelism and of packed
  sequences); with BF16 scoring it rounds q and k to BF16 where it ends (which is what BF16
  scoring of FP32 carriers means), so Megatron's own scoring needs no change;
- ``dsa_indexer_scoring_precision="fp8"``: ``forward`` / ``forward_with_scores`` score in FP8
  with the package's kernels, and :meth:`PrecisionDSAIndexer.scoring_operands` builds the FP8
  operands (fused preprocess + quantize) that :class:`PrecisionDSAttention`'s owned top-k reads.

Parameter names are Megatron's (the preprocessing borrows ``k_norm``), so checkpoints load either
way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

from ..config import IndexerPrecisionConfig
from ..devices import _shared_device_tensor, _to_device
from ..operands import ScoringOperands
from ..prepare import prepare_indexer_operands
from ..preprocess import IndexerPreprocess, _indexer_head_weights, _weights_gemm_fp32
from ..rope import EngineRopeTables, RopePositions
from ..rows import _packed_sequence_of
from ..scoring import ResolvedBackend, _resolve_scoring_backend, indexer_scores
from ..topk import indexer_topk
from . import compat
from .config import _indexer_rope_spec, _layer_decisions

__all__ = ["IndexerProjections", "PrecisionDSAIndexer"]


class IndexerProjections(NamedTuple):
    """What :meth:`PrecisionDSAIndexer.projections` returns (unpacks as a tuple too).

    Attributes:
        q: ``[s, b, h, d]`` the ``linear_wq_b`` output, reshaped (BF16 in training).
        k: ``[s, b, d]`` the ``linear_wk`` output.
        w: ``[s, b, h]`` the raw ``linear_weights_proj`` output (float32 when asked).
        freqs: Megatron's RoPE angles ``[s', 1, 1, rope_dim]`` (its ``RotaryEmbedding`` output).
        mscale: Megatron's YaRN magnitude scale (1.0 for plain RoPE).
        cu_seqlens: ``[n + 1]`` packed lengths (THD), else ``None``.
        token_freqs: ``[s, 1, 1, rope_dim]`` each packed row's angles (THD, ``rope_fp32`` off),
            else ``None``.
        positions: every row's RoPE position, for the engine's tables (``rope_fp32``), else
            ``None``.
    """

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor
    freqs: torch.Tensor
    mscale: float
    cu_seqlens: torch.Tensor | None
    token_freqs: torch.Tensor | None
    positions: RopePositions | None


@_shared_device_tensor
def _zigzag_positions(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device
) -> torch.Tensor:
    """int64 positions of this rank's rows under Megatron's zigzag context parallelism (its own
    layout helper; built once per argument tuple, shared read-only)."""
    return dsa_layout.build_zigzag_cp_local_positions(seq_len, cp_size, cp_rank, device)


class PrecisionDSAIndexer(DSAIndexer):
    """``DSAIndexer`` whose numerics follow the dsa-precision fields of its config (see the
    module docstring), decided once, when it is built."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        compat._check_built(self, "DSAIndexer")
        self._precision, _ = _layer_decisions(self.config)
        # The engine's RoPE tables (rope_fp32), decided from the RoPE fields where Megatron
        # reads them (its RotaryEmbedding is built in __init__ too); built on first use.
        self._rope_tables = (
            EngineRopeTables(_indexer_rope_spec(self.config), self._precision.engine)
            if self._precision.rope_fp32
            else None
        )
        # (Megatron fields it follows, module): a tuple, so nn.Module does not register the
        # preprocessing (it borrows k_norm; the state dict keeps Megatron's names).
        self._preprocess_cache: tuple[tuple[bool, ...], IndexerPreprocess] | None = None
        # The scoring kernel: the precision's (dsa_indexer_scoring_backend; "auto" for a plain
        # TransformerConfig), resolved once, at the first package scoring.
        self._requested_backend = self._precision.scoring_backend
        self._scoring_backend: ResolvedBackend | None = None
        if self._precision.rope_fp32 or self._precision.fp8:
            self.preprocess()  # built (and its arguments checked) now, not at the first forward

    @property
    def precision(self) -> IndexerPrecisionConfig:
        """The precision decided when the indexer was built (the config freezes its fields)."""
        return self._precision

    @property
    def scoring_backend(self) -> ResolvedBackend | None:
        """The kernel the package's scoring of this indexer runs on (``"deepgemm"``,
        ``"cudnn"`` or ``"torch"``), decided at its first call from
        ``dsa_indexer_scoring_backend``; ``None`` before it."""
        return self._scoring_backend

    def backend_for(self, ops: ScoringOperands) -> ResolvedBackend:
        """The scoring backend, resolved at the first call (an explicit one that cannot run
        raises there) and passed explicitly afterwards, so the layer never changes kernels."""
        if self._scoring_backend is None:
            self._scoring_backend = _resolve_scoring_backend(self._requested_backend, ops)
        return self._scoring_backend

    def preprocess(self) -> IndexerPreprocess:
        """The preprocessing of the configured precision (Megatron's own RoPE on its BF16 path),
        built once. Megatron reads ``dsa_indexer_rope_interleaved``, ``..._rotate_activation``,
        ``..._k_norm_fp32`` and ``apply_rope_fusion`` at every forward, and so does this: a
        change (re-validated by the config) rebuilds the module, nothing else does."""
        config = self.config
        key = (
            config.dsa_indexer_rope_interleaved,
            config.dsa_indexer_rotate_activation,
            config.dsa_indexer_k_norm_fp32,
            config.apply_rope_fusion,
        )
        cached = self._preprocess_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        rope_interleaved, rotate_activation, k_norm_fp32, rope_fusion = key
        module = IndexerPreprocess(
            self.index_head_dim,
            self.qk_pos_emb_head_dim,
            k_norm=self.k_norm,
            rope_interleaved=rope_interleaved,
            rotate_activation=rotate_activation,
            k_norm_fp32=k_norm_fp32,
            rope_fp32=self._precision.rope_fp32,
            engine=self._precision.engine,
            rope_fn=self._megatron_rope,
            exact_bf16_rope=not rope_fusion,
            rope_tables=self._rope_tables,
        )
        self._preprocess_cache = (key, module)
        return module

    def _megatron_rope(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        mscale: float,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._apply_rope(x, freqs, mscale, cu_seqlens=cu_seqlens)

    def projections(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        packed_seq_params: PackedSeqParams | None,
        weights_fp32: bool = False,
    ) -> IndexerProjections:
        """As ``forward_before_topk`` begins: RoPE angles, sequence-parallel gather, projections.

        Returns :class:`IndexerProjections`: ``token_freqs`` holds each packed row's angles (the
        rank's zigzag chunks under context parallelism; ``None`` for BSHD and with
        ``rope_fp32``), ``positions`` each row's RoPE position with ``rope_fp32`` (the rank's
        zigzag chunks under context parallelism, per sequence for packed input), for the
        engine's tables. ``weights_fp32``: the ``linear_weights_proj`` product in float32, for
        an engine whose weights GEMM outputs FP32 (:func:`_weights_gemm_fp32`, the engine's own
        call on CUDA); otherwise the BF16 projection.
        """
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rotary_seq_len = self._rotary_seq_len(x, packed_seq_params)
        freqs, mscale = self._rope_angles(rotary_seq_len, packed)
        cu_seqlens: Any = None  # Megatron's (untyped) packed lengths
        if packed:
            cu_seqlens, cu_seqlens_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
            # Self-attention: one packed layout. Compared only off the GPU (no host sync).
            if (
                cu_seqlens is not cu_seqlens_kv
                and not cu_seqlens.is_cuda
                and not torch.equal(cu_seqlens, cu_seqlens_kv)
            ):
                raise NotImplementedError(
                    "PrecisionDSAIndexer needs the same packed layout for queries and keys "
                    "(self-attention); got different cu_seqlens_q and cu_seqlens_kv."
                )
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        seqlen, bsz, _ = x.size()
        q, _ = self.linear_wq_b(qr)
        q = q.reshape(seqlen, bsz, self.index_n_heads, self.index_head_dim)
        k, _ = self.linear_wk(x)
        if weights_fp32:
            w = _weights_gemm_fp32(x, self.linear_weights_proj.weight)
        else:
            w, _ = self.linear_weights_proj(x)
        token_freqs = positions = None
        rope_fp32 = self._precision.rope_fp32
        if packed:
            index = self._packed_positions(cu_seqlens, seqlen, freqs.size(0), freqs.device)
            if rope_fp32:
                positions = RopePositions(seqlen, freqs.size(0), index)
            else:  # one angle row per packed token already when there is no index
                token_freqs = freqs if index is None else freqs.index_select(0, index)
        elif rope_fp32:
            cp = self.pg_collection.cp
            if cp.size() == 1:
                positions = RopePositions(seqlen, rotary_seq_len)
            else:  # the rank's zigzag chunks, as Megatron slices its angles
                index = _zigzag_positions(rotary_seq_len, cp.size(), cp.rank(), x.device)
                positions = RopePositions(seqlen, rotary_seq_len, index)
        return IndexerProjections(q, k, w, freqs, mscale, cu_seqlens, token_freqs, positions)

    def rope_angles(
        self, x: torch.Tensor, packed_seq_params: PackedSeqParams | None
    ) -> tuple[torch.Tensor, float]:
        """``(freqs, mscale)``: Megatron's RoPE angles for ``x`` (its ``RotaryEmbedding``
        caches them: the same tensor for the same length) and the YaRN magnitude scale."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        return self._rope_angles(self._rotary_seq_len(x, packed_seq_params), packed)

    def _rotary_seq_len(self, x: torch.Tensor, packed_seq_params: PackedSeqParams | None) -> int:
        """Megatron's RoPE length for ``x``: the global sequence (times the tensor- and context-
        parallel splits), or the longest packed sequence."""
        length: int = self.rotary_pos_emb.get_rotary_seq_len(
            None, None, x, self.config, packed_seq_params
        )
        return length

    def _rope_angles(self, rotary_seq_len: int, packed: bool) -> tuple[torch.Tensor, float]:
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(rotary_seq_len, packed_seq=packed), 1.0
        return self.rotary_pos_emb(rotary_seq_len, packed_seq=packed)

    def _packed_positions(
        self, cu_seqlens: torch.Tensor, rows: int, length: int, device: torch.device
    ) -> torch.Tensor | None:
        """int64 ``[rows]`` position of every packed row inside its sequence (the rank's zigzag
        chunks of each sequence under context parallelism, from Megatron's layout helper),
        clamped below ``length``; ``None`` when the angles hold one row per packed token
        already (``length == rows``, no context parallelism)."""
        cp = self.pg_collection.cp
        cu = _to_device(cu_seqlens, device, torch.int64)
        if length == rows and cp.size() == 1:
            return None
        packed_pos = dsa_layout.build_packed_allgather_cp_local_positions(
            cu, cp.size(), cp.rank(), device, output_size=rows
        )
        return (packed_pos - cu[_packed_sequence_of(cu, packed_pos)]).clamp_(0, length - 1)

    def head_weights(self, w: torch.Tensor, precision: IndexerPrecisionConfig) -> torch.Tensor:
        """``[s, b, h]`` head weights from the ``linear_weights_proj`` output: Megatron's BF16 order
        for BF16 scoring, float32 ``(w * D**-0.5) * H**-0.5`` for FP8 (whose operands fold the q
        descale in the engine's order instead)."""
        return _indexer_head_weights(
            w, n_heads=self.index_n_heads, head_dim=self.index_head_dim, fp32=precision.fp8
        )

    def forward_before_topk(
        self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params: PackedSeqParams | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [s, b, h, d]``, ``k [s, b, d]``, ``weights [s, b, h]`` before scoring.

        Megatron's own unless ``dsa_indexer_rope_fp32``; then q and k are preprocessed in FP32
        and rounded to BF16 for BF16 scoring (float32 carriers for FP8 scoring, with float32
        weights in the engine's order).
        """
        precision = self._precision
        if not precision.rope_fp32:
            return super().forward_before_topk(x, qr, packed_seq_params)
        p = self.projections(x, qr, packed_seq_params)
        q, k = self.preprocess()(
            p.q, p.k, p.freqs, mscale=p.mscale, cu_seqlens=p.cu_seqlens,
            token_freqs=p.token_freqs, positions=p.positions,
        )  # fmt: skip
        if not precision.fp8:
            q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        return q, k, self.head_weights(p.w, precision)

    @torch.no_grad()
    def scoring_operands(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        precision: IndexerPrecisionConfig | None = None,
    ) -> ScoringOperands:
        """The scoring operands of every indexer row (``(b, s, ...)``; packed: batch 1) in the
        indexer's precision, built by the fused preprocess + quantize kernel when it reproduces
        the reference (FP8 on CUDA). ``precision``, if given, must be :attr:`precision` (the
        indexer's preprocessing is built for it)."""
        if precision is not None and precision != self._precision:
            raise ValueError(
                f"precision={precision!r} is not this indexer's ({self._precision!r}); the "
                "precision is decided when the indexer is built: build one from a config with it."
            )
        precision = self._precision
        weights_fp32 = precision.fp8 and precision.engine.weights_dtype == "fp32"
        p = self.projections(x, qr, packed_seq_params, weights_fp32)
        return prepare_indexer_operands(
            self.preprocess(),
            p.q,
            p.k,
            p.w,
            p.freqs,
            config=precision,
            mscale=p.mscale,
            cu_seqlens=p.cu_seqlens,
            token_freqs=p.token_freqs,
            positions=p.positions,
        )

    def forward_with_scores(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index_scores [b, sq, sk], topk_indices [b, sq, k])`` in the configured precision.

        BF16 scoring: Megatron's own (on the BF16 operands :meth:`forward_before_topk` returns).
        FP8: scored by the package's kernels on FP8 operands; ``mask`` (additive ``[sq, sk]`` or
        ``[b, sq, sk]``) is applied as Megatron applies it, and the top-k is the package's
        deterministic one (keys ascending, ``-1`` for masked picks).
        """
        if not self._precision.fp8:
            return super().forward_with_scores(x, qr, mask, packed_seq_params)
        ops = self.scoring_operands(x, qr, packed_seq_params)
        sk = ops.k.shape[1]
        # every key visible: Megatron masks; the layer's kernel (its out-less call decides it)
        scores = indexer_scores(ops, q_causal_offsets=sk, backend=self.backend_for(ops))
        if mask is not None:
            scores = scores + mask
        topk = indexer_topk(scores, min(self.index_topk, sk))
        return scores, topk
