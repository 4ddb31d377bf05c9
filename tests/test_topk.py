"""indexer_topk on the torch backend against a per-row Python reference of the selection rule
(tests/helpers.reference_topk): ties toward the lower index, +0 above -0, -inf and NaN never
selected, -1 padding, seq_lens, any leading shape, score dtypes, non-deterministic mode; and
WindowScores (``clean=False``), read in place up to each row's length whatever lies past it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsa_precision import WindowScores, indexer_topk
from dsa_precision import topk as topk_module

from .support.helpers import reference_topk_rows


def check(scores, k, seq_lens=None, **kw):
    got = indexer_topk(scores, k, seq_lens=seq_lens, backend="torch", **kw)
    assert got.dtype == torch.int32 and got.shape == (*scores.shape[:-1], k)
    want = reference_topk_rows(scores.float(), k, seq_lens)
    assert got.reshape(-1, k).tolist() == want, f"k={k}"
    return got


@pytest.mark.parametrize("k", [1, 3, 16, 33, 50])
def test_random_scores_with_masks_and_seq_lens(k):
    scores = torch.randn(2, 7, 33)
    scores[0, :, 20:] = float("-inf")
    scores[1, 3, ::2] = float("-inf")
    check(scores, k)
    check(scores, k, seq_lens=torch.randint(0, 34, (2, 7)))
    check(scores, k, seq_lens=torch.randint(0, 34, (2, 7), dtype=torch.int32))


def test_exact_ties_break_toward_the_lower_index():
    scores = torch.zeros(4, 64)  # e.g. keys whose heads are all ReLU-zero
    scores[1, ::3] = 1.0
    scores[2] = torch.randint(0, 3, (64,)).float()
    scores[3] = torch.randint(0, 3, (64,)).float().flip(0)
    got = check(scores, 10)
    assert got[0].tolist() == list(range(10))
    assert got[1].tolist() == list(range(0, 30, 3))


def test_signed_zeros_rank_like_the_radix_kernel():
    row = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0]])
    assert indexer_topk(row, 2, backend="torch").tolist() == [[1, 3]]
    assert indexer_topk(row, 3, backend="torch").tolist() == [[0, 1, 3]]
    check(row, 4)


def test_fewer_valid_keys_than_k_pads_with_minus_one():
    scores = torch.full((1, 3, 8), float("-inf"))
    scores[0, 1, :2] = torch.tensor([0.5, 2.0])
    scores[0, 2] = torch.arange(8.0)
    got = indexer_topk(scores, 4, backend="torch")
    assert got.tolist() == [[[-1] * 4, [0, 1, -1, -1], [4, 5, 6, 7]]]
    lens = torch.tensor([[8, 1, 6]])
    got = indexer_topk(scores, 4, seq_lens=lens, backend="torch")
    assert got[0, 1].tolist() == [0, -1, -1, -1] and got[0, 2].tolist() == [2, 3, 4, 5]
    # k above S_k: S_k picks at most, the rest -1.
    assert indexer_topk(scores, 11, backend="torch")[0, 2].tolist() == list(range(8)) + [-1] * 3


def test_interleaved_invalid_keys_are_skipped_not_padded():
    """-inf and NaN inside a row's valid range are skipped: the picks stay ascending and the -1
    padding comes after them."""
    row = torch.tensor([[float("-inf"), 5.0, float("nan"), 3.0, float("-inf"), 1.0]])
    assert indexer_topk(row, 4, backend="torch").tolist() == [[1, 3, 5, -1]]
    check(row, 4)


def test_nan_is_never_selected_and_inf_is():
    scores = torch.randn(3, 40)
    scores[0, 5] = float("nan")
    scores[1, :] = float("nan")
    scores[2, 7] = float("inf")
    got = check(scores, 8)
    assert not (got[0] == 5).any() and (got[1] == -1).all() and (got[2] == 7).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scores_select_like_their_float32_values(dtype):
    scores = torch.randn(5, 40).to(dtype)  # many exact ties after rounding
    scores[0, 3] = -0.0
    got = indexer_topk(scores, 7, backend="torch")
    assert torch.equal(got, indexer_topk(scores.float(), 7, backend="torch"))
    check(scores, 7)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3, 4)])
def test_any_leading_shape(lead):
    scores = torch.randn(*lead, 9)
    lens = torch.randint(0, 10, lead) if lead else None
    check(scores, 4, seq_lens=lens)


def test_deterministic_false_selects_a_valid_top_k_set():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (6, 50), generator=g).float()  # heavy ties
    scores[:, 40:] = float("-inf")
    scores[0, 10] = float("nan")
    lens = torch.tensor([50, 45, 30, 3, 0, 41])
    k = 12
    got = indexer_topk(scores, k, seq_lens=lens, deterministic=False, backend="torch")
    assert got.shape == (6, k) and got.dtype == torch.int32
    for r in range(6):
        picks = [i for i in got[r].tolist() if i != -1]
        n = int(lens[r])
        valid = [i for i in range(n) if torch.isfinite(scores[r, i])]
        assert len(picks) == len(set(picks)) == min(k, len(valid)), r
        assert got[r].tolist() == picks + [-1] * (k - len(picks)), r  # -1 after the picks
        assert set(picks) <= set(valid), r
        rest = set(valid) - set(picks)
        if picks and rest:  # no unselected valid key scores above a selected one
            assert min(scores[r, picks]) >= max(scores[r, sorted(rest)]), r


def test_row_chunks_of_the_torch_path_give_the_same_picks(monkeypatch):
    scores = torch.randn(37, 23)
    lens = torch.randint(0, 24, (37,))
    whole = indexer_topk(scores, 5, seq_lens=lens, backend="torch")
    monkeypatch.setattr(topk_module, "_TORCH_TOPK_CHUNK_BYTES", 16 * 23 * 4)  # 4-row chunks
    assert torch.equal(indexer_topk(scores, 5, seq_lens=lens, backend="torch"), whole)
    check(scores, 5, seq_lens=lens)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0), (0, 0), (3, 0, 4)])
def test_empty_inputs(shape):
    got = indexer_topk(torch.empty(shape), 3, backend="torch")
    assert got.shape == (*shape[:-1], 3) and got.dtype == torch.int32
    assert (got == -1).all()


def test_auto_on_cpu_is_the_torch_path():
    """On the CPU cuDNN cannot run: auto decides for the torch path, whose picks are the rule's."""
    scores = torch.randn(4, 30)
    scores[1, ::3] = float("-inf")
    cpu = torch.device("cpu")
    assert topk_module._resolve_topk_backend("auto", device=cpu, k=6, dtype=scores.dtype) == "torch"
    got = indexer_topk(scores, 6)
    assert got.tolist() == reference_topk_rows(scores, 6)
    with pytest.raises(RuntimeError, match="on cpu"):
        indexer_topk(scores, 6, backend="cudnn")


# --------------------------------------------------------------------------- WindowScores


def _padded(rows: int, columns: int, stride: int, lengths: torch.Tensor, seed: int):
    """Scores in rows ``stride`` floats apart of one buffer, garbage (NaN, +-inf, huge values)
    past each row's length and in the padding: DeepGEMM's uncleaned layout."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(rows * stride + 3, generator=g)
    junk = torch.tensor([float("nan"), float("inf"), 3.0e38, -float("inf")])
    buf[torch.randint(0, buf.numel(), (buf.numel() // 2,), generator=g)] = junk[
        torch.randint(0, 4, (buf.numel() // 2,), generator=g)
    ]
    scores = buf[:-3].view(rows, stride)[:, :columns]
    valid = torch.randn(rows, columns, generator=g).round_(decimals=1)  # ties likely
    keep = torch.arange(columns) < lengths.unsqueeze(1)
    scores[keep] = valid[keep]
    return scores, valid


@given(
    rows=st.integers(0, 6),
    columns=st.integers(1, 40),
    pad=st.integers(0, 9),
    k=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_window_scores_select_like_the_masked_scores(rows, columns, pad, k, seed, data):
    """Whatever lies past each row's length, the picks of WindowScores are those of the valid
    scores with seq_lens: the top-k reads the rows in place and never past a length."""
    lengths = torch.tensor(
        data.draw(st.lists(st.integers(0, columns), min_size=rows, max_size=rows)),
        dtype=torch.int32,
    )
    scores, valid = _padded(rows, columns, columns + pad, lengths, seed)
    window = WindowScores(scores, lengths)
    want = reference_topk_rows(valid, k, lengths)
    assert indexer_topk(window, k, backend="torch").reshape(-1, k).tolist() == want
    masked = window.masked()  # in place: -inf past each length, the valid scores kept
    assert masked.data_ptr() == scores.data_ptr()
    keep = torch.arange(columns) < lengths.unsqueeze(1)
    assert torch.equal(masked[keep], valid[keep]) and bool((masked[~keep] == -float("inf")).all())
    assert indexer_topk(masked, k, backend="torch").reshape(-1, k).tolist() == want


def test_window_scores_keep_their_leading_shape():
    lengths = torch.tensor([[1, 2, 3], [3, 0, 2]], dtype=torch.int32)
    scores, valid = _padded(6, 3, 8, lengths.view(-1), 0)
    window = WindowScores(scores.view(2, 3, 3), lengths)
    picks = indexer_topk(window, 2)
    assert picks.shape == (2, 3, 2)
    assert picks.reshape(-1, 2).tolist() == reference_topk_rows(valid, 2, lengths.view(-1))


def test_window_scores_refuse_what_they_cannot_describe():
    scores = torch.zeros(4, 5)
    lengths = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="scores must be a float32 tensor"):
        WindowScores(scores.double(), lengths)
    with pytest.raises(TypeError, match=r"lengths must be an int32 tensor, got torch\.int64"):
        WindowScores(scores, lengths.long())
    with pytest.raises(ValueError, match=r"lengths \(3,\) on cpu must give one length per score"):
        WindowScores(scores, lengths[:3])
    with pytest.raises(ValueError, match="unit column stride"):
        WindowScores(torch.zeros(5, 4).t(), lengths)
    with pytest.raises(ValueError, match="seq_lens: WindowScores carry each row's length"):
        indexer_topk(WindowScores(scores, lengths), 2, seq_lens=lengths)
    too_long = WindowScores(scores, torch.tensor([1, 2, 6, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"WindowScores.lengths\[2\]=6 is outside \[0, 5\]"):
        indexer_topk(too_long, 2, validate=True)
