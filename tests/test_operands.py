"""ScoringOperands, the data the scoring kernels read: built from engine tensors, and row slices that are views."""

import pytest
import torch

from dsa_precision import (
    ScoringOperands,
    indexer_scores,
    prepare_scoring_operands,
    quantize_e4m3_ue8m0,
)

from .support.configs import CONFIGS, FP8
from .support.helpers import assert_bitwise_equal, scoring_carriers


def test_operands_from_engine_tensors_score_like_prepared_ones():
    """Captured engine operands (quantized tensors, folded weights) build ScoringOperands
    directly and score exactly like the prepared ones."""
    q, k, w = scoring_carriers()
    q8, qs = quantize_e4m3_ue8m0(q)
    k8, ks = quantize_e4m3_ue8m0(k)
    direct = ScoringOperands(q8, k8, (w.float() * qs) * 0.5, qs, ks)
    prepared = prepare_scoring_operands(q, k, w, config=FP8, sm_scale=0.5)
    a = indexer_scores(direct, backend="torch")
    assert_bitwise_equal(a, indexer_scores(prepared, backend="torch"), "direct vs prepared")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_rows_are_views_of_the_query_side(precision):
    ops = prepare_scoring_operands(*scoring_carriers(), config=CONFIGS[precision])
    part = ops.rows(1, 4)
    assert part.q.shape[1] == part.weights.shape[1] == 3
    assert part.q.data_ptr() == ops.q[:, 1:].data_ptr()  # a view, not a copy
    assert part.k is ops.k and part.k_descale is ops.k_descale
    assert part.sm_scale == ops.sm_scale and part.precision is ops.precision
    if precision == "fp8":
        assert_bitwise_equal(part.q_descale, ops.q_descale[:, 1:4], "q descale rows")
    else:
        assert part.q_descale is None


def test_rows_of_every_row_are_the_operands_themselves():
    """A full-range ``rows`` returns the checked operands as they are (no rebuild per call);
    a part is still a new, checked view."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 4, 8, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 6, 8, generator=g).to(torch.bfloat16)
    w = torch.randn(1, 6, 4, generator=g).to(torch.bfloat16)
    ops = ScoringOperands(q, k, w)
    assert ops.rows(0, 6) is ops
    part = ops.rows(2, 5)
    assert part is not ops and part.q.shape[1] == 3 and torch.equal(part.q, ops.q[:, 2:5])
    assert part.k is ops.k
