"""The scoring-call counters under a CUDA graph's capture: ``audit._captured_calls`` counts the
calls a capture makes apart from :func:`scoring_calls` (a capture launches nothing), and
``_record_scoring_calls`` records them per replay, strict mode included."""

import pytest
import torch

from dsa_precision import audit, indexer_scores, reset_scoring_calls, scoring_calls
from dsa_precision.config import IndexerPrecisionConfig


def _score(precision: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 32, 128, generator=g), torch.randn(1, 4, 128, generator=g)
    w = torch.rand(1, 4, 32, generator=g)
    indexer_scores(q, k, w, config=IndexerPrecisionConfig(scoring_precision=precision))


def test_a_capture_counts_apart_and_each_replay_records():
    reset_scoring_calls()
    with audit._captured_calls() as calls:
        _score("fp8")
        _score("fp8")
        _score("bf16")
    assert scoring_calls() == 0
    assert dict(calls) == {("fp8", "torch"): 2, ("bf16", "torch"): 1}
    with audit.scoring_site("megatron"):
        audit._record_scoring_calls(calls)
        audit._record_scoring_calls(calls)
    assert scoring_calls("fp8", "torch", "megatron") == 4 and scoring_calls("bf16") == 2


def test_strict_mode_checks_every_replayed_call():
    with audit._captured_calls() as calls:
        _score("bf16")
    with audit.strict_precision("fp8"), pytest.raises(audit.PrecisionMismatchError, match="bf16"):
        audit._record_scoring_calls(calls)
