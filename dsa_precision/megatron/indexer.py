"""``PrecisionDSAIndexer``: megatron-core's ``DSAIndexer`` with the dsa-precision numerics.

The dsa-precision fields are decided once, when the indexer is built (the config freezes them);
the Megatron fields its preprocessing follows are read per forward, as Megatron reads them:

- default fields: every method is Megatron's, unchanged;
- ``dsa_indexer_rope_fp32``: ``forward_before_topk`` keeps key LayerNorm -> RoPE -> Hadamard in
  FP32 under the engine profile's rules; with BF16 scoring it rounds q and k to BF16 where it
  ends (which is what BF16 scoring of FP32 carriers means), so Megatron's own scoring needs no
  change;
- ``dsa_indexer_scoring_precision="fp8"``: ``forward`` / ``forward_with_scores`` score in FP8
  with the package's kernels, and :meth:`PrecisionDSAIndexer.scoring_operands` builds the FP8
  operands (fused preprocess + quantize) that :class:`PrecisionDSAttention`'s owned top-k reads.

Parameter names are Megatron's (the preprocessing borrows ``k_norm``), so checkpoints load either
way.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

from ..config import IndexerPrecisionConfig
from ..devices import to_device
from ..operands import ScoringOperands
from ..prepare import prepare_indexer_operands
from ..preprocess import IndexerPreprocess, indexer_head_weights
from ..rows import packed_sequence_of
from ..scoring import indexer_scores
from ..topk import indexer_topk
from . import compat
from .config import layer_decisions

__all__ = ["PrecisionDSAIndexer"]


class PrecisionDSAIndexer(DSAIndexer):
    """``DSAIndexer`` whose numerics follow the dsa-precision fields of its config (see the
    module docstring), decided once, when it is built."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        compat.check_built(self, "DSAIndexer")
        self._precision, _ = layer_decisions(self.config)
        # (Megatron fields it follows, module): a tuple, so nn.Module does not register the
        # preprocessing (it borrows k_norm; the state dict keeps Megatron's names).
        self._preprocess_cache: tuple[tuple[bool, ...], IndexerPreprocess] | None = None
        if self._precision.rope_fp32 or self._precision.fp8:
            self.preprocess()  # built (and its arguments checked) now, not at the first forward

    @property
    def precision(self) -> IndexerPrecisionConfig:
        """The precision decided when the indexer was built (the config freezes its fields)."""
        return self._precision

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
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        torch.Tensor | None,
        torch.Tensor | None,
    ]:
        """As ``forward_before_topk`` begins: RoPE angles, sequence-parallel gather, projections.

        Returns ``(q [s, b, h, d], k [s, b, d], w [s, b, h] raw, freqs, mscale, cu_seqlens,
        token_freqs)``; ``token_freqs`` ``[s, 1, 1, rope]`` holds each packed row's angles (the
        rank's zigzag chunks under context parallelism), ``None`` for BSHD. ``weights_fp32``: the
        ``linear_weights_proj`` product in float32, for an engine whose weights GEMM outputs FP32
        (the BF16 inputs are exact in float32; only the GEMM's accumulation order may differ
        from the engine's); otherwise the BF16 projection.
        """
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        freqs, mscale = self.rope_angles(x, packed_seq_params)
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
            w = torch.nn.functional.linear(x.float(), self.linear_weights_proj.weight.float())
        else:
            w, _ = self.linear_weights_proj(x)
        token_freqs = None
        if packed:
            token_freqs = self._packed_token_freqs(freqs, cu_seqlens, seqlen)
        return q, k, w, freqs, mscale, cu_seqlens, token_freqs

    def rope_angles(
        self, x: torch.Tensor, packed_seq_params: PackedSeqParams | None
    ) -> tuple[torch.Tensor, float]:
        """``(freqs, mscale)``: Megatron's RoPE angles for ``x`` (its ``RotaryEmbedding``
        caches them: the same tensor for the same length) and the YaRN magnitude scale."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
            None, None, x, self.config, packed_seq_params
        )
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(rotary_seq_len, packed_seq=packed), 1.0
        return self.rotary_pos_emb(rotary_seq_len, packed_seq=packed)

    def _packed_token_freqs(
        self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """Angles of every packed row: its position inside its sequence (the rank's zigzag chunks
        of each sequence under context parallelism, from Megatron's layout helper)."""
        cp = self.pg_collection.cp
        cu = to_device(cu_seqlens, freqs.device, torch.int64)
        if freqs.size(0) == rows and cp.size() == 1:
            return freqs  # one angle row per packed token already
        packed_pos = dsa_layout.build_packed_allgather_cp_local_positions(
            cu, cp.size(), cp.rank(), freqs.device, output_size=rows
        )
        position = (packed_pos - cu[packed_sequence_of(cu, packed_pos)]).clamp_(
            0, freqs.size(0) - 1
        )
        return freqs.index_select(0, position)

    def head_weights(self, w: torch.Tensor, precision: IndexerPrecisionConfig) -> torch.Tensor:
        """``[s, b, h]`` head weights from the ``linear_weights_proj`` output: Megatron's BF16 order
        for BF16 scoring, float32 ``(w * D**-0.5) * H**-0.5`` for FP8 (whose operands fold the q
        descale in the engine's order instead)."""
        return indexer_head_weights(
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
        q, k, w, freqs, mscale, cu_seqlens, token_freqs = self.projections(x, qr, packed_seq_params)
        q, k = self.preprocess()(
            q, k, freqs, mscale=mscale, cu_seqlens=cu_seqlens, token_freqs=token_freqs
        )
        if not precision.fp8:
            q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        return q, k, self.head_weights(w, precision)

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
        q, k, w, freqs, mscale, cu_seqlens, token_freqs = self.projections(
            x, qr, packed_seq_params, weights_fp32
        )
        return prepare_indexer_operands(
            self.preprocess(),
            q,
            k,
            w,
            freqs,
            config=precision,
            mscale=mscale,
            cu_seqlens=cu_seqlens,
            token_freqs=token_freqs,
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
        scores = indexer_scores(ops, q_causal_offsets=sk)  # every key visible: Megatron masks
        if mask is not None:
            scores = scores + mask
        topk = indexer_topk(scores, min(self.index_topk, sk))
        return scores, topk
