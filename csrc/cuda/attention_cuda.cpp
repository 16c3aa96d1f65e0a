// CUDA backends of the attention family (g++): the CUDA kernels' own limits, then, after the
// entries' device guard and outputs (args/attention_args.h), the split plan, workspace and launch
// (cuda/attention_launch.cu; the kernels live in kernels/attention.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../args/attention_args.h"
#include "../common/cuda_utils.h"
#include "../common/exp2.h"
#include "../kernels/attention_launch.h"

namespace dspark_ops {
namespace {

struct BlockDraftAttentionCuda : CudaBackend {
  static void check(const AttentionArgs& a) {
    TORCH_CHECK_TYPE(a.q.scalar_type() == at::kHalf || a.q.scalar_type() == at::kBFloat16,
                     "block_draft_attention(): on CUDA 'q' must have dtype Half or BFloat16, got ",
                     a.q.scalar_type());
    TORCH_CHECK_VALUE(compute_capability_major(device_index(a.q)) >= 8,
                      "block_draft_attention(): the CUDA kernel needs tensor cores of compute "
                      "capability 8.0 or newer (mma.sync m16n8k16)");
    const int64_t row_groups =
        (a.block * (a.heads / a.kv_heads) + kernels::kAttnRows - 1) / kernels::kAttnRows;
    TORCH_CHECK_VALUE(a.length <= INT32_MAX - 4096 && a.batch <= 65535 &&
                          a.kv_heads * row_groups <= 65535,
                      "block_draft_attention(): on CUDA at most 65535 requests, 65535 KV heads x "
                      "row groups of ", kernels::kAttnRows, " query rows, and 2^31 - 4096 cache "
                      "positions; got B = ",
                      a.batch, ", Hkv x row groups = ", a.kv_heads * row_groups, ", L = ",
                      a.length);
  }
  static void run(const AttentionArgs& a, AttentionResult& outputs);
};

void BlockDraftAttentionCuda::run(const AttentionArgs& a, AttentionResult& outputs) {
  auto& [out, lse] = outputs;
  // Nothing to compute (and the split plan below would divide by zero blocks).
  if (a.batch == 0 || a.block == 0 || a.heads == 0) return;

  kernels::AttentionParams p{};
  p.q = a.q.const_data_ptr();
  p.q_stride_b = a.q.stride(0), p.q_stride_g = a.q.stride(1), p.q_stride_h = a.q.stride(2);
  p.k_block = a.k_block.const_data_ptr();
  p.v_block = a.v_block.const_data_ptr();
  p.kb_stride_b = a.k_block.stride(0), p.kb_stride_g = a.k_block.stride(1);
  p.kb_stride_h = a.k_block.stride(2);
  p.vb_stride_b = a.v_block.stride(0), p.vb_stride_g = a.v_block.stride(1);
  p.vb_stride_h = a.v_block.stride(2);
  p.k_cache = a.k_cache.const_data_ptr();
  p.v_cache = a.v_cache.const_data_ptr();
  p.kc_stride_n = a.k_cache.stride(0), p.kc_stride_l = a.k_cache.stride(1);
  p.kc_stride_h = a.k_cache.stride(2);
  p.vc_stride_n = a.v_cache.stride(0), p.vc_stride_l = a.v_cache.stride(1);
  p.vc_stride_h = a.v_cache.stride(2);
  p.cache_seqlens = a.cache_seqlens.const_data_ptr<int32_t>();
  p.cache_slot = a.cache_slot.defined() ? a.cache_slot.const_data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  p.lse = a.return_lse ? lse.data_ptr<float>() : nullptr;
  p.batch = static_cast<int>(a.batch);
  p.block = static_cast<int>(a.block);
  p.heads = static_cast<int>(a.heads);
  p.kv_heads = static_cast<int>(a.kv_heads);
  p.length = static_cast<int>(a.length);
  p.num_slots = static_cast<int>(std::min<int64_t>(a.slots, INT32_MAX));
  p.window = a.window >= 0 ? static_cast<int>(std::min<int64_t>(a.window, a.length)) : -1;
  p.scale_log2 = a.scale * kLog2e;  // common/exp2.h, as softmax_weight scales 1/T

  // Split the visible context (at most L, or the window) so that the blocks fill whole waves even
  // when B * Hkv is small; each split is a whole number of the kernel's K/V tiles. A block's work is ~1/s of
  // its row group's context, so the time goes as waves(s) / s: the fewest splits within 2% of the
  // best such count (512 blocks for 396 slots is two waves of half-size work: no gain over 256,
  // where 768 blocks are two waves of one-third).
  const int64_t visible = p.window >= 0 ? p.window : a.length;
  const int64_t rows = a.block * (a.heads / a.kv_heads);
  const int64_t groups = (rows + kernels::kAttnRows - 1) / kernels::kAttnRows;
  const int64_t base_blocks = a.batch * a.kv_heads * groups;
  const int element = element_type(a.q.scalar_type()), device = device_index(a.q);
  const int64_t wanted =
      int64_t{kernels::attention_blocks_per_sm(element, static_cast<int>(a.dim), device)} *
      multiprocessor_count(device);
  const int64_t max_splits = std::min<int64_t>(std::max<int64_t>(1, (visible + 255) / 256),
                                               2 * ((wanted + base_blocks - 1) / base_blocks));
  int64_t splits = 1;
  double best_cost = static_cast<double>((base_blocks + wanted - 1) / wanted);
  for (int64_t s = 2; s <= max_splits; ++s) {
    const double cost = static_cast<double>((base_blocks * s + wanted - 1) / wanted) / s;
    if (cost < 0.98 * best_cost) splits = s, best_cost = cost;
  }
  p.tile_keys = kernels::attention_tile_keys(static_cast<int>(a.dim));
  p.stages = kernels::attention_stages(static_cast<int>(a.dim), device);
  const int64_t tile = p.tile_keys;
  // An empty visible context (window 0 or L 0) still gets one (empty) split.
  p.split_length = static_cast<int>(
      std::max<int64_t>(tile, ((visible + splits - 1) / splits + tile - 1) / tile * tile));
  p.splits = static_cast<int>(std::max<int64_t>(1, (visible + p.split_length - 1) / p.split_length));
  const int64_t element_bytes = a.k_cache.element_size();
  p.kv_aligned = reinterpret_cast<uintptr_t>(a.k_cache.const_data_ptr()) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(a.v_cache.const_data_ptr()) % 16 == 0;
  for (const auto& cache : {a.k_cache, a.v_cache}) {
    for (int dim = 0; dim < 3; ++dim) {
      p.kv_aligned = p.kv_aligned && cache.stride(dim) * element_bytes % 16 == 0;
    }
  }
  auto partial_out = at::empty({a.batch * a.kv_heads * rows * p.splits * a.dim},
                               a.q.options().dtype(at::kFloat));
  auto partial_stats = at::empty({a.batch * a.kv_heads * rows * p.splits * 2},
                                 a.q.options().dtype(at::kFloat));
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_stats = partial_stats.data_ptr<float>();

  C10_CUDA_CHECK(kernels::launch_block_attention(element, static_cast<int>(a.dim), p,
                                                 c10::cuda::getCurrentCUDAStream()));
}

struct AppendContextKvCuda : CudaBackend {
  static void check(const AppendArgs& a) {
    TORCH_CHECK_VALUE(a.k_new.size(0) <= INT32_MAX && a.k_cache.size(1) <= INT32_MAX,
                      "append_context_kv(): B and L must fit int32");
  }
  static void run(const AppendArgs& a);
};

void AppendContextKvCuda::run(const AppendArgs& a) {
  const at::Tensor &k_cache = a.k_cache, &v_cache = a.v_cache, &k_new = a.k_new,
                   &v_new = a.v_new, &cache_seqlens = a.cache_seqlens, &slots = a.cache_slot;
  const auto counts = a.num_new.contiguous();
  kernels::AppendParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.kc_stride_n = k_cache.stride(0), p.kc_stride_l = k_cache.stride(1);
  p.kc_stride_h = k_cache.stride(2);
  p.vc_stride_n = v_cache.stride(0), p.vc_stride_l = v_cache.stride(1);
  p.vc_stride_h = v_cache.stride(2);
  const auto k_rows = k_new.stride(-1) == 1 ? k_new : k_new.contiguous();
  const auto v_rows = v_new.stride(-1) == 1 ? v_new : v_new.contiguous();
  p.k_new = k_rows.const_data_ptr();
  p.v_new = v_rows.const_data_ptr();
  p.kn_stride_b = k_rows.stride(0), p.kn_stride_r = k_rows.stride(1), p.kn_stride_h = k_rows.stride(2);
  p.vn_stride_b = v_rows.stride(0), p.vn_stride_r = v_rows.stride(1), p.vn_stride_h = v_rows.stride(2);
  p.num_new = counts.const_data_ptr<int32_t>();
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.cache_slot = slots.defined() ? slots.const_data_ptr<int32_t>() : nullptr;
  p.batch = static_cast<int>(k_new.size(0));
  p.rows = static_cast<int>(k_new.size(1));
  p.kv_heads = static_cast<int>(k_cache.size(2));
  p.dim = static_cast<int>(k_cache.size(3));
  p.length = static_cast<int>(k_cache.size(1));
  p.num_slots = static_cast<int>(std::min<int64_t>(k_cache.size(0), INT32_MAX));
  C10_CUDA_CHECK(kernels::launch_append_context_kv(static_cast<int>(k_cache.element_size()), p,
                                                   c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("block_draft_attention", &ops::block_draft_attention<BlockDraftAttentionCuda>);
  m.impl("append_context_kv", &ops::append_context_kv<AppendContextKvCuda>);
}

}  // namespace dspark_ops
