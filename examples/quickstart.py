"""Score one random indexer batch under BF16 and FP8, select top-k, print the agreement.

Runs on the CPU (torch reference backend) in a few seconds:  python examples/quickstart.py
"""

import torch

from dsa_precision import indexer_scores, indexer_topk, topk_agreement

torch.manual_seed(0)
b, s, h, d, k = 1, 1024, 32, 128, 256
q = torch.randn(b, s, h, d)  # FP32 carriers, as the rope_fp32 preprocessing leaves them
keys = torch.randn(b, s, d)
weights = (torch.randn(b, s, h) * h**-0.5 * d**-0.5).to(torch.bfloat16)

picks = {}
for precision in ("bf16", "fp8"):
    scores = indexer_scores(q, keys, weights, scoring_precision=precision, backend="torch")
    picks[precision] = indexer_topk(scores, k)

a = topk_agreement(picks["bf16"], picks["fp8"]).as_dict()
print(f"BF16 vs FP8 scoring, {s} queries, top-{k}:")
print(
    f"  member agreement {a['member_agreement']:.4%}, rows identical {a['rows_identical']:.2%}, "
    f"flipped picks per row {a['flipped_mean']:.2f} (max {a['flipped_max']})"
)
