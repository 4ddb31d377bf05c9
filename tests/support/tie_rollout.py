"""``examples/logprob_mismatch.py --rollout engine-kernels --rollout-topk vllm`` on the CPU, with
stand-ins for what needs the engines' files and vLLM's CUDA kernels, and planted ties:

- the engine's logits of a layer are the package's own scores of that layer's operands (the
  precision matched bit for bit, which the GPU conformance tables establish for the real code);
- vLLM's top-k breaks ties at random (as its kernels do, run to run) and is exact elsewhere;
- tokens 0-15 have zero embeddings, so their rows in the first DSA layer have zero indexer
  weights and score exactly 0 on every key: boundary ties in every such row past the top-k.

    python -m tests.support.tie_rollout --tiny --device cpu ... (the example's flags)
"""

from __future__ import annotations

import sys

import torch

from conformance import engine_kernels, vllm_topk
from dsa_precision import indexer_scores

from .helpers import import_example

PLANTED = 16  # token ids with zero embeddings


def _scores(indexer, x, qr, *, scores="exact", **_):
    return list(indexer_scores(indexer.scoring_operands(x, qr, None), backend="torch")), (
        "stand-in: the package's own scores of the layer's operands"
    )


def _random_ties(logits: list[torch.Tensor], k: int, prompt: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for s in logits:
        noise = torch.rand(s.shape, generator=gen)
        order = noise.argsort(-1)  # a random order, then a stable sort by score
        by_score = torch.sort(s.gather(-1, order), dim=-1, descending=True, stable=True).indices
        ranked = order.gather(-1, by_score)
        visible = (s > float("-inf")).sum(-1, keepdim=True)
        out.append(torch.where(torch.arange(k) < visible, ranked[:, :k], -1).to(torch.int32))
    return out


def main(argv: list[str]) -> int:
    lm = import_example("logprob_mismatch")
    build = lm.toy.build_model

    def build_model(args, config, **kw):
        model, vocab = build(args, config, **kw)
        with torch.no_grad():
            model.embedding.word_embeddings.weight[:PLANTED] = 0
        return model, vocab

    lm.toy.build_model = build_model
    engine_kernels.engine_layer_scores = _scores
    engine_kernels.missing_reason = lambda _name: None
    vllm_topk.missing_reason = lambda: None
    vllm_topk.rollout_topk = _random_ties
    return lm.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
