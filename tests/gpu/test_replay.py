"""Replay on an SM90 GPU: the engine's picks reach Megatron's sparse attention without a host
synchronisation when validation is off (the default step), and validation changes no pick.

Checked against: the host synchronisation debug mode (``torch.cuda.set_sync_debug_mode("error")``
raises at the first synchronising call), and the same picks read with ``validate=True``.
"""

import pytest
import torch

from ..support.helpers import no_host_sync
from .test_megatron import _attention, _config, _forward, _inputs, dsap  # noqa: F401

pytestmark = pytest.mark.gpu
S = 2048


def _picks(lengths: list[int], k: int, device: str) -> torch.Tensor:
    """``(T, k)`` causal picks: each token's last ``k`` positions, ``-1`` before the start."""
    position = torch.cat([torch.arange(n) for n in lengths])
    picks = position[:, None] - torch.arange(k)
    picks = torch.where(picks >= 0, picks, -1)
    return picks.to(torch.int32).to(device) if device == "cuda" else picks.pin_memory()


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_replay_never_waits_for_the_host(dsap, packed, where):  # noqa: F811
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _attention(dsap, _config(dsap, dsa_indexer_topk_source="replay"))
    query, key, x, qr, up_v = _inputs(S)
    lengths, psp, layout = [S], None, dict(seq_len=S)
    if packed:
        lengths = [300, 1, 1099, 648]
        cu = torch.tensor([0, 300, 301, 1400, 2048], dtype=torch.int32)
        psp = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu.cuda(), cu_seqlens_kv=cu.cuda(), max_seqlen_q=1099,
            max_seqlen_kv=1099,
        )  # fmt: skip
        layout = dict(cu_seqlens=cu if where == "pinned" else cu.cuda())
    picks = {1: _picks(lengths, 64, where)}

    def step(validate: bool) -> torch.Tensor:
        """engine_topk's checks, then the layer's: its layout and its rows of the picks."""
        from dsa_precision.megatron.replay import _current_handed_in

        with dsap.engine_topk(picks, validate=validate, **layout):
            engine = _current_handed_in()
            assert engine is not None
            return attn._engine_picks(engine, attn.rank_layout(query, x, psp), query, x)

    want = step(validate=True)  # checks the data (synchronises); warm-up
    with no_host_sync():
        got = step(validate=False)
    assert torch.equal(got, want) and got.shape == (1, S, 256)
    # The picks drive Megatron's attention: forward and backward run on them.
    with dsap.engine_topk(picks, **layout):
        out = _forward(attn)(query, key, x, qr, up_v) if psp is None else None
    if out is not None:
        out.float().sum().backward()
        assert torch.isfinite(query.grad).all()
