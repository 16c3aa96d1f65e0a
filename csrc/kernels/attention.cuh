// CUDA kernels of the attention family (SPEC §3.5), torch-free.
//
// block_draft_attention is decode-shaped: G slots x Hq/Hkv query heads per KV head against a long
// context, so it is bound by reading K/V, and split-KV (flash-decoding) keeps the GPU full when
// B * Hkv is small:
//  1. block_attention_split_kernel, grid (splits, Hkv * row groups, B), 128 threads: the block's
//     up to 16 query rows sharing one KV head (of the G * Hq/Hkv that do) are held in shared memory
//     as float32, and every K/V tile of 32 context rows is read once (from the request's cache row,
//     in place) and used by all of them; float32 online softmax; each split writes its unnormalised
//     output with its running max and sum.
//  2. block_attention_merge_kernel, one warp per output row: scores of the row against the G
//     block keys (the block's K/V are read here and nowhere else, never written), then the splits
//     and the block keys are merged by their maxima into the output and the log-sum-exp.
// Scores and sums use CUDA-core FMAs in float32 (explicit fmaf: the build turns off contraction
// for the exactness of the sampling kernels); tensor-core MMA is the next step (the products are
// G * Hq/Hkv rows deep, enough to make them pay).
//
// append_context_kv: one block per request copies its kept rows element by element and then
// advances cache_seqlens; rows that would land at or past L are never written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

constexpr int kAttnThreads = 128;
constexpr int kAttnRows = 16;  // query rows per block of the split kernel
constexpr int kAttnKeys = 32;  // context rows per K/V tile

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
  float* partial_out;            // [B, Hkv, rows, splits, D]
  float* partial_stats;          // [B, Hkv, rows, splits, 2]: running max, sum
  int batch, block, heads, kv_heads, length, num_slots;
  int window;  // -1: none
  float scale;
  int splits, split_length;  // context rows per split, a multiple of kAttnKeys
};

__device__ __forceinline__ float attn_load(const float* p) { return *p; }
__device__ __forceinline__ float attn_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float attn_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void attn_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void attn_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void attn_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Cache row and visible context [begin, end) of request b. Values are not trusted: a slot
// outside [0, N) sees no context rather than being used as an address.
__device__ __forceinline__ int context_range(const AttentionParams& p, int b, int& begin, int& end) {
  const int slot = p.cache_slot ? p.cache_slot[b] : b;
  const bool slot_ok = slot >= 0 && slot < p.num_slots;
  end = slot_ok ? min(max(p.cache_seqlens[b], 0), p.length) : 0;
  begin = p.window >= 0 ? max(0, end - p.window) : 0;
  return slot_ok ? slot : 0;
}

__device__ __forceinline__ int64_t partial_index(const AttentionParams& p, int b, int h, int row,
                                                 int split) {
  const int rows = p.block * (p.heads / p.kv_heads);
  return ((int64_t{b} * p.kv_heads + h) * rows + row) * p.splits + split;
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) block_attention_split_kernel(const AttentionParams p) {
  extern __shared__ float smem[];
  // Padded rows keep the lanes of a warp on distinct banks: q rows (read 16 bytes at a time by 4
  // rows per warp) by 4 floats, K/V rows (read one float at a time by 8 keys) by 1.
  constexpr int kQStride = D + 4;
  float* q_tile = smem;                              // [kAttnRows][D + 4]
  float* kv_tile = q_tile + kAttnRows * kQStride;    // [kAttnKeys][D + 1]
  float* probs = kv_tile + kAttnKeys * (D + 1);   // [kAttnRows][kAttnKeys]
  constexpr int kCols = D / 8;                    // accumulators per thread

  const int split = blockIdx.x, b = blockIdx.z;
  const int ratio = p.heads / p.kv_heads, rows = p.block * ratio;
  const int groups = (rows + kAttnRows - 1) / kAttnRows;
  const int h = blockIdx.y / groups, row0 = (blockIdx.y % groups) * kAttnRows;
  const int tid = threadIdx.x, my_row = tid / 8, lane8 = tid % 8;
  int begin, end;
  const int slot = context_range(p, b, begin, end);
  const int lo = begin + split * p.split_length, hi = min(end, lo + p.split_length);

  // Query rows g * ratio + i (head h * ratio + i of slot g), pre-scaled; missing rows are 0.
  for (int idx = tid; idx < kAttnRows * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D, row = row0 + r;
    float v = 0.f;
    if (row < rows) {
      const int g = row / ratio, head = h * ratio + row % ratio;
      v = attn_load(static_cast<const T*>(p.q) + b * p.q_stride_b + g * p.q_stride_g +
                    head * p.q_stride_h + d) * p.scale;
    }
    q_tile[r * kQStride + d] = v;
  }

  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.f;
  float row_max = -INFINITY, row_sum = 0.f;
  const T* k_base = static_cast<const T*>(p.k_cache) + slot * p.kc_stride_n + h * p.kc_stride_h;
  const T* v_base = static_cast<const T*>(p.v_cache) + slot * p.vc_stride_n + h * p.vc_stride_h;

  for (int k0 = lo; k0 < hi; k0 += kAttnKeys) {
    __syncthreads();  // the previous tile's values are no longer read
    for (int idx = tid; idx < kAttnKeys * D; idx += kAttnThreads) {
      const int k = idx / D, d = idx % D, pos = k0 + k;
      kv_tile[k * (D + 1) + d] = pos < hi ? attn_load(k_base + pos * p.kc_stride_l + d) : 0.f;
    }
    __syncthreads();
    // Thread (row, lane8) scores keys lane8, lane8 + 8, lane8 + 16, lane8 + 24.
    float s[4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = lane8 + 8 * i;
      float dot = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        dot = fmaf(q_tile[my_row * kQStride + d], kv_tile[k * (D + 1) + d], dot);
      }
      s[i] = k0 + k < hi ? dot : -INFINITY;
      tile_max = fmaxf(tile_max, s[i]);
    }
#pragma unroll
    for (int offset = 1; offset < 8; offset <<= 1) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
    }
    const float new_max = fmaxf(row_max, tile_max);  // finite: the tile has a valid key
    const float rescale = expf(row_max - new_max);  // 0 on the first tile
    float tile_sum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float e = expf(s[i] - new_max);
      probs[my_row * kAttnKeys + lane8 + 8 * i] = e;
      tile_sum += e;
    }
#pragma unroll
    for (int offset = 1; offset < 8; offset <<= 1) {
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, offset);
    }
    row_sum = row_sum * rescale + tile_sum;
    row_max = new_max;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] *= rescale;
    __syncthreads();  // scores done with the keys
    for (int idx = tid; idx < kAttnKeys * D; idx += kAttnThreads) {
      const int k = idx / D, d = idx % D, pos = k0 + k;
      kv_tile[k * (D + 1) + d] = pos < hi ? attn_load(v_base + pos * p.vc_stride_l + d) : 0.f;
    }
    __syncthreads();
    for (int k = 0; k < kAttnKeys; ++k) {
      const float prob = probs[my_row * kAttnKeys + k];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        acc[c] = fmaf(prob, kv_tile[k * (D + 1) + lane8 + 8 * c], acc[c]);
      }
    }
  }

  const int row = row0 + my_row;
  if (row < rows) {
    const int64_t at = partial_index(p, b, h, row, split);
#pragma unroll
    for (int c = 0; c < kCols; ++c) p.partial_out[at * D + lane8 + 8 * c] = acc[c];
    if (lane8 == 0) {
      p.partial_stats[at * 2] = row_max;
      p.partial_stats[at * 2 + 1] = row_sum;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) block_attention_merge_kernel(const AttentionParams p) {
  constexpr int kPerLane = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t out_row = int64_t{blockIdx.x} * (kAttnThreads / 32) + warp;  // (b, g, head)
  if (out_row >= int64_t{p.batch} * p.block * p.heads) return;
  const int head = static_cast<int>(out_row % p.heads);
  const int g = static_cast<int>((out_row / p.heads) % p.block);
  const int b = static_cast<int>(out_row / (int64_t{p.heads} * p.block));
  const int ratio = p.heads / p.kv_heads, h = head / ratio;
  const int row = g * ratio + head % ratio;

  float q[kPerLane], acc[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    q[c] = attn_load(static_cast<const T*>(p.q) + b * p.q_stride_b + g * p.q_stride_g +
                     head * p.q_stride_h + lane + 32 * c) * p.scale;
    acc[c] = 0.f;
  }
  // Running max over the splits and the block keys, with the sum and output rescaled to it.
  float row_max = -INFINITY, row_sum = 0.f;
  const auto fold = [&](float m, float l, const float* o_part, const T* v_row) {
    if (m == -INFINITY) return;  // an empty split
    const float new_max = fmaxf(row_max, m);
    const float old_scale = expf(row_max - new_max), new_scale = expf(m - new_max);
    row_sum = row_sum * old_scale + l * new_scale;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const float part = o_part ? o_part[lane + 32 * c] : attn_load(v_row + lane + 32 * c);
      acc[c] = acc[c] * old_scale + part * new_scale;
    }
    row_max = new_max;
  };
  for (int split = 0; split < p.splits; ++split) {
    const int64_t at = partial_index(p, b, h, row, split);
    fold(p.partial_stats[at * 2], p.partial_stats[at * 2 + 1], p.partial_out + at * D, nullptr);
  }
  for (int n = 0; n < p.block; ++n) {
    const T* k_row = static_cast<const T*>(p.k_block) + b * p.kb_stride_b + n * p.kb_stride_g +
                     h * p.kb_stride_h;
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) dot += q[c] * attn_load(k_row + lane + 32 * c);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const T* v_row = static_cast<const T*>(p.v_block) + b * p.vb_stride_b + n * p.vb_stride_g +
                     h * p.vb_stride_h;
    fold(dot, 1.f, nullptr, v_row);
  }
  T* out = static_cast<T*>(p.out) + out_row * D;
  const float inv = 1.f / row_sum;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) attn_store(out + lane + 32 * c, acc[c] * inv);
  if (p.lse && lane == 0) p.lse[out_row] = row_max + logf(row_sum);
}

template <typename T, int D>
size_t split_shared_bytes() {
  return sizeof(float) * (kAttnRows * (D + 4) + kAttnKeys * (D + 1) + kAttnRows * kAttnKeys);
}

template <typename T, int D>
cudaError_t launch_block_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.block == 0 || p.heads == 0) return cudaSuccess;
  const size_t shared = split_shared_bytes<T, D>();
  // D = 256 needs more than the default 48 KB; the opt-in is per device, so it is set every time.
  const cudaError_t opted_in = cudaFuncSetAttribute(block_attention_split_kernel<T, D>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(shared));
  if (opted_in != cudaSuccess) return opted_in;
  const int rows = p.block * (p.heads / p.kv_heads);
  const int groups = (rows + kAttnRows - 1) / kAttnRows;
  block_attention_split_kernel<T, D>
      <<<dim3(p.splits, p.kv_heads * groups, p.batch), kAttnThreads, shared, stream>>>(p);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const int64_t out_rows = int64_t{p.batch} * p.block * p.heads;
  const int warps = kAttnThreads / 32;
  block_attention_merge_kernel<T, D>
      <<<static_cast<unsigned>((out_rows + warps - 1) / warps), kAttnThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// append_context_kv: block b copies rows [0, kept) of k_new[b] / v_new[b] to its cache row, then
// thread 0 advances cache_seqlens[b]. Unit is an unsigned type of the element's size.
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

template <typename Unit>
__global__ void __launch_bounds__(kAttnThreads) append_context_kv_kernel(const AppendParams p) {
  const int b = blockIdx.x;
  const int64_t slot = p.cache_slot ? p.cache_slot[b] : b;
  const bool slot_ok = slot >= 0 && slot < p.num_slots;  // never an address outside the cache
  const int start = min(max(p.cache_seqlens[b], 0), p.length);
  const int count = max(p.num_new[b], 0);
  // Rows at or past L are dropped.
  const int kept = slot_ok ? min(min(count, p.rows), p.length - start) : 0;
  auto* kc = static_cast<Unit*>(p.k_cache);
  auto* vc = static_cast<Unit*>(p.v_cache);
  const auto* kn = static_cast<const Unit*>(p.k_new);
  const auto* vn = static_cast<const Unit*>(p.v_new);
  for (int64_t idx = threadIdx.x; idx < int64_t{kept} * p.kv_heads * p.dim; idx += blockDim.x) {
    const int d = static_cast<int>(idx % p.dim);
    const int64_t rh = idx / p.dim;
    const int64_t r = rh / p.kv_heads, h = rh % p.kv_heads, pos = start + r;
    kc[slot * p.kc_stride_n + pos * p.kc_stride_l + h * p.kc_stride_h + d] =
        kn[b * p.kn_stride_b + r * p.kn_stride_r + h * p.kn_stride_h + d];
    vc[slot * p.vc_stride_n + pos * p.vc_stride_l + h * p.vc_stride_h + d] =
        vn[b * p.vn_stride_b + r * p.vn_stride_r + h * p.vn_stride_h + d];
  }
  __syncthreads();  // every thread has read cache_seqlens[b] before it changes
  if (threadIdx.x == 0) p.cache_seqlens[b] = start + min(count, p.length - start);  // no overflow
}

template <typename Unit>
cudaError_t launch_append_context_kv(const AppendParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  append_context_kv_kernel<Unit><<<p.batch, kAttnThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
