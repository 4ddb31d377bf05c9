"""References the package is checked against: synthetic indexer inputs, an independent model of
each engine's FP8 indexer, the engines' own kernels (loaded unmodified from an ignored folder) and
the training side's operands of the same inputs. Used by the tests, the tools and the ``demo``
command; nothing here is on a training path, and importing it loads no kernel.

- :mod:`.synthetic`: structured synthetic projections (:func:`synthetic_indexer_inputs`).
- :mod:`.engine_model`: the engine's operands, scores and top-k, written from its sources.
- :mod:`.loader`: loading an engine's files unmodified, with stand-ins for its imports.
- :mod:`.engine_kernels`: the engines' own kernels and RoPE table code as oracles (vLLM's and
  LMDeploy's Triton kernels, SGLang's fused JIT CUDA), one entry point per profile.
- :mod:`.sglang_jit`: SGLang's own JIT build code, less its cache, for its CUDA kernels.
- :mod:`.sglang_unfused`: SGLang's unfused indexer path (DeepSeek-V3.2), the ``sglang-unfused``
  oracle.
- :mod:`.legacy_kernel`: vLLM 0.28's own CUDA key quantization, the ``vllm-legacy`` k oracle.
- :mod:`.legacy_q`: vLLM 0.28's own Triton query kernel, the ``vllm-legacy`` q oracle.
- :mod:`.training`: the package's operands of the same inputs (:func:`training_operands`).
- :mod:`.vllm_topk`, :mod:`.sglang_topk`, :mod:`.lmdeploy_topk`: the engines' own indexer top-k
  kernels (vLLM's ops library; SGLang's JIT top-k v2 and sgl-kernel's op; LMDeploy's TileLang and
  Triton kernels), one ``run(kernel, logits, lengths, k)`` each.
"""
