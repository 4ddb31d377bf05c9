"""References the package is checked against: synthetic indexer inputs, an independent model of
each engine's FP8 indexer, the engines' own kernels (loaded unmodified from an ignored folder) and
the training side's operands of the same inputs. Used by the tests, the tools and the ``demo``
command; nothing here is on a training path, and importing it loads no kernel.

- :mod:`.synthetic`: structured synthetic projections (:func:`synthetic_indexer_inputs`).
- :mod:`.engine_model`: the engine's operands, scores and top-k, written from its sources.
- :mod:`.engine_kernels`: vLLM's and LMDeploy's own Triton kernels as oracles.
- :mod:`.legacy_kernel`: vLLM 0.28's own CUDA key quantization, the ``vllm-legacy`` k oracle.
- :mod:`.training`: the package's operands of the same inputs (:func:`training_operands`).
"""
