"""What ``bench`` measures: :class:`_BenchConfig` (the command's flags) and the shapes it uses."""

from __future__ import annotations

import dataclasses

__all__ = ["thd_lengths"]

_HEAD_DIM = 128
_ROPE_DIM = 64


@dataclasses.dataclass(frozen=True)
class _BenchConfig:
    """What to measure (the command's flags)."""

    seqs: tuple[int, ...] = (8192, 16384)
    heads: tuple[int, ...] = (32, 64)
    batch: int = 1
    topk: int = 2048
    reps: int = 20
    warmup: int = 3
    chunked_from: int = 32768
    chunk_bytes: int | None = None  # indexer_select's default
    rope_fp32: bool = True
    # Off by default: Megatron's BF16 Hadamard is fast_hadamard_transform's kernel; where that
    # extension is missing, the BF16 side would time the package's float64 transform instead and
    # the BF16 / FP8 ratio would measure that, not the precision. vLLM's path has no Hadamard.
    hadamard: bool = False
    torch_reference: bool = False
    seed: int = 0
    # The long-context profile (--long): chunked select only, beside the raw chunked kernels.
    long_seqs: tuple[int, ...] = ()
    long_reps: int = 5
    # The time split of FP8 selection (--split): scoring, top-k, score traffic, at these S.
    split_seqs: tuple[int, ...] = ()
    # The packed profile (--thd): packings of T tokens, sequences in these proportions
    # (thd_lengths), FP8 indexer_scores_varlen / indexer_select_varlen beside the raw kernels.
    thd_seqs: tuple[int, ...] = ()
    thd_weights: tuple[int, ...] = (4, 1, 3, 2)
    # Megatron's own indexer per dsa_kernel_backend beside the package's FP8 (--megatron), at S.
    megatron_seqs: tuple[int, ...] = ()


_LONG_SEQS = (32768, 65536, 131072)
_SPLIT_SEQS = (16384, 65536)
# Megatron's dsa_kernel_backend values whose indexer --megatron times.
_MEGATRON_BACKENDS = ("none", "cudnn", "tilelang")
# The issue's threshold: build a fused score-and-select kernel if the scores' memory traffic
# costs more than this share of FP8 end-to-end time at S = 65536.
_FUSED_THRESHOLD = 0.20
_THD_SEQS = (8192, 16384)
# Four uneven sequences per packing (T = 8192: 3276, 819, 2457, 1640 tokens).
_THD_WEIGHTS = _BenchConfig.thd_weights


def thd_lengths(total: int, weights: tuple[int, ...]) -> list[int]:
    """Sequence lengths in proportion to ``weights`` summing to ``total`` (the last takes the
    rounding); ``ValueError`` naming both when a sequence would be empty."""
    if not weights or min(weights) < 1:
        raise ValueError(f"--thd-weights {list(weights)}: give one or more positive integers.")
    lens = [total * w // sum(weights) for w in weights[:-1]]
    lens.append(total - sum(lens))
    if min(lens) < 1:
        raise ValueError(
            f"--thd-seq {total} with --thd-weights {list(weights)} leaves an empty sequence "
            f"({lens}); pass a larger T or fewer sequences."
        )
    return lens
