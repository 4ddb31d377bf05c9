"""The engine oracles: loaders that run vLLM's, SGLang's and LMDeploy's own code, unmodified, from
their wheels' files (the folder ``DSA_ENGINE_KERNELS`` names). Used by ``tests/``, ``tools/`` and
``examples/`` to check the package against the engines; not installed (``pip install`` ships
``dsa_precision`` only), and importing it loads no kernel.

- :mod:`.loader`: loading an engine's files unmodified, with stand-ins for its imports.
- :mod:`.engine_kernels`: the engines' own kernels and RoPE table code as oracles (vLLM's and
  LMDeploy's Triton kernels, SGLang's fused JIT CUDA), one entry point per profile.
- :mod:`.inference`: the inference side of the comparisons, the engine's own kernels on CUDA when
  they are present, else the package's model of the engine (``dsa_precision.cli.engine_model``).
- :mod:`.sglang_jit`: SGLang's own JIT build code, less its cache, for its CUDA kernels.
- :mod:`.sglang_unfused`: SGLang's unfused indexer path (DeepSeek-V3.2), the ``sglang-unfused``
  oracle.
- :mod:`.legacy_kernel`: vLLM 0.28's own CUDA key quantization, the ``vllm-legacy`` k oracle.
- :mod:`.legacy_q`: vLLM 0.28's own Triton query kernel, the ``vllm-legacy`` q oracle.
- :mod:`.legacy_key`: vLLM 0.28's key path (LayerNorm under Inductor, RoPE) in its own order.
- :mod:`.vllm_topk`, :mod:`.sglang_topk`, :mod:`.lmdeploy_topk`: the engines' own indexer top-k
  kernels (vLLM's ops library; SGLang's JIT top-k v2 and sgl-kernel's op; LMDeploy's TileLang and
  Triton kernels), one ``run(kernel, logits, lengths, k)`` each.

The synthetic inputs, the engine model and the training side's operands they compare are the
package's (``dsa_precision.cli.synthetic``, ``.engine_model``, ``.demo_operands``): the ``demo``
command runs them from a pip install.
"""
