"""Drop-in subclasses of megatron-core's ``DSAIndexer`` and ``DSAttention``.

Parameter names are unchanged (the preprocessing borrows the indexer's ``k_norm``), so
checkpoints load either way.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention

from .. import audit
from ..config import IndexerPrecisionConfig
from ..preprocess import IndexerPreprocess, indexer_head_weights
from . import seams

__all__ = ["PrecisionDSAIndexer", "PrecisionDSAttention"]


class PrecisionDSAIndexer(DSAIndexer):
    """``DSAIndexer`` whose ``forward_before_topk`` runs :class:`IndexerPreprocess`.

    Default configuration: the same computation as Megatron (Megatron's own RoPE function, its
    key norm module, its weight scaling). ``dsa_indexer_rope_fp32``: FP32 LayerNorm, RoPE and
    Hadamard after the projections. ``dsa_indexer_scoring_precision="fp8"``: head weights scaled in
    FP32 in the inference engines' order (:func:`dsa_precision.preprocess.indexer_head_weights`).
    """

    def __init__(self, config, submodules, pg_collection=None) -> None:
        super().__init__(config, submodules, pg_collection)
        self.precision = IndexerPrecisionConfig.from_megatron_config(config)
        self.preprocess = IndexerPreprocess(
            self.index_head_dim,
            self.qk_pos_emb_head_dim,
            k_norm=self.k_norm,
            rope_interleaved=config.dsa_indexer_rope_interleaved,
            rotate_activation=config.dsa_indexer_rotate_activation,
            k_norm_fp32=config.dsa_indexer_k_norm_fp32,
            rope_fp32=self.precision.rope_fp32,
            rope_fn=self._megatron_rope,
        )

    def _megatron_rope(self, x, freqs, mscale, cu_seqlens):
        return self._apply_rope(x, freqs, mscale, cu_seqlens=cu_seqlens)

    def _cp_token_freqs(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int):
        """Per-token angles of this context-parallel rank's packed rows (Megatron's slicing)."""
        cp = self.pg_collection.cp
        lengths = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp.size()).tolist()
        packed = freqs.size(0) == int(cu_seqlens[-1])
        parts, start = [], 0
        for i, n in enumerate(lengths):
            rows = torch.empty(n, device=freqs.device)  # only its length is read
            offset = int(cu_seqlens[i]) if packed else 0
            parts.append(_get_thd_freqs_on_this_cp_rank(cp.rank(), cp.size(), rows, freqs, offset))
            start += n
        if start != total:
            raise RuntimeError(f"packed rows {total} do not match cu_seqlens ({start}).")
        return torch.cat(parts, dim=0)

    def forward_before_topk(
        self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params: PackedSeqParams | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [s, b, h, d]``, ``k [s, b, d]``, ``weights [s, b, h]``.

        q and k are BF16 (default) or float32 (``rope_fp32``); weights are BF16 (Megatron's) or
        float32 (``fp8`` scoring).
        """
        packed_seq = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
            None, None, x, self.config, packed_seq_params
        )
        if self.config.rope_type == "rope":
            freqs = self.rotary_pos_emb(rotary_seq_len, packed_seq=packed_seq)
            mscale = 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(rotary_seq_len, packed_seq=packed_seq)
        cu_seqlens = None
        if packed_seq:
            cu_seqlens, cu_seqlens_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
            if cu_seqlens is not cu_seqlens_kv and not torch.equal(cu_seqlens, cu_seqlens_kv):
                raise NotImplementedError(
                    "PrecisionDSAIndexer needs the same packed layout for queries and keys."
                )
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        seqlen, bsz, _ = x.size()

        q, _ = self.linear_wq_b(qr)
        q = q.reshape(seqlen, bsz, self.index_n_heads, self.index_head_dim)
        k, _ = self.linear_wk(x)
        token_freqs = None
        if self.precision.rope_fp32 and packed_seq and self.pg_collection.cp.size() > 1:
            token_freqs = self._cp_token_freqs(freqs, cu_seqlens.to(freqs.device), seqlen)
        q, k = self.preprocess(
            q, k, freqs, mscale=mscale, cu_seqlens=cu_seqlens, token_freqs=token_freqs
        )

        weights, _ = self.linear_weights_proj(x)
        weights = indexer_head_weights(
            weights,
            n_heads=self.index_n_heads,
            head_dim=self.index_head_dim,
            fp32=self.precision.fp8,
        )
        return q, k, weights


class PrecisionDSAttention(DSAttention):
    """``DSAttention`` whose forward routes every indexer scoring call with its precision.

    Needs :func:`dsa_precision.megatron.install` to have run (the named seams).
    """

    def __init__(self, config, submodules, *args: Any, **kwargs: Any) -> None:
        if not seams.installed():
            raise RuntimeError(
                "PrecisionDSAttention needs the dsa_precision seams: call "
                "dsa_precision.megatron.install() once before building the model."
            )
        super().__init__(config, submodules, *args, **kwargs)
        self.precision = IndexerPrecisionConfig.from_megatron_config(config)

    def forward(self, *args: Any, **kwargs: Any):
        """Megatron's forward inside this layer's precision scope.

        With ``DSA_PRECISION_STRICT=1`` every scoring call must run in the configured precision
        (``audit.PrecisionMismatchError`` otherwise), and a layer that computes top-k must have
        made at least one scoring call the integration saw (a path that bypassed the seams).
        """
        strict = audit.strict_enabled()
        precision = self.precision.scoring_precision.value
        guard = audit.strict_precision(precision) if strict else contextlib.nullcontext()
        before = audit.scoring_calls()
        with seams.precision_scope(self.precision), guard:
            out = super().forward(*args, **kwargs)
        if strict and not self.skip_topk and audit.scoring_calls() == before:
            raise audit.PrecisionMismatchError(
                f"DSA layer {self.layer_number} selected top-k without a scoring call the "
                f"dsa_precision seams saw; its {precision} precision is not guaranteed "
                f"(strict mode, {audit.STRICT_ENV})."
            )
        return out
