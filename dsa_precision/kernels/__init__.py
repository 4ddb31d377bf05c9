"""Triton kernels. Importing this package imports nothing; each kernel module imports Triton.

``preprocess_quantize``: the indexer's RoPE -> (Hadamard) -> E4M3/UE8M0 quantization (and the
key LayerNorm of the ``rope_fp32`` path) in one pass, bit-identical to the torch reference.
Use it through :func:`dsa_precision.prepare_indexer_operands` and
:func:`dsa_precision.prepare_scoring_operands`, which decide when it applies.

``topk_picks``: the cuDNN top-k's ``-inf`` / NaN picks set to ``-1`` in one pass
(:func:`dsa_precision.indexer_topk` calls it).
"""
