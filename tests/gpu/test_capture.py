"""Capture on the GPU: the compact format decodes and the row digest computes on the device
without a host synchronisation, to the same bits as on the CPU (the CPU round trip and the
pure-Python digest reference are tested in tests/capture)."""

import pytest
import torch

from dsa_precision.capture import decode_picks, digest_row_reference, digest_rows, encode_picks

from ..support.engine_outputs import causal_picks
from ..support.helpers import no_host_sync

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("fmt", ["int16", "delta"])
def test_decode_on_the_device_never_waits_for_the_host(fmt):
    idx = causal_picks(3000, k=64, seed=30)
    host = encode_picks(idx, fmt)
    moved = host.pin_memory().to(DEV, non_blocking=True)
    decode_picks(moved)  # warm-up (allocator)
    with no_host_sync():
        back = decode_picks(moved)
        digests = digest_rows(back)
    assert torch.equal(back.cpu(), decode_picks(host))  # the CPU decode, bit for bit
    assert digests.cpu().tolist() == [digest_row_reference(r) for r in idx.tolist()]


def test_encode_on_the_device_matches_the_cpu_encoding():
    idx = causal_picks(2000, k=32, seed=31)
    on_gpu, on_cpu = encode_picks(idx.to(DEV), "delta"), encode_picks(idx, "delta")
    for a, b in zip(on_gpu.tensors(), on_cpu.tensors(), strict=True):
        assert torch.equal(a.cpu(), b)
