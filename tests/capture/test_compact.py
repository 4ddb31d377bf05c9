"""The compact pick formats: exact round trips, the delta stream's size, and keys refused before encoding."""

import pytest
import torch

from dsa_precision.capture import (
    FORMATS,
    decode_picks,
    encode_picks,
)

from ..support.engine_outputs import causal_picks


def _as_set(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t < 0, 2**40, t.to(torch.int64)).sort(-1).values


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_round_trip_is_exact(fmt):
    idx = causal_picks(200, k=16, seed=16)
    idx[50] = -1  # an empty row
    idx[70, 3:] = -1  # a short row
    packed = encode_picks(idx, fmt, rows_per_chunk=33)  # chunk boundaries inside the stream
    back = decode_picks(packed)
    assert back.dtype == torch.int32 and back.shape == idx.shape
    if fmt == "delta":  # the same set, sorted, padding last
        assert torch.equal(_as_set(back), _as_set(idx))
        assert torch.equal(back, torch.where(_as_set(idx) >= 2**40, -1, _as_set(idx)).int())
    else:  # order preserved
        assert torch.equal(back, idx)


def test_delta_handles_long_sequences_and_saves_bytes():
    seq, k = 70000, 64
    g = torch.Generator().manual_seed(17)
    rows = torch.arange(seq - 300, seq)  # late rows of a 70k-token sequence
    picks = torch.stack([torch.randperm(int(r) + 1, generator=g)[:k] for r in rows[:40]])
    picks[:, 0] = rows[:40]  # the token itself, position > 65535
    packed = encode_picks(picks, "delta")
    assert torch.equal(_as_set(decode_picks(packed)), _as_set(picks))
    assert packed.nbytes < encode_picks(picks, "int32").nbytes * 0.6
    with pytest.raises(ValueError, match=r"format='int16' holds keys up to 32767"):
        encode_picks(picks, "int16")


def test_delta_rows_that_pick_every_key_cost_no_payload():
    idx = causal_picks(8, k=8)  # row i picks all of 0..i: every gap is 0
    packed = encode_picks(idx, "delta")
    assert packed.width.tolist() == [0] * 8 and packed.data.numel() == 1  # the slack word only


def test_encode_rejects_bad_keys():
    with pytest.raises(ValueError, match=r"row 0 holds -2; keys are -1"):
        encode_picks(torch.tensor([[0, -2]]), "delta")
    with pytest.raises(TypeError, match=r"\(T, k\) int16/int32/int64"):
        encode_picks(torch.zeros(3, 2), "delta")


def test_delta_encode_rejects_a_repeated_key_instead_of_shifting_the_row():
    """A repeated key is a -1 gap: encoded, it decoded as other keys ([3, 3, 5] -> [3, 7, 8])."""
    idx = causal_picks(40, k=6)
    idx[37, 1] = idx[37, 0]
    with pytest.raises(ValueError, match=r"indices: row 37 repeats a key"):
        encode_picks(idx, "delta", rows_per_chunk=16)
