// The launch interface of the attention family: what the ATen glue (cuda/attention_cuda.cpp,
// g++) calls and cuda/attention_launch.cu (nvcc, torch-free) defines; kernels/attention.cuh's
// kernels read the params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
// Query rows per block of the split kernel: two MMA row tiles, so that the 32 rows a KV head
// serves at the common shapes (G 8 x Hq/Hkv 4) read each K/V tile once.
constexpr int kAttnRows = 32;

// Context rows per K/V tile, per head dim (64, 128, 256 or 512): 64 up to D 128, then 16 KB of K
// (and of V) per tile, 32 rows at D 256 and 16 at D 512, so that a ring of three tiles and the Q
// tile fit two blocks per SM at D 128 and one at D 256 and 512 on an H100/H200.
constexpr int attention_tile_keys(int dim) { return dim <= 128 ? 64 : 8192 / dim; }

// The split kernel's ring of K/V tiles: three (two in flight while the block uses the third)
// where the device's per-block shared memory takes them, else two (99 KB parts: sm_86/sm_89).
constexpr int kAttnMaxStages = 3;

// Dynamic shared memory of the split kernel (16-bit elements): the Q tile, then `stages` slots of
// a K and a V tile, every row padded by 16 bytes so that the 8 rows an ldmatrix phase reads fall
// on distinct banks.
constexpr size_t attention_shared_bytes(int dim, int stages) {
  return size_t{2} * (kAttnRows + 2 * stages * attention_tile_keys(dim)) * (dim + 8);
}

struct AttentionParams {
  const void* q;  // [B, G, Hq, D]
  int64_t q_stride_b, q_stride_g, q_stride_h;
  const void* k_block;  // [B, G, Hkv, D]
  const void* v_block;
  int64_t kb_stride_b, kb_stride_g, kb_stride_h;
  int64_t vb_stride_b, vb_stride_g, vb_stride_h;
  const void* k_cache;  // [N, L, Hkv, D]
  const void* v_cache;
  int64_t kc_stride_n, kc_stride_l, kc_stride_h;
  int64_t vc_stride_n, vc_stride_l, vc_stride_h;
  const int32_t* cache_seqlens;  // [B]
  const int32_t* cache_slot;     // [B] or null
  void* out;                     // [B, G, Hq, D], contiguous
  float* lse;                    // [B, G, Hq] or null
  bool kv_aligned;                // cache rows start 16-byte aligned: vector tile loads
  float* partial_out;            // [B, Hkv, rows, splits, D]
  float* partial_stats;          // [B, Hkv, rows, splits, 2]: running max, sum
  int batch, block, heads, kv_heads, length, num_slots;
  int window;  // -1: none
  // The softmax scale times log2(e): scores are kept in base 2 (running maxima, the partials'
  // maxima), so every weight is one exp2_ftz (common/exp2.h).
  float scale_log2;
  int splits, split_length;  // context rows per split, a multiple of tile_keys
  int tile_keys;             // attention_tile_keys(D)
  int stages;                // K/V tiles in the split kernel's ring: attention_stages()
};

struct AppendParams {
  void* k_cache;
  void* v_cache;
  int64_t kc_stride_n, kc_stride_l, kc_stride_h;
  int64_t vc_stride_n, vc_stride_l, vc_stride_h;
  const void* k_new;
  const void* v_new;
  int64_t kn_stride_b, kn_stride_r, kn_stride_h;
  int64_t vn_stride_b, vn_stride_r, vn_stride_h;
  const int32_t* num_new;
  int32_t* cache_seqlens;
  const int32_t* cache_slot;
  int batch, rows, kv_heads, dim, length, num_slots;
};

// Resident blocks per SM of the split kernel for this element type (kElementBFloat16 or
// kElementHalf, common/element_type.h) and head dim (64, 128, 256 or 512) on `device`, with the
// ring of attention_stages(): a host query, once per instantiation and device; the split plan aims
// at one full wave.
int attention_blocks_per_sm(int element_type, int dim, int device);

// K/V tiles in the split kernel's ring on `device` (kAttnMaxStages, or 2 where its shared memory
// per block does not take three) for this head dim: a host query, once per head dim and device.
int attention_stages(int dim, int device);

// The split and merge kernels of block_draft_attention (element type and head dim as above).
cudaError_t launch_block_attention(int element_type, int dim, const AttentionParams& p,
                                   cudaStream_t stream);

// append_context_kv_kernel, one block per request, for cache elements of `element_bytes` (2 or 4).
cudaError_t launch_append_context_kv(int element_bytes, const AppendParams& p,
                                     cudaStream_t stream);

}  // namespace dspark_ops::kernels
