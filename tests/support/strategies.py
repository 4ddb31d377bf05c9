"""Hypothesis strategies of engine data: top-k picks in the engines' layout, packed requests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

KEY_LIMIT = 2**31


@st.composite
def pick_rows(draw, *, max_rows: int = 24, max_k: int = 12, max_key: int = KEY_LIMIT - 1):
    """``(T, k)`` int64 picks: each row distinct keys in ``[0, max_key]`` in any order, ``-1``
    padding anywhere (empty rows included); any ``k >= 1`` (``T`` may be 0)."""
    rows = draw(st.integers(0, max_rows))
    k = draw(st.integers(1, max_k))
    out = []
    for _ in range(rows):
        n = draw(st.integers(0, k))
        keys = draw(st.lists(st.integers(0, max_key), min_size=n, max_size=n, unique=True))
        row = keys + [-1] * (k - n)
        out.append(draw(st.permutations(row)))
    return torch.tensor(out, dtype=torch.int64).reshape(rows, k)


@st.composite
def causal_requests(draw, *, max_requests: int = 3, max_len: int = 12, max_layers: int = 3):
    """Per-request engine rows ``(len - 1, L, k)`` int32 of causal picks (row ``i`` picks
    distinct keys in ``[0, i]``, ``-1`` padding, any order) and the requests' token counts."""
    n = draw(st.integers(1, max_requests))
    layers = draw(st.integers(1, max_layers))
    k = draw(st.integers(1, 6))
    rows, lens = [], []
    for _ in range(n):
        length = draw(st.integers(2, max_len))
        request = []
        for position in range(length - 1):
            per_layer = []
            for _ in range(layers):
                m = draw(st.integers(0, min(k, position + 1)))
                keys = draw(st.permutations(range(position + 1)))[:m]
                per_layer.append(draw(st.permutations(list(keys) + [-1] * (k - m))))
            request.append(per_layer)
        rows.append(torch.tensor(request, dtype=torch.int32).reshape(length - 1, layers, k))
        lens.append(length)
    return rows, lens
