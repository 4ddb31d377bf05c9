"""``PrecisionDSAttention``: megatron-core's ``DSAttention`` with an owned FP8 top-k.

With BF16 scoring (the default, with or without ``dsa_indexer_rope_fp32``) the forward is
Megatron's, unchanged: the indexer hands Megatron BF16 operands and Megatron scores them.

With ``dsa_indexer_scoring_precision="fp8"`` a layer that computes its top-k owns that step: the
indexer builds FP8 operands (fused preprocess + quantize), :func:`~.layout.owned_topk` scores and
selects them with the global causal rows of Megatron's parallel layout, and Megatron's forward
then runs with those indices through the route its index-sharing layers take (a layer that reads
a top-k from the index-share holder): the rest -- sparse attention (FlashMLA or Megatron's own),
the latent-to-value projection, the output layout, sequence and context parallelism of the
attention -- is Megatron's. Layers that reuse another layer's top-k (index sharing) are Megatron's
unchanged; an owned layer stores its indices in Megatron's holder for them.

The seam: Megatron's forward decides on the reader route from ``skip_topk``, ``index_share`` and
``source_layer``, and reads the indices from ``_get_index_share_topk_holder``. Here those three are
properties over the values Megatron's ``__init__`` computed, and an owned layer stages its top-k
in a context variable keyed by the layer (:class:`_Staging`) for one call of Megatron's forward:
while it is staged, the properties present the layer as a reader of its own indices and the
holder methods hand them over. No attribute of the module changes during a call, so nested
forwards (of this or another layer), activation recomputation, interleaved micro-batches and
threads each see their own state; the precision, the top-k source and whether the layer owns its
top-k are decided once, at construction.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

from .. import audit
from ..capture.digest import digest_mismatches
from ..config import IndexerPrecisionConfig
from ..devices import _to_device
from ..picks import TokenLayout
from ..preprocess import IndexerPreprocess
from ..rows import _packed_sequence_of
from ..scoring import ResolvedBackend
from . import compat
from .config import DSAPrecisionTransformerConfig, _layer_decisions
from .graphs import AUTO_GRAPH_MAX_ROWS, _graph_packing, _GraphedCalls
from .indexer import PrecisionDSAIndexer
from .kernel_backend import _TILELANG, _tilelang_picks
from .layout import Gather, RankLayout, _owned_topk_with_margins, owned_topk, query_positions
from .monitor import _TopkMonitor
from .record import _current_recorder
from .replay import _current_handed_in, _HandedIn

__all__ = ["PrecisionDSAttention"]


# Layer -> the top-k it hands Megatron's forward, for the duration of that call (see _Staging).
_STAGED: contextvars.ContextVar[Mapping[DSAttention, torch.Tensor]] = contextvars.ContextVar(
    "dsa_precision_staged_topk", default=MappingProxyType({})
)


class _Staging:
    """Stage ``topk`` for ``layer`` in this context (thread, task) until the block exits; other
    layers' staged indices are kept, an outer staging of ``layer`` is shadowed and restored.
    (A class, not a generator: it runs once per layer forward.)"""

    __slots__ = ("_layer", "_token", "_topk")

    def __init__(self, layer: DSAttention, topk: torch.Tensor) -> None:
        self._layer, self._topk = layer, topk

    def __enter__(self) -> None:
        self._token = _STAGED.set(MappingProxyType({**_STAGED.get(), self._layer: self._topk}))

    def __exit__(self, *exc: object) -> None:
        _STAGED.reset(self._token)


class PrecisionDSAttention(DSAttention):
    """``DSAttention`` whose top-k follows the dsa-precision fields of its config (see the module
    docstring); its indexer must be a :class:`PrecisionDSAIndexer` (the spec swap builds both)."""

    # Megatron's routing state as its __init__ computed it (skip_topk, index_share, source_layer).
    _built: dict[str, Any]

    def __init__(
        self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        compat._check_built(self, "DSAttention")
        if self.indexer is not None and not isinstance(self.indexer, PrecisionDSAIndexer):
            raise TypeError(
                f"PrecisionDSAttention needs a PrecisionDSAIndexer, got "
                f"{type(self.indexer).__name__}; build the layer spec with "
                "dsa_precision.megatron.with_dsa_precision (or get_gpt_dsa_precision_block_spec)."
            )
        self._precision, self._topk_source = _layer_decisions(self.config)
        self._owns_topk = not self._built["skip_topk"] and (
            self._precision.fp8 or self._topk_source in ("replay", "replay_ties")
        )
        # dsa_indexer_cuda_graph: the owned top-k replayed from CUDA graphs (a computing layer):
        # True for every forward (one that cannot be captured raises), "auto" for the forwards
        # graph_applies() admits.
        mode = (
            self.config.dsa_indexer_cuda_graph
            if isinstance(self.config, DSAPrecisionTransformerConfig)
            else False
        )
        graphed = mode is not False and self._owns_topk and self._topk_source != "replay"
        self._graph_mode = mode if graphed else False
        self._graphs = _GraphedCalls() if graphed else None
        # The indexer's parameters by name, looked up on every replay (a replaced Parameter
        # object is read as the module now holds it): their addresses are part of a graph's key.
        names = []
        if graphed:
            assert self.indexer is not None  # built: the layer computes its top-k
            names = [name for name, _ in self.indexer.named_parameters()]
        self._indexer_params = tuple(operator.attrgetter(name) for name in names)
        # The layer's process groups are fixed when it is built: their sizes and ranks too.
        pgs = self.pg_collection  # a collection may lack a group it does not use (Megatron's tests)
        tp, cp = getattr(pgs, "tp", None), getattr(pgs, "cp", None)
        self._tp_size = tp.size() if tp is not None else 1
        self._tp_rank = tp.rank() if tp is not None and self._tp_size > 1 else 0
        self._cp_size = cp.size() if cp is not None else 1
        self._cp_rank = cp.rank() if cp is not None and self._cp_size > 1 else 0
        # Agreement with the engine's picks (verify / monitoring), accumulated on the device.
        self.topk_monitor = _TopkMonitor()

    # -- Megatron's routing state: decided by its __init__, presented per call (see _Staging) ---

    def _route(self, name: str, value: Any) -> None:
        built = self.__dict__.setdefault("_built", {})
        if name in built:
            raise AttributeError(
                f"DSA layer {self.layer_number}: {name} is decided when the layer is built "
                f"(it is {built[name]!r}); build the layer from a config that gives {value!r}."
            )
        built[name] = value

    @property
    def skip_topk(self) -> bool:
        """Megatron's ``skip_topk``; ``True`` while this layer's own top-k is staged."""
        return self._built["skip_topk"] or self in _STAGED.get()

    @skip_topk.setter
    def skip_topk(self, value: bool) -> None:
        self._route("skip_topk", value)

    @property
    def index_share(self) -> bool:
        """Megatron's ``index_share``; ``True`` while this layer's own top-k is staged."""
        return self._built["index_share"] or self in _STAGED.get()

    @index_share.setter
    def index_share(self, value: bool) -> None:
        self._route("index_share", value)

    @property
    def source_layer(self) -> int:
        """Megatron's ``source_layer``; this layer while its own top-k is staged."""
        return self.layer_number if self in _STAGED.get() else self._built["source_layer"]

    @source_layer.setter
    def source_layer(self, value: int) -> None:
        self._route("source_layer", value)

    @property
    def precision(self) -> IndexerPrecisionConfig:
        """The precision decided when the layer was built (the config freezes its fields)."""
        return self._precision

    @property
    def topk_source(self) -> str:
        """``dsa_indexer_topk_source``, decided when the layer was built."""
        return self._topk_source

    @property
    def scoring_backend(self) -> ResolvedBackend | None:
        """The kernel this layer's package scoring runs on (``"deepgemm"``, ``"cudnn"`` or
        ``"torch"``), decided by its indexer at the first package scoring from
        ``dsa_indexer_scoring_backend``; ``None`` before it (or without an indexer)."""
        indexer = self.indexer
        return indexer.scoring_backend if isinstance(indexer, PrecisionDSAIndexer) else None

    def owns_topk(self) -> bool:
        """Whether this layer's attention reads a top-k the package supplies (FP8 scoring, or
        the engine's picks replayed) rather than one Megatron computes."""
        return self._owns_topk

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        attention_mask: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        up_v_weight: torch.Tensor | None = None,
    ) -> Any:
        """Megatron's forward; with FP8 scoring, on this layer's owned top-k."""
        args = (query, key, value, attention_mask, x, qr, position_ids, attn_mask_type)
        kwargs = dict(
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            up_v_weight=up_v_weight,
        )
        engine, recorder = _current_handed_in(), _current_recorder()
        if self._built["skip_topk"]:  # index sharing: Megatron's rule, whatever the source's picks
            if engine is not None:
                self._refuse_shared_picks(engine)
            return super().forward(*args, **kwargs)
        source = self._topk_source
        owned = self._owns_topk
        if not (owned or source == "verify" or recorder is not None):
            return super().forward(*args, **kwargs)
        layout = self.rank_layout(query, x, packed_seq_params)
        if source in ("replay", "replay_ties") and engine is None:
            raise RuntimeError(
                f"DSA layer {self.layer_number}: dsa_indexer_topk_source={source!r} needs the "
                "engine's picks; run the forward inside dsa_precision.megatron.engine_topk()."
            )
        if source == "replay":
            assert engine is not None  # checked above
            topk = self._engine_picks(engine, layout, query, x)
        elif source == "replay_ties":
            assert engine is not None  # checked above
            topk, margins = self.compute_topk(
                query, x, qr, packed_seq_params, margins=True, layout=layout
            )
            topk = self._with_tied_rows(engine, topk, margins, layout, x)
        else:
            with_margins = source == "verify"
            selected: Any = self.compute_topk(  # the top-k, or (top-k, margins)
                query, x, qr, packed_seq_params, margins=with_margins, layout=layout
            )
            topk, margins = selected if with_margins else (selected, None)
            # owned: FP8 here. Counted once per layer and handed-in micro-batch: a recomputed
            # forward (activation checkpointing) compares the same rows again, and is not counted.
            if engine is not None and (with_margins or owned) and engine.first_count(self):
                if engine.picks.indices and engine.picks.sent is None:
                    picks = self._engine_picks(engine, layout, query, x, compared=True)
                    self.topk_monitor.update(topk, picks, margins)
                if engine.picks.digests is not None:
                    self._compare_digests(engine, topk, layout, x)
        if recorder is not None:
            tokens, local = self._engines_layout(topk, layout, x)
            own, _ = self._token_layout(layout, x)
            every_row = self._every_row_in_order(layout, x)
            recorder.record(self.layer_number, local, None if every_row else tokens, own)
        if not owned:  # BF16 verify / record: Megatron selects and attends as configured
            return super().forward(*args, **kwargs)
        if self.config.dsa_kernel_backend == _TILELANG:  # its SparseMLA takes 64-wide blocks
            topk = _tilelang_picks(topk, self.index_topk, query, self.layer_number)
        if self._built["index_share"]:  # later layers of the group reuse these (Megatron's rule)
            holder = super()._get_index_share_topk_holder(packed_seq_params, attention_mask)
            holder[self.layer_number] = topk
        with _Staging(self, topk):
            return super().forward(*args, **kwargs)

    def _refuse_shared_picks(self, engine: _HandedIn) -> None:
        """Picks or digests handed in for this layer, which reuses another layer's top-k (index
        sharing): Megatron would ignore them, so they are refused (a host fact, no data read)."""
        n = self.layer_number
        held = [what for what, layers in (("picks", engine.picks.indices),
                                          ("digests", engine.picks.digests or {})) if n in layers]  # fmt: skip
        if held:
            raise ValueError(
                f"engine_topk holds {' and '.join(held)} for DSA layer {n}, which reuses layer "
                f"{self._built['source_layer']}'s top-k (dsa_indexer_topk_freq="
                f"{self.config.dsa_indexer_topk_freq}): Megatron ignores them. Hand in the "
                "top-k-computing layers only (pack_requests(shared={...}) checks an engine's "
                "copies against their source and drops them)."
            )

    def _indexer_rows(self, x: torch.Tensor) -> int:
        """Rows of the indexer on this rank (sequence parallelism gathers them over TP)."""
        sequence_parallel = self._tp_size > 1 and self.config.sequence_parallel
        return x.size(0) * self._tp_size if sequence_parallel else x.size(0)

    def _engine_picks(
        self,
        engine: _HandedIn,
        layout: RankLayout,
        query: torch.Tensor,
        x: torch.Tensor,
        *,
        compared: bool = False,
    ) -> torch.Tensor:
        """The engine's picks of this rank's query rows, in the layout Megatron consumes, checked
        against this layer's own layout: its global sequence length (BSHD) or the ``cu_seqlens``
        of its ``PackedSeqParams`` (THD)."""
        rows = self._indexer_rows(x)
        own, batch = self._token_layout(layout, x)
        if layout.cu_seqlens is None and self._every_row_in_order(layout, x):
            positions = None  # every row of each sequence, in order: the picks as handed in
        else:
            positions = query_positions(layout, rows, query.device)
        return engine.rows(
            self.layer_number,
            positions,
            batch,
            self.index_topk,
            own,
            device=query.device,
            compared=compared,
        )

    def _every_row_in_order(self, layout: RankLayout, x: torch.Tensor) -> bool:
        """Whether this rank's query rows are every row of the micro-batch, in order (one CP
        rank, no sequence-parallel slice): a host fact."""
        rows = self._indexer_rows(x)
        return layout.cp_size == 1 and layout.query_start == 0 and layout.query_stop(rows) == rows

    def _token_layout(self, layout: RankLayout, x: torch.Tensor) -> tuple[TokenLayout, int]:
        """This layer's own token layout (its global sequence length, or the ``cu_seqlens`` of
        its ``PackedSeqParams``) and batch, which the engine's rows must match."""
        if layout.cu_seqlens is None:
            return TokenLayout(seq_len=self._indexer_rows(x) * layout.cp_size), x.size(1)
        return TokenLayout(cu_seqlens=layout.cu_seqlens), 1

    def _compare_digests(
        self, engine: _HandedIn, topk: torch.Tensor, layout: RankLayout, x: torch.Tensor
    ) -> None:
        """Count, on the device, this rank's rows whose digest of the layer's own picks (in the
        engines' sequence-relative layout) differs from the engine's digest of the row."""
        tokens, local = self._engines_layout(topk, layout, x)
        own, batch = self._token_layout(layout, x)
        n = self.layer_number
        theirs, compared = engine.digest_rows(n, tokens, batch, own)
        differs = digest_mismatches({n: local}, {n: theirs}, compared)[n]
        self.topk_monitor.update_digests(differs, compared)

    def _with_tied_rows(
        self,
        engine: _HandedIn,
        topk: torch.Tensor,
        margins: torch.Tensor,
        layout: RankLayout,
        x: torch.Tensor,
    ) -> torch.Tensor:
        """``replay_ties``: this rank's own picks ``topk`` with the rows the engine sent
        replaced by the engine's, in the layer's key coordinates; on the device, without a
        synchronisation. Counted once per layer and handed-in micro-batch (not again in a
        recomputed forward): the rows replaced, the rows the layer finds tied (margin 0) that the
        engine did not send, and the rows whose digest still differs from the engine's."""
        n = self.layer_number
        tokens, local = self._engines_layout(topk, layout, x)
        own, batch = self._token_layout(layout, x)
        theirs, taken = engine.sent_rows(n, tokens, batch, self.index_topk, own)
        merged = torch.where(taken[:, None], theirs, local.to(torch.int32))
        if engine.first_count(self):
            digests, compared = engine.digest_rows(n, tokens, batch, own)
            differs = digest_mismatches({n: merged}, {n: digests}, compared)[n]
            tied = margins.reshape(-1) == 0
            self.topk_monitor.update_tied_rows(taken & compared, tied & compared, differs, compared)
        if layout.cu_seqlens is None:  # BSHD: sequence-relative keys are the layer's keys
            return merged.view(topk.shape)
        start = self._sequence_starts(layout.cu_seqlens, tokens)
        packed = torch.where(merged >= 0, merged.to(torch.int64) + start[:, None], -1)
        return packed.to(topk.dtype).view(topk.shape)

    @staticmethod
    def _sequence_starts(cu_seqlens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """int64 ``(rows,)``: the packed row each row's sequence starts at (THD)."""
        cu = _to_device(cu_seqlens, rows.device, torch.int64)
        return cu[_packed_sequence_of(cu, rows)]

    def _engines_layout(
        self, topk: torch.Tensor, layout: RankLayout, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk`` ``(b, rows, k)`` in the engines' layout: ``(tokens (b * rows,) int64, picks
        (b * rows, k))``, each row's global token and its sequence-relative picks."""
        rows = self._indexer_rows(x)
        positions = query_positions(layout, rows, topk.device)
        if layout.cu_seqlens is None:
            seq = rows * layout.cp_size
            tokens = torch.arange(topk.shape[0], device=topk.device).view(-1, 1) * seq + positions
            return tokens.reshape(-1), topk.reshape(-1, topk.shape[-1])
        start = self._sequence_starts(layout.cu_seqlens, positions)
        local = torch.where(topk[0] >= 0, topk[0] - start[:, None].to(topk.dtype), -1)
        return positions, local

    def rank_layout(
        self, query: torch.Tensor, x: torch.Tensor, packed_seq_params: PackedSeqParams | None
    ) -> RankLayout:
        """What this rank holds, as ``DSAttention.forward`` derives it (see :mod:`.layout`)."""
        sq = dsa_layout.ensure_sbhd(query, "query")[0].size(0)
        local = x.size(0)
        rows = self._indexer_rows(x)
        cp_size = self._cp_size
        query_start = 0
        if rows != local and sq == local:  # sequence parallel, sequence-local query rows
            query_start = self._tp_rank * local
        elif sq != rows:
            raise RuntimeError(
                f"DSA query rows ({sq}) are neither this rank's rows ({local}) nor the "
                f"sequence-parallel rows ({rows})."
            )
        layout = RankLayout(
            cp_size=cp_size,
            cp_rank=self._cp_rank,
            query_start=query_start,
            query_rows=sq,
        )
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return layout
        cu_seqlens, _ = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
        max_seqlen = packed_seq_params.max_seqlen_kv
        # As Megatron: host metadata proves a single sequence covers every packed row.
        covers = (
            cp_size > 1
            and cu_seqlens.numel() == 2
            and isinstance(packed_seq_params.max_seqlen_q, int)
            and packed_seq_params.max_seqlen_q == rows * cp_size
        )
        return dataclasses.replace(
            layout,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen if isinstance(max_seqlen, int) else None,
            cu_seqlens_cover_output=covers,
        )

    def compute_topk(
        self,
        query: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        packed_seq_params: PackedSeqParams | None,
        *,
        margins: bool = False,
        layout: RankLayout | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This layer's top-k ``(b, query rows, topk)`` int32, scored by the package in the
        configured precision (indices into the gathered keys, ``-1`` in unused slots); with
        ``margins`` also each row's ``topk``-th minus ``(topk + 1)``-th score ``(b, rows)``.
        ``layout``: :meth:`rank_layout` of these inputs, when the caller already has it."""
        precision = self._precision
        layout = layout or self.rank_layout(query, x, packed_seq_params)
        gather = None
        if layout.cp_size > 1:
            gather = functools.partial(
                gather_from_sequence_parallel_region, group=self.pg_collection.cp
            )
        strict = audit._strict_enabled()
        guard = (
            audit.strict_precision(precision.scoring_precision.value)
            if strict
            else contextlib.nullcontext()
        )
        before = audit.scoring_calls() if strict else 0
        with torch.no_grad(), audit.scoring_site("megatron"), guard:
            if self._graphs is None or not self.graph_applies(x, layout):
                topk = self._select(x, qr, packed_seq_params, layout, margins, gather)
            else:
                topk = self._graphed(x, qr, layout, margins)
        if strict and audit.scoring_calls() == before:
            raise audit.PrecisionMismatchError(
                f"DSA layer {self.layer_number} selected its top-k without a scoring call "
                f"(strict mode, {audit._STRICT_ENV})."
            )
        return topk

    def _select(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        packed_seq_params: PackedSeqParams | None,
        layout: RankLayout,
        margins: bool,
        gather: Gather | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The owned top-k, eagerly: operands from the projections, then one selection."""
        ops = self.indexer.scoring_operands(x.detach(), qr.detach(), packed_seq_params)
        select = _owned_topk_with_margins if margins else owned_topk
        return select(
            ops, layout, self.index_topk, gather=gather, backend=self.indexer.backend_for(ops)
        )

    def graph_applies(self, x: torch.Tensor, layout: RankLayout) -> bool:
        """Whether this forward's owned top-k replays from a CUDA graph: always with
        ``dsa_indexer_cuda_graph=True`` (a forward that cannot be captured raises when it runs),
        never with ``False``; with ``"auto"`` (the default) where it can be captured and the
        layer's rows are at most :data:`AUTO_GRAPH_MAX_ROWS` (short sequences, where the eager
        top-k waits for the host; longer ones are bound by the device). Host facts only."""
        if self._graph_mode != "auto":
            return self._graph_mode is True
        if self._graph_unsupported_reason(x, layout) is not None:
            return False
        return x.size(0) * x.size(1) <= AUTO_GRAPH_MAX_ROWS

    def _graph_unsupported_reason(self, x: torch.Tensor, layout: RankLayout) -> str | None:
        if not x.is_cuda:
            return f"the inputs are on {x.device}; CUDA graphs need a CUDA device"
        if layout.cu_seqlens is not None and layout.max_seqlen is None:
            return (
                "the packed sequences' max_seqlen_q / max_seqlen_kv are not host ints (a graph "
                "is sized by a host bound on the lengths)"
            )
        if layout.cp_size > 1:
            return f"context parallelism (cp_size={layout.cp_size}) gathers the keys over ranks"
        if self._indexer_rows(x) != x.size(0):
            return "sequence parallelism gathers the indexer rows over tensor-parallel ranks"
        return None

    def _graphed(
        self, x: torch.Tensor, qr: torch.Tensor, layout: RankLayout, margins: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The owned top-k from this layer's CUDA graph of it (``dsa_indexer_cuda_graph``)."""
        reason = self._graph_unsupported_reason(x, layout)
        if reason is not None:
            raise RuntimeError(
                f"DSA layer {self.layer_number}: dsa_indexer_cuda_graph=True cannot capture this "
                f"forward ({reason}); set dsa_indexer_cuda_graph=False for it."
            )
        indexer = self.indexer
        inputs: tuple[torch.Tensor, ...] = (x.detach(), qr.detach())
        key_layout, max_len = layout, None
        if layout.cu_seqlens is not None:  # packed: the lengths are an input, bucketed
            cu, max_len = _graph_packing(layout, x.size(0), x.device)
            inputs += (cu,)
            key_layout = dataclasses.replace(layout, cu_seqlens=None, max_seqlen=max_len)
        # What the launches depend on besides the inputs: the layout (packed: the bucketed
        # bound), margins, the parameters' storage, the preprocessing module (rebuilt when a
        # Megatron field it follows changes), the top-k size and RoPE type.
        key = (
            key_layout,
            margins,
            tuple([param(indexer).data_ptr() for param in self._indexer_params]),
            id(indexer.preprocess()),
            self.index_topk,
            self.config.rope_type,
        )

        def packed(cu_: torch.Tensor) -> tuple[PackedSeqParams, RankLayout]:
            assert max_len is not None  # packed
            params = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu_, cu_seqlens_kv=cu_, max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )  # fmt: skip
            return params, dataclasses.replace(layout, cu_seqlens=cu_, max_seqlen=max_len)

        def select(
            x_: torch.Tensor, qr_: torch.Tensor, *cu_: torch.Tensor
        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            if not cu_:
                return self._select(x_, qr_, None, layout, margins, None)
            return self._select(x_, qr_, *packed(cu_[0]), margins, None)

        # Megatron's cached angles, read by the graph where they lie
        def keep() -> tuple[torch.Tensor, IndexerPreprocess]:
            params = None if max_len is None else packed(inputs[2])[0]
            return (indexer.rope_angles(x, params)[0], indexer.preprocess())

        assert self._graphs is not None  # only called with its graphs (dsa_indexer_cuda_graph)
        return self._graphs(select, inputs, key, keep)

    # -- Megatron reads a staged top-k through its index-share holder ------------------------

    def _get_index_share_topk_holder(
        self,
        packed_seq_params: PackedSeqParams | None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[int, torch.Tensor]:
        staged = _STAGED.get().get(self)
        if staged is not None:
            return {self.layer_number: staged}
        return super()._get_index_share_topk_holder(packed_seq_params, attention_mask)

    def _get_index_share_topk_length_holder(
        self,
        packed_seq_params: PackedSeqParams | None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[int, torch.Tensor]:
        if self in _STAGED.get():
            return {}  # the owned top-k marks unused slots with -1; no per-row lengths
        return super()._get_index_share_topk_length_holder(packed_seq_params, attention_mask)
