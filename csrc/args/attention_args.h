// The device-independent front end of the attention family: argument and value checks shared by
// the CPU and CUDA kernels of block_draft_attention and append_context_kv.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace dspark_ops {

struct AttentionArgs {
  at::Tensor q, k_block, v_block;  // [B, G, Hq|Hkv, D], unit stride along D
  at::Tensor k_cache, v_cache;     // [N, L, Hkv, D], unit stride along D
  at::Tensor cache_seqlens;        // int32 [B], contiguous
  at::Tensor cache_slot;           // undefined (b), or int32 [B], contiguous
  int64_t batch = 0, block = 0, heads = 0, kv_heads = 0, dim = 0, slots = 0, length = 0;
  float scale = 0.f;
  int64_t window = -1;  // -1: no window
};

AttentionArgs check_attention_args(const at::Tensor& q, const at::Tensor& k_block,
                                   const at::Tensor& v_block, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                   const std::optional<at::Tensor>& cache_slot,
                                   std::optional<double> softmax_scale,
                                   std::optional<int64_t> window);

// out [B, G, Hq, D] in q's dtype, and lse float32 [B, G, Hq] (empty unless return_lse), on q's
// device.
std::tuple<at::Tensor, at::Tensor> allocate_attention_outputs(const AttentionArgs& args,
                                                              bool return_lse);

// Checks append_context_kv's arguments; returns cache_slot made contiguous (undefined if absent).
at::Tensor check_append_args(const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_new, const at::Tensor& v_new,
                             const at::Tensor& num_new, const at::Tensor& cache_seqlens,
                             const std::optional<at::Tensor>& cache_slot);

}  // namespace dspark_ops
