// Registers vLLM 0.28.0's own host launcher of the DSA indexer key quantization,
// `indexer_k_quant_and_cache` (csrc/libtorch_stable/cache_kernels.cu, compiled unmodified beside
// this file by build.py), as torch.ops.dsa_vllm_legacy.indexer_k_quant_and_cache, with vLLM's
// own schema (csrc/libtorch_stable/torch_bindings.cpp:986-988) through the same stable-ABI
// registration vLLM uses. The fifth argument is what vLLM passes: the scale format ("ue8m0").
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <string>

// vLLM's declaration (csrc/libtorch_stable/ops.h:672-677).
void indexer_k_quant_and_cache(torch::stable::Tensor& k, torch::stable::Tensor& kv_cache,
                               torch::stable::Tensor& slot_mapping, int64_t quant_block_size,
                               const std::string& scale_fmt);

STABLE_TORCH_LIBRARY(dsa_vllm_legacy, ops) {
  ops.def(
      "indexer_k_quant_and_cache(Tensor k, Tensor! kv_cache, Tensor slot_mapping, "
      "int quant_block_size, str kv_cache_dtype) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(dsa_vllm_legacy, CUDA, ops) {
  ops.impl("indexer_k_quant_and_cache", TORCH_BOX(&indexer_k_quant_and_cache));
}
