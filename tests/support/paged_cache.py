"""The indexer's paged FP8 key cache as vLLM 0.33 lays it out, and the decode rows it scores, for
the test that DeepGEMM's paged decode kernel (``fp8_fp4_paged_mqa_logits``) gives the prefill
kernel's logits (``tests/gpu/test_deepgemm_paged.py``).

The layout (vLLM 0.33.0): the cache is allocated ``(num_blocks, block_size, D + 4)`` uint8 and
handed to DeepGEMM as ``kv_cache.unsqueeze(-2)``, ``(num_blocks, block_size, 1, D + 4)``
(``kv_cache_as_quant_view`` in ``vllm/model_executor/layers/sparse_attn_indexer.py``). Inside a
block the bytes are segregated, not interleaved per token: first the ``block_size`` tokens' ``D``
E4M3 bytes, token after token, then their ``block_size`` float32 scales (the writer's
``val_ptr = block + pos * D`` and ``scale_ptr = block + block_size * D + pos * 4``,
``vllm/models/deepseek_v41/common/ops/indexer_k_store.py``; ``indexer_k_quant_and_cache`` writes
the same). DeepGEMM reads it that way: values ``(num_blocks, block_kv, D)`` with strides
``(stride0, D, 1)`` from the base, scales ``(num_blocks, block_kv)`` float32 from byte
``block_kv * D`` (``fp8_fp4_paged_mqa_logits`` in ``csrc/apis/attention.hpp`` of DeepGEMM
54e2261; 2.8.1 asserts the same strides). SM90 takes blocks of 64 tokens only.

The rows (``vllm/v1/attention/backends/mla/indexer.py``): a request of ``L`` tokens decodes its
last ``next_n`` tokens; token ``j`` sees ``L - next_n + 1 + j`` keys, given as ``context_lens``
``(B, next_n)`` int32 (always 2-D for DeepGEMM; ``(B, 1)`` when ``next_n`` is 1). vLLM's
flattened form scores the same rows as ``B * next_n`` requests of one token, each with its own
``context_lens`` entry and a copy of its request's block-table row.
"""

from __future__ import annotations

import dataclasses

import torch

BLOCK_SIZE = 64  # tokens per page: DeepGEMM's SM90 paged kernel takes 64 only
HEAD_DIM = 128
SCALE_BYTES = 4  # one float32 per token


@dataclasses.dataclass(frozen=True)
class PagedKeys:
    """Keys of ``B`` sequences in a paged cache."""

    kv_cache: torch.Tensor  # (num_blocks, BLOCK_SIZE, 1, HEAD_DIM + 4) uint8
    block_table: torch.Tensor  # (B, max_blocks) int32, row b: the physical pages of sequence b
    lengths: tuple[int, ...]  # tokens of each sequence


def _regions(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache's bytes: values ``(num_blocks, BLOCK_SIZE, HEAD_DIM)`` and scales
    ``(num_blocks, BLOCK_SIZE, 4)``, both uint8, sharing the cache's storage."""
    num_blocks, block_size, heads, width = kv_cache.shape
    assert kv_cache.dtype == torch.uint8 and kv_cache.is_contiguous(), kv_cache.stride()
    assert (block_size, heads, width) == (BLOCK_SIZE, 1, HEAD_DIM + SCALE_BYTES), kv_cache.shape
    pages = kv_cache.view(num_blocks, BLOCK_SIZE * (HEAD_DIM + SCALE_BYTES))
    values = pages[:, : BLOCK_SIZE * HEAD_DIM].view(num_blocks, BLOCK_SIZE, HEAD_DIM)
    scales = pages[:, BLOCK_SIZE * HEAD_DIM :].view(num_blocks, BLOCK_SIZE, SCALE_BYTES)
    return values, scales


def _slots(block_table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical block and position in it of tokens ``0 .. length - 1``."""
    tokens = torch.arange(length, device=block_table_row.device)
    return block_table_row[tokens // BLOCK_SIZE].long(), tokens % BLOCK_SIZE


def write_paged_keys(
    k: torch.Tensor,  # (B, S_k, HEAD_DIM) float8_e4m3fn
    k_descale: torch.Tensor,  # (B, S_k) float32
    lengths: list[int] | tuple[int, ...],  # sequence b is keys k[b, :lengths[b]]
    *,
    max_model_len: int,
    spare_blocks: int = 5,
    seed: int = 0,
) -> PagedKeys:
    """The keys in a paged cache laid out as vLLM's: every sequence on its own pages, the pages
    of all sequences shuffled among ``spare_blocks`` more (so no sequence is contiguous), every
    slot no key of a sequence fills holding a stale key (finite E4M3 bytes, a scale in
    ``[0.5, 1.5)``), as a cache in use does. The block table is ``max_model_len / BLOCK_SIZE``
    wide, unused entries 0 (vLLM's padding)."""
    assert k.dtype == torch.float8_e4m3fn and k.shape[-1] == HEAD_DIM, (k.dtype, k.shape)
    assert k_descale.dtype == torch.float32 and k_descale.shape == k.shape[:2]
    assert len(lengths) == k.shape[0] and max(lengths) <= min(k.shape[1], max_model_len)
    assert max_model_len % BLOCK_SIZE == 0, max_model_len
    device = k.device
    g = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-length // BLOCK_SIZE) for length in lengths]
    num_blocks = sum(pages) + spare_blocks
    kv_cache = torch.empty(
        num_blocks, BLOCK_SIZE, 1, HEAD_DIM + SCALE_BYTES, dtype=torch.uint8, device=device
    )
    values, scales = _regions(kv_cache)
    stale = torch.randn(num_blocks, BLOCK_SIZE, HEAD_DIM, device=device, generator=g)
    values.copy_(stale.to(torch.float8_e4m3fn).view(torch.uint8))
    stale_scales = torch.rand(num_blocks, BLOCK_SIZE, device=device, generator=g) + 0.5
    scales.copy_(stale_scales.view(torch.uint8).view(num_blocks, BLOCK_SIZE, SCALE_BYTES))

    order = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    block_table = torch.zeros(
        len(lengths), max_model_len // BLOCK_SIZE, dtype=torch.int32, device=device
    )
    start = 0
    for b, (length, n) in enumerate(zip(lengths, pages, strict=True)):
        block_table[b, :n] = order[start : start + n]
        start += n
        block, pos = _slots(block_table[b], length)
        values[block, pos] = k[b, :length].contiguous().view(torch.uint8)
        key_scales = k_descale[b, :length].contiguous().view(torch.uint8)
        scales[block, pos] = key_scales.view(length, SCALE_BYTES)
    return PagedKeys(kv_cache, block_table, tuple(int(n) for n in lengths))


def read_paged_keys(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``0 .. length - 1`` of one sequence read back from the cache: ``(length, HEAD_DIM)``
    E4M3 and ``(length,)`` float32 (what vLLM's ``cp_gather_indexer_k_quant_cache`` gathers)."""
    values, scales = _regions(kv_cache)
    block, pos = _slots(block_table_row, length)
    k = values[block, pos].contiguous().view(torch.float8_e4m3fn)
    return k, scales[block, pos].contiguous().view(torch.float32).view(length)


def decode_context_lens(
    lengths: list[int] | tuple[int, ...], next_n: int, device: torch.device | str
) -> torch.Tensor:
    """``(B, next_n)`` int32: token ``j`` of a sequence of ``L`` tokens sees ``L - next_n + 1 +
    j`` keys (vLLM's native decode ``seq_lens``)."""
    lens = torch.tensor(lengths, dtype=torch.int32, device=device).view(-1, 1)
    return lens - next_n + 1 + torch.arange(next_n, dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The arguments of one paged-logits launch besides the cache and the metadata."""

    q: torch.Tensor  # (B', next_n', H, HEAD_DIM) float8_e4m3fn, contiguous
    weights: torch.Tensor  # (B' * next_n', H) float32, contiguous
    context_lens: torch.Tensor  # (B', next_n') int32, contiguous
    block_table: torch.Tensor  # (B', max_blocks) int32, contiguous

    @property
    def rows(self) -> int:
        return self.q.shape[0] * self.q.shape[1]

    def entries(self, start: int, stop: int) -> DecodeBatch:
        """Requests ``[start, stop)`` alone (their rows of q, weights and lengths)."""
        per = self.q.shape[1]
        return DecodeBatch(
            self.q[start:stop].contiguous(),
            self.weights[start * per : stop * per].contiguous(),
            self.context_lens[start:stop].contiguous(),
            self.block_table[start:stop].contiguous(),
        )


def decode_batch(
    q: torch.Tensor,  # (B, next_n, H, HEAD_DIM) float8_e4m3fn: the last next_n tokens
    weights: torch.Tensor,  # (B, next_n, H) float32, q descale folded in
    keys: PagedKeys,
    *,
    flattened: bool = False,
) -> DecodeBatch:
    """vLLM's decode launch of these rows: native (``B`` requests of ``next_n`` tokens) or
    flattened (``B * next_n`` requests of one token, block-table rows repeated)."""
    b, next_n, h, _ = q.shape
    context_lens = decode_context_lens(keys.lengths, next_n, q.device)
    block_table = keys.block_table
    if flattened:
        q = q.reshape(b * next_n, 1, h, HEAD_DIM)
        context_lens = context_lens.reshape(b * next_n, 1)
        block_table = block_table.repeat_interleave(next_n, dim=0)
    return DecodeBatch(
        q.contiguous(),
        weights.reshape(b * next_n, h).contiguous(),
        context_lens.contiguous(),
        block_table.contiguous(),
    )


def paged_logits_reference(kv_cache: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """``(rows, max visible keys)`` float32 logits of the batch's rows over the keys they see,
    computed in float64 from the cache through the block table, ``-inf`` past each row's keys:
    ``k_scale * sum_h relu(q_h . k) * w_h``. A check of the layout and the row order (the
    kernel's own summation order is DeepGEMM's), on any device."""
    entries, per = batch.q.shape[:2]
    lens = batch.context_lens.reshape(-1)
    width = int(lens.max())
    out = torch.full((batch.rows, width), float("-inf"), dtype=torch.float32, device=lens.device)
    for e in range(entries):
        for j in range(per):
            row, n = e * per + j, int(batch.context_lens[e, j])
            k, k_scale = read_paged_keys(kv_cache, batch.block_table[e], n)
            dots = batch.q[e, j].double() @ k.double().T  # (H, n)
            w = batch.weights[row].double()
            out[row, :n] = ((dots.clamp_min(0) * w[:, None]).sum(0) * k_scale.double()).float()
    return out
