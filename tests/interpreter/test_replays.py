"""The Triton kernels, interpreted, replay bit for bit (registered in tests/determinism/manifest.py;
compiled on the H200: tests/gpu/test_determinism.py)."""

import torch

from dsa_precision import IndexerPrecisionConfig, prepare_scoring_operands
from dsa_precision.kernels.topk_picks import drop_invalid_picks
from dsa_precision.testing import assert_replays_bit_exact


def test_drop_invalid_picks_replays_bit_exact():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2048 + 7, generator=g)
    values[::5] = float("-inf")
    values[::11] = float("nan")
    indices = torch.randint(0, 1 << 16, values.shape, generator=g, dtype=torch.int32)
    picks = assert_replays_bit_exact(drop_invalid_picks, (indices, values), what="drop picks")
    assert bool((picks[::5] == -1).all())


def test_fused_preprocess_quantize_replays_bit_exact():
    """prepare_scoring_operands(impl="triton"): the fused quantize + weight fold kernel."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 32, 128, generator=g) * torch.logspace(-8, 6, 128, base=2.0)
    k = torch.randn(1, 5, 128, generator=g)
    w = (torch.randn(1, 3, 32, generator=g) * 0.02).to(torch.bfloat16)

    def prepare(q, k, w):
        return prepare_scoring_operands(
            q,
            k,
            w,
            config=IndexerPrecisionConfig(scoring_precision="fp8"),
            sm_scale=0.3,
            impl="triton",
        )

    ops = assert_replays_bit_exact(prepare, (q, k, w), what="fused quantize")
    assert ops.q.dtype == torch.float8_e4m3fn


def test_mask_tails_replays_bit_exact():
    """The -inf tail mask of DeepGEMM's uncleaned logits (in place on a padded buffer)."""
    from dsa_precision.kernels.mask_tails import _mask_tails

    g = torch.Generator().manual_seed(3)
    buf = torch.randn(5, 1024 + 256, generator=g)
    counts = torch.tensor([0, 1, 700, 1024, 1023], dtype=torch.int32)

    def mask(buf, counts):
        return _mask_tails(buf[:, :1024], counts)

    out = assert_replays_bit_exact(mask, (buf, counts), what="tail mask")
    assert bool(torch.isneginf(out[2, 700:]).all()) and bool(torch.isfinite(out[2, :700]).all())


def test_varlen_windows_replays_bit_exact():
    """Every packed row's key window (DeepGEMM's ks / ke and the visible counts): the one-launch
    kernel, and dsa_precision.rows' expression of it (its CPU route), equal on every replay."""
    from dsa_precision import rows
    from dsa_precision.kernels.varlen_windows import _varlen_windows

    cu = torch.tensor([0, 3, 3, 10, 16], dtype=torch.int32)
    offsets = torch.tensor([0, 0, 2, 0], dtype=torch.int32)

    def windows(cu, offsets):
        fused = torch.stack(_varlen_windows(cu, cu, offsets, 1, 16))
        torch_route = torch.stack(tuple(rows._varlen_windows(cu, cu, offsets, 1, 16)))
        return torch.cat((fused, torch_route))

    out = assert_replays_bit_exact(windows, (cu, offsets), what="varlen windows")
    assert torch.equal(out[:3], out[3:])
    assert out[2].tolist()[:4] == [1, 2, 3, 3]  # row 3: sequence 2's first row, offset 2


def test_digest_picks_replays_bit_exact():
    """The row digests in one pass (capture.digest_rows on CUDA)."""
    from dsa_precision.kernels.digest import _digest_picks

    g = torch.Generator().manual_seed(4)
    picks = torch.randint(-1, 5000, (6, 300), generator=g, dtype=torch.int32)
    digests = assert_replays_bit_exact(_digest_picks, (picks,), what="row digests")
    assert digests.dtype == torch.int64


def test_tie_rows_kernel_replays_bit_exact():
    """The tie replay's one-pass kernel (capture.engine_tie_rows on CUDA)."""
    from dsa_precision.kernels.tie_rows import tie_rows

    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-2, 3, (5, 3000), generator=g).float()
    picks = torch.randint(0, 100, (5, 64), generator=g, dtype=torch.int32)
    starts = torch.tensor([0, 3, 100, 0, 2800], dtype=torch.int32)
    lengths = torch.tensor([3000, 2000, 100, 200, 200], dtype=torch.int32)
    digests, sent = assert_replays_bit_exact(
        tie_rows, (logits, picks, starts, lengths), what="tie rows"
    )
    assert digests.dtype == torch.int64 and sent.dtype == torch.bool
