"""DeepGEMM's paged decode kernel gives the prefill kernel's logits, bit for bit (issue 49): the
logits vLLM 0.33 decodes with (``fp8_fp4_paged_mqa_logits`` over its paged FP8 key cache, next_n 1
and 2, native and flattened) are, over every key a row sees, those of ``fp8_fp4_mqa_logits`` (what
``backend="deepgemm"`` calls) on the same operands. A DeepGEMM release that breaks this would make
the engine's decode picks differ from the prefill picks the package reproduces; this test catches
it, for each DeepGEMM that imports (the standalone ``deep_gemm``, vLLM's vendored copy).

The call is vLLM's (``vllm/model_executor/layers/sparse_attn_indexer.py``, decode branch, SM90):
q ``(B, next_n, H, 128)`` E4M3 with no q scale (``(q, None)``: the q descale is folded into the
float32 weights ``(B * next_n, H)``, as in the package's operands), the cache
``(num_blocks, 64, 1, 132)`` uint8 (``tests/support/paged_cache.py`` says the layout),
``context_lens`` ``(B, next_n)`` int32, the block table ``(B, max_blocks)`` int32, the schedule
from ``get_paged_mqa_logits_metadata(context_lens, 64, num_sms)`` and ``max_model_len``; the
logits ``(B * next_n, max_model_len)`` float32 are not cleaned past a row's keys (the SM90 kernel
computes whole 64-key blocks up to the request's last row), so only the keys each row sees are
compared. Positional arguments: DeepGEMM 54e2261 (pybind, then ``clean_logits=False``,
``logits_dtype``, ``indices``) and 2.8.1 (``indices``) take them alike.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from dsa_precision import indexer_scores, prepare_scoring_operands
from dsa_precision.backends import deepgemm as deepgemm_backend

from ..support.configs import FP8
from ..support.helpers import assert_bitwise_equal, rel_err
from ..support.paged_cache import (
    BLOCK_SIZE,
    DecodeBatch,
    decode_batch,
    paged_logits_reference,
    read_paged_keys,
    write_paged_keys,
)

DEV = "cuda"
PAGED_API = ("fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata")
# Sequences of different lengths: shorter than a page, a page exactly, one key past it, pages
# past one SM's 256-key split, and one key past a page boundary at the long end.
LENGTHS = (37, 64, 65, 300, 1024, 2049, 4097)
MAX_MODEL_LEN = 8192  # the logits' width and the block table's (MAX_MODEL_LEN / 64 pages)
CASES = [
    pytest.param(1, False, id="next_n1"),
    pytest.param(2, False, id="next_n2"),
    pytest.param(2, True, id="next_n2-flattened"),  # vLLM's flattening: 2B requests of 1 token
]


@functools.cache
def _paged_entry(name: str) -> tuple[deepgemm_backend._EntryPoint | None, str | None]:
    """The package's entry point on module ``name`` when that module also has the paged decode
    API, else why not."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # ImportError, or a broken build (missing CUDA_HOME, ...)
        return None, f"{name} does not import ({exc})"
    entry, reason = deepgemm_backend._resolve(module, name)
    if entry is None:
        return None, str(reason)
    missing = [attr for attr in PAGED_API if not callable(getattr(module, attr, None))]
    if missing:
        version = getattr(module, "__version__", "unknown version")
        return None, (
            f"{name} ({version}) has no {' or '.join(missing)}: no paged decode API in the form "
            "vLLM 0.33 calls (DeepGEMM 54e2261 and the 2.8.1 vLLM 0.33 vendors have it)"
        )
    return entry, None


@pytest.fixture(params=deepgemm_backend._MODULES)
def deepgemm(request, monkeypatch):
    """Each DeepGEMM module the package tries (``deep_gemm``, vLLM's copy) that imports with the
    paged API, the package's ``backend="deepgemm"`` pointed at it; a skip saying why otherwise."""
    entry, reason = _paged_entry(request.param)
    if entry is None:
        pytest.skip(
            f"{reason}; DeepGEMM: docs/gpu-validation.md, vLLM's copy: ../shared/gpu/vllm_wheel.sh"
        )
    monkeypatch.setattr(deepgemm_backend, "_import", lambda: (entry, None))
    return entry


def _operands(next_n: int, h: int, seed: int):
    """FP8 operands of the last ``next_n`` tokens of each sequence of LENGTHS (keys padded to
    the longest; a row never sees a padding key)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    b, s_k = len(LENGTHS), max(LENGTHS)
    q = torch.randn(b, next_n, h, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(b, s_k, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(b, next_n, h, device=DEV, generator=g) * h**-0.5 * 128**-0.5
    return prepare_scoring_operands(q, k, w.to(torch.bfloat16), config=FP8)


def _paged_logits(module, kv_cache: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """vLLM's decode call of DeepGEMM's paged kernel (its metadata, then the logits)."""
    if callable(getattr(module, "get_num_sms", None)):
        num_sms = int(module.get_num_sms())  # what the kernel checks the schedule against
    else:
        num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    schedule = module.get_paged_mqa_logits_metadata(batch.context_lens, BLOCK_SIZE, num_sms)
    return module.fp8_fp4_paged_mqa_logits(
        (batch.q, None),
        kv_cache,
        batch.weights,
        batch.context_lens,
        batch.block_table,
        schedule,
        MAX_MODEL_LEN,
    )


def _seen(logits: torch.Tensor, batch: DecodeBatch, width: int, what: str) -> torch.Tensor:
    """The paged logits over the keys each row sees, ``-inf`` past them (the prefill's clean
    form), ``(rows, width)``."""
    assert logits.dtype == torch.float32 and logits.ndim == 2, (what, logits.dtype, logits.shape)
    assert logits.shape[0] == batch.rows and logits.shape[1] >= width, (what, logits.shape)
    cols = torch.arange(width, device=logits.device)
    seen = cols < batch.context_lens.reshape(-1, 1)
    return torch.where(seen, logits[:, :width], float("-inf"))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("next_n, flattened", CASES)
def test_paged_decode_logits_are_the_prefill_logits(deepgemm, record, h, next_n, flattened):
    module, b = deepgemm.module, len(LENGTHS)
    layout = "flattened" if flattened else "native"
    kernel = f"{deepgemm.name.rsplit('.', 1)[0]}.fp8_fp4_paged_mqa_logits"
    ops = _operands(next_n, h, seed=100 * next_n + h + int(flattened))

    # Prefill: row j of sequence b sits at L_b - next_n + j and sees L_b - next_n + j + 1 keys.
    offsets = torch.tensor([n - next_n for n in LENGTHS], device=DEV)
    prefill = indexer_scores(ops, q_causal_offsets=offsets, backend="deepgemm")
    want = prefill.reshape(b * next_n, max(LENGTHS))
    width = want.shape[1]

    keys = write_paged_keys(ops.k, ops.k_descale, LENGTHS, max_model_len=MAX_MODEL_LEN)
    for i, n in enumerate(LENGTHS):  # the cache holds the operands' keys, byte for byte
        k, k_scale = read_paged_keys(keys.kv_cache, keys.block_table[i], n)
        assert_bitwise_equal(k.view(torch.uint8), ops.k[i, :n].view(torch.uint8), f"keys {i}")
        assert_bitwise_equal(k_scale, ops.k_descale[i, :n].contiguous(), f"key scales {i}")
    batch = decode_batch(ops.q, ops.weights, keys, flattened=flattened)
    # The paged rows are the prefill's rows: a layout or row-order mistake is off by O(1), far
    # past the loose bound that DeepGEMM's FP8 accumulation needs (the bit-for-bit check is below).
    err = rel_err(want, paged_logits_reference(keys.kv_cache, batch)[:, :width])
    assert err <= 1e-2, f"the prefill logits are not those of the paged rows: rel err {err:.3g}"

    what = f"{kernel} vs {deepgemm.name} ({layout}, next_n={next_n}, {h} heads; row r is "
    what += f"token r % next_n of sequence r // next_n, lengths {LENGTHS})"
    got = _seen(_paged_logits(module, keys.kv_cache, batch), batch, width, what)
    assert_bitwise_equal(got, want, f"{what}, batched")

    per = next_n if flattened else 1  # launch entries per sequence
    for i in range(b):  # each sequence alone
        alone = batch.entries(i * per, (i + 1) * per)
        got = _seen(_paged_logits(module, keys.kv_cache, alone), alone, width, what)
        rows = slice(i * next_n, (i + 1) * next_n)
        assert_bitwise_equal(got, want[rows], f"{what}, sequence {i} alone")
    torch.cuda.synchronize()
    record(
        "deepgemm_paged_vs_prefill",
        kernel=kernel,
        version=str(getattr(module, "__version__", "unknown")),
        layout=layout,
        next_n=next_n,
        heads=h,
        rows=batch.rows,
        keys_compared=int(batch.context_lens.sum()),
        bitwise_equal=True,
    )


# ------------------------------------------------------ the cache layout (CPU tensors, no DeepGEMM)


@pytest.mark.gpu  # in tests/gpu, where only the GPU step runs tests; it needs no GPU itself
@pytest.mark.parametrize("next_n, flattened", CASES)
def test_the_paged_cache_is_vllms_layout_and_holds_the_rows_keys(next_n, flattened):
    """What the test above writes is vLLM's layout, checked by byte offsets computed apart from
    the writer (page ``p`` at ``p * 64 * 132``: 64 tokens of 128 E4M3 bytes, then their 64
    float32 scales), and the decode rows read through the block table are the prefill rows (the
    torch reference): a layout mistake fails here, apart from any DeepGEMM difference."""
    lengths, h, s_k = (5, 64, 130), 32, 130
    q = torch.randn(len(lengths), next_n, h, 128)
    k = torch.randn(len(lengths), s_k, 128)
    w = torch.randn(len(lengths), next_n, h) * h**-0.5 * 128**-0.5
    ops = prepare_scoring_operands(q, k, w, config=FP8)
    keys = write_paged_keys(ops.k, ops.k_descale, lengths, max_model_len=256, seed=3)

    assert keys.kv_cache.shape == (sum(-(-n // 64) for n in lengths) + 5, 64, 1, 132)
    assert keys.block_table.shape == (3, 4) and keys.block_table.dtype == torch.int32
    flat = keys.kv_cache.reshape(-1)
    used = []
    for b, n in enumerate(lengths):
        pages = keys.block_table[b, : -(-n // 64)].tolist()
        assert not set(pages) & set(used), "a page serves two sequences"
        used += pages
        for t in range(n):
            base = pages[t // 64] * 64 * 132
            value = flat[base + (t % 64) * 128 : base + (t % 64) * 128 + 128]
            scale = flat[base + 64 * 128 + (t % 64) * 4 : base + 64 * 128 + (t % 64) * 4 + 4]
            assert torch.equal(value, ops.k[b, t].view(torch.uint8)), (b, t)
            assert torch.equal(scale.view(torch.float32), ops.k_descale[b, t : t + 1]), (b, t)
    assert used != sorted(used), "the pages are in order: the block table is not exercised"

    batch = decode_batch(ops.q, ops.weights, keys, flattened=flattened)
    assert batch.rows == len(lengths) * next_n
    lens = [n - next_n + 1 + j for n in lengths for j in range(next_n)]
    assert batch.context_lens.reshape(-1).tolist() == lens
    offsets = torch.tensor([n - next_n for n in lengths])
    want = indexer_scores(ops, q_causal_offsets=offsets, backend="torch")
    got = paged_logits_reference(keys.kv_cache, batch)
    assert rel_err(got, want.reshape(batch.rows, s_k)[:, : got.shape[1]]) <= 1e-6
