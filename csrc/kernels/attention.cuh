// CUDA kernels of the attention family (docs/semantics.md §3.5), torch-free.
//
// block_draft_attention is decode-shaped: G slots x Hq/Hkv query heads per KV head against a long
// context, so it is bound by reading K/V, and split-KV (flash-decoding) keeps the GPU full when
// B * Hkv is small:
//  1. block_attention_split_kernel, grid (key splits, Hkv * row groups, B), 4 warps: the block's
//     up to 16 query rows sharing one KV head (of the G * Hq/Hkv that do) are one MMA row tile in
//     shared memory, and every K/V tile of 64 context rows is read once (16-byte loads from the
//     request's cache row, in place) and used by all of them. Each warp takes 16 keys of the tile:
//     S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, 16-bit in, float32 accumulators;
//     S's accumulators are P's A fragment, as in FlashAttention-2), a float32 online softmax (in
//     base 2) in registers; the four warps' results are merged in shared memory into the split's
//     unnormalised partial (output, running max, sum).
//  2. block_attention_merge_kernel, one warp per output row: scores of the row against the G
//     block keys (the block's K/V are read here and nowhere else, never written), then the splits
//     and the block keys are merged into the output and the log-sum-exp against one maximum over
//     all of them (no serial rescaling: the splits' loads are independent).
// P enters the second MMA rounded to the input type (float32 sums, as FlashAttention-2). The
// merge's scores use CUDA-core FMAs (G rows per output row). The K/V tiles are copied by cp.async
// (async_copy.cuh: no registers hold them in flight, so a thread has D / 16 16-byte copies of a
// tile outstanding at once), one tensor's tile in flight while the other is used: V's during
// S = Q K^T, the next K's during O += P V. Not yet done: 32 query rows per block (a K/V tile is
// read once per 16 rows) and ldmatrix for the fragment reads.
//
// append_context_kv: one block per request copies its kept rows in 16-byte chunks where both ends
// are aligned (unit by unit otherwise, and for a row's tail), all of a thread's loads in flight
// before its stores, and then advances cache_seqlens; rows that would land at or past L are never
// written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/exp2.h"
#include "async_copy.cuh"
#include "convert.cuh"
#include "mma.cuh"
#include "attention_launch.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

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

template <typename T>
__device__ __forceinline__ uint32_t attn_word(const T* p) {  // two consecutive 16-bit values
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint16_t attn_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint16_t attn_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

template <typename T>  // the lower-index element in the low half, as the MMA reads a pair
__device__ __forceinline__ uint32_t attn_pack(T lo, T hi) {
  return static_cast<uint32_t>(attn_bits(lo)) | (static_cast<uint32_t>(attn_bits(hi)) << 16);
}

// Issues the copies of one K or V tile (kAttnKeys context rows of D from row k0) to shared memory
// as one copy group. Rows at or past `hi` are zero-filled (masked keys' V rows must be finite:
// 0 x NaN would poison O), their source address kept on row k0. Aligned rows go by cp.async, 16
// bytes a copy, all of a thread's in flight with no registers to hold them; unaligned rows by
// element loads, kBatch chunks in flight per thread, stored to the tile at once.
template <typename T, int D>
__device__ __forceinline__ void fetch_kv_tile(const T* base, int64_t row_stride, int k0, int hi,
                                              bool aligned, T* tile, int stride) {
  constexpr int kChunks = D / 8;                                // 16-byte chunks per row
  constexpr int kCount = kAttnKeys * kChunks / kAttnThreads;    // per thread: D / 16
  static_assert(kAttnThreads % kChunks == 0, "a thread's chunks share a column");
  constexpr int kStep = kAttnThreads / kChunks;                 // rows between them
  // Chunk i of this thread: row key0 + i * kStep, column c; one source pointer stepped along
  // (addresses computed as they are issued, not all held in registers).
  const int c = threadIdx.x % kChunks, key0 = threadIdx.x / kChunks;
  const T* first_row = base + int64_t{k0} * row_stride + 8 * c;
  const T* src = first_row + int64_t{key0} * row_stride;
  const int64_t src_step = int64_t{kStep} * row_stride;
  T* dst = tile + key0 * stride + 8 * c;
  if (aligned) {
#pragma unroll
    for (int i = 0; i < kCount; ++i, src += src_step, dst += kStep * stride) {
      const bool valid = k0 + key0 + i * kStep < hi;
      copy_async_16(dst, valid ? src : first_row, valid);
    }
  } else {
    constexpr int kBatch = 4;
    static_assert(kCount % kBatch == 0, "whole batches");
#pragma unroll
    for (int first = 0; first < kCount; first += kBatch) {
      uint4 chunk[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const bool valid = k0 + key0 + (first + i) * kStep < hi;
        const T* at = src + (first + i) * src_step;
        T* e = reinterpret_cast<T*>(&chunk[i]);
#pragma unroll
        for (int k = 0; k < 8; ++k) e[k] = valid ? at[k] : from_float<T>(0.f);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        *reinterpret_cast<uint4*>(dst + (first + i) * kStep * stride) = chunk[i];
      }
    }
  }
  copy_async_commit();
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) block_attention_split_kernel(const AttentionParams p) {
  DSPARK_EXTERN_SHARED(unsigned char, attn_smem);
  // 16 extra bytes per row put the 8 rows a fragment read touches on distinct banks.
  constexpr int kStride = D + 8;
  T* q_tile = reinterpret_cast<T*>(attn_smem);  // [kAttnRows][kStride]
  T* k_tile = q_tile + kAttnRows * kStride;     // [kAttnKeys][kStride]
  T* v_tile = k_tile + kAttnKeys * kStride;     // [kAttnKeys][kStride]

  const int split = blockIdx.x, b = blockIdx.z;
  const int ratio = p.heads / p.kv_heads, rows = p.block * ratio;
  const int groups = (rows + kAttnRows - 1) / kAttnRows;
  const int h = blockIdx.y / groups, row0 = (blockIdx.y % groups) * kAttnRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int begin, end;
  const int slot = context_range(p, b, begin, end);
  const int lo = begin + split * p.split_length, hi = min(end, lo + p.split_length);

  // Query rows g * ratio + i (head h * ratio + i of slot g); missing rows are 0.
  for (int idx = threadIdx.x; idx < kAttnRows * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D, row = row0 + r;
    T v = from_float<T>(0.f);
    if (row < rows) {
      const int slot_g = row / ratio, head = h * ratio + row % ratio;
      v = static_cast<const T*>(p.q)[b * p.q_stride_b + slot_g * p.q_stride_g +
                                     head * p.q_stride_h + d];
    }
    q_tile[r * kStride + d] = v;
  }

  // Warp w owns keys 16w .. 16w + 15 of every tile: its own online softmax over them (rows g and
  // g + 8 of the C fragments), written as partial warp of this split for the merge kernel.
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const T* k_base = static_cast<const T*>(p.k_cache) + slot * p.kc_stride_n + h * p.kc_stride_h;
  const T* v_base = static_cast<const T*>(p.v_cache) + slot * p.vc_stride_n + h * p.vc_stride_h;

  // One tensor's tile is always in flight while the other is used: V(k0) during S = Q K(k0)^T,
  // K(next) during O += P V(k0). The two barriers of a tile each make one tile visible and mark
  // the other consumed, so a copy never overwrites what a warp may still read.
  if (lo < hi) {
    fetch_kv_tile<T, D>(k_base, p.kc_stride_l, lo, hi, p.kv_aligned, k_tile, kStride);
    fetch_kv_tile<T, D>(v_base, p.vc_stride_l, lo, hi, p.kv_aligned, v_tile, kStride);
  }
  copy_async_wait<1>();  // this thread's K(lo) copies have landed (V(lo)'s may not)
  __syncthreads();       // every thread's, and the q tile
  for (int k0 = lo; k0 < hi; k0 += kAttnKeys) {
    const int key0 = k0 + 16 * warp, next = k0 + kAttnKeys;
    const bool active = key0 < hi;  // warp-uniform: some key of this warp is in the tile
    // P of this warp's 16 keys (rows g and g + 8), rounded to the input type for the second MMA;
    // the sums stay float32 (exact log-sum-exp; the output's weights are off by the rounding, up
    // to 2^-8 relative for bfloat16 and 2^-11 for float16).
    uint32_t pa[4] = {0u, 0u, 0u, 0u};
    float rescale[2] = {1.f, 1.f};
    if (active) {
      // S = Q K^T over this warp's 16 keys: two 16x8 tiles.
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const T* qa = q_tile + g * kStride + kk * 16 + 2 * t;
        const uint32_t a0 = attn_word(qa), a1 = attn_word(qa + 8 * kStride);
        const uint32_t a2 = attn_word(qa + 8), a3 = attn_word(qa + 8 * kStride + 8);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const T* kb = k_tile + (16 * warp + 8 * nt + g) * kStride + kk * 16 + 2 * t;
          mma_m16n8k16<T>(s[nt], a0, a1, a2, a3, attn_word(kb), attn_word(kb + 8));
        }
      }
      // Scale, mask, and the online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * nt + 2 * t + (e & 1);
          s[nt][e] = key < hi ? s[nt][e] * p.scale_log2 : -INFINITY;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nt][e]);
        }
      }
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);  // finite: a key of the warp is valid
        base[r] = new_max;
        rescale[r] = exp2_ftz(row_max[r] - new_max);  // 0 on the first tile
        row_max[r] = new_max;
      }
      T prob[2][4];
      float tile_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float weight = exp2_ftz(s[nt][e] - base[e >> 1]);
          prob[nt][e] = from_float<T>(weight);
          tile_sum[e >> 1] += weight;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 1);
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 2);
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum[r];
      }
      // The S accumulators are already P's A fragment (k = the 16 keys).
      pa[0] = attn_pack(prob[0][0], prob[0][1]), pa[1] = attn_pack(prob[0][2], prob[0][3]);
      pa[2] = attn_pack(prob[1][0], prob[1][1]), pa[3] = attn_pack(prob[1][2], prob[1][3]);
    }
    copy_async_wait<0>();  // V(k0)
    __syncthreads();       // V(k0) visible; every warp is done with K(k0)
    if (next < hi) {
      fetch_kv_tile<T, D>(k_base, p.kc_stride_l, next, hi, p.kv_aligned, k_tile, kStride);
    }
    if (active) {
      // O += P V.
      const T* vb = v_tile + (16 * warp + 2 * t) * kStride + g;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= rescale[0], o[n][1] *= rescale[0], o[n][2] *= rescale[1], o[n][3] *= rescale[1];
        const T* col = vb + 8 * n;
        const uint32_t b0 = attn_pack(col[0], col[kStride]);
        const uint32_t b1 = attn_pack(col[8 * kStride], col[9 * kStride]);
        mma_m16n8k16<T>(o[n], pa[0], pa[1], pa[2], pa[3], b0, b1);
      }
    }
    copy_async_wait<0>();  // K(next)
    __syncthreads();       // K(next) visible; every warp is done with V(k0)
    if (next < hi) {
      fetch_kv_tile<T, D>(v_base, p.vc_stride_l, next, hi, p.kv_aligned, v_tile, kStride);
    }
  }

  // Merge the four warps' partials in shared memory and write one partial per split, so the merge
  // kernel folds one partial per split, not four. (The tiles are no longer read: the loop's last
  // barrier, or the prologue's when the split has no context, ordered every read before this.)
  float* warp_out = reinterpret_cast<float*>(attn_smem);        // [kAttnWarps][kAttnRows][D]
  float* warp_max = warp_out + kAttnWarps * kAttnRows * D;      // [kAttnWarps][kAttnRows]
  float* warp_sum = warp_max + kAttnWarps * kAttnRows;          // [kAttnWarps][kAttnRows]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    float* dst = warp_out + (warp * kAttnRows + row) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
    }
    if (t == 0) {
      warp_max[warp * kAttnRows + row] = row_max[r];
      warp_sum[warp * kAttnRows + row] = row_sum[r];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kAttnRows * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D, row = row0 + r;
    if (row >= rows) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, warp_max[w * kAttnRows + r]);
    float out = 0.f, sum = 0.f;
    if (m != -INFINITY) {  // else no key of this split: (-inf, 0, 0), which the merge skips
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float scale = exp2_ftz(warp_max[w * kAttnRows + r] - m);  // 0 for an idle warp
        out = fmaf(warp_out[(w * kAttnRows + r) * D + d], scale, out);
        sum = fmaf(warp_sum[w * kAttnRows + r], scale, sum);
      }
    }
    const int64_t at = partial_index(p, b, h, row, split);
    p.partial_out[at * D + d] = out;
    if (d == 0) {
      p.partial_stats[at * 2] = m;
      p.partial_stats[at * 2 + 1] = sum;
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
    q[c] = to_float(*(static_cast<const T*>(p.q) + b * p.q_stride_b + g * p.q_stride_g +
                      head * p.q_stride_h + lane + 32 * c)) * p.scale_log2;
    acc[c] = 0.f;
  }
  // The block keys' scores (lane n keeps key n's; G <= 32), their loads independent of each other.
  float my_score = -INFINITY;
#pragma unroll 4
  for (int n = 0; n < p.block; ++n) {
    const T* k_row = static_cast<const T*>(p.k_block) + b * p.kb_stride_b + n * p.kb_stride_g +
                     h * p.kb_stride_h;
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) dot += q[c] * to_float(*(k_row + lane + 32 * c));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    my_score = lane == n ? dot : my_score;
  }
  // One maximum over the splits (lanes take splits lane, lane + 32, ...) and the block keys, so
  // every partial is scaled once and the splits' loads are all independent.
  const int64_t at0 = partial_index(p, b, h, row, 0);  // a row's splits are consecutive
  const float* stats = p.partial_stats + at0 * 2;
  float row_max = my_score;
  for (int split = lane; split < p.splits; split += 32) row_max = fmaxf(row_max, stats[2 * split]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, offset));
  }
  // finite: the block keys are always visible. An empty split is (-inf, 0, 0): weight 0.
  float row_sum = lane < p.block ? exp2_ftz(my_score - row_max) : 0.f;
  for (int split = lane; split < p.splits; split += 32) {
    row_sum += stats[2 * split + 1] * exp2_ftz(stats[2 * split] - row_max);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);
#pragma unroll 4
  for (int split = 0; split < p.splits; ++split) {
    const float scale = exp2_ftz(stats[2 * split] - row_max);
    const float* o_part = p.partial_out + (at0 + split) * D;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) acc[c] = fmaf(o_part[lane + 32 * c], scale, acc[c]);
  }
  for (int n = 0; n < p.block; ++n) {
    const float weight = exp2_ftz(__shfl_sync(0xffffffffu, my_score, n) - row_max);
    const T* v_row = static_cast<const T*>(p.v_block) + b * p.vb_stride_b + n * p.vb_stride_g +
                     h * p.vb_stride_h;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) acc[c] = fmaf(to_float(*(v_row + lane + 32 * c)), weight, acc[c]);
  }
  T* out = static_cast<T*>(p.out) + out_row * D;
  const float inv = 1.f / row_sum;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) *(out + lane + 32 * c) = from_float<T>(acc[c] * inv);
  // Back to base e: lse = (max + log2(sum)) / log2(e).
  if (p.lse && lane == 0) p.lse[out_row] = (row_max + log2f(row_sum)) / kLog2e;
}

template <typename T, int D>
size_t split_shared_bytes() {
  return sizeof(T) * (kAttnRows + 2 * kAttnKeys) * (D + 8);
}


// append_context_kv: block b copies rows [0, kept) of k_new[b] / v_new[b] to its cache row, then
// thread 0 advances cache_seqlens[b]. Unit is an unsigned type of the element's size.
constexpr int kAppendThreads = 256;

// Copies one 16-byte chunk of a row (`count` <= 16 / sizeof(Unit) units), as one vector access when
// both ends are 16-byte aligned and the chunk is whole, else unit by unit.
template <typename Unit>
struct AppendChunk {
  static constexpr int kUnits = 16 / int{sizeof(Unit)};
  uint4 data;
  __device__ __forceinline__ void load(const Unit* src, int count, bool vector) {
    if (vector && count == kUnits) {
      data = __ldg(reinterpret_cast<const uint4*>(src));
      return;
    }
    Unit e[kUnits] = {};
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      if (k < count) e[k] = src[k];
    }
    memcpy(&data, e, sizeof(data));
  }
  __device__ __forceinline__ void store(Unit* dst, int count, bool vector) const {
    if (vector && count == kUnits) {
      *reinterpret_cast<uint4*>(dst) = data;
      return;
    }
    Unit e[kUnits];
    memcpy(e, &data, sizeof(data));
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      if (k < count) dst[k] = e[k];
    }
  }
};

__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

// Block b copies its kept rows in 16-byte chunks (a row's tail and rows whose ends are not 16-byte
// aligned unit by unit), each thread issuing a batch of K and V loads before storing any.
template <typename Unit>
__global__ void __launch_bounds__(kAppendThreads) append_context_kv_kernel(const AppendParams p) {
  constexpr int kUnits = AppendChunk<Unit>::kUnits;
  constexpr int kBatch = 4;  // chunks of K and of V in flight per thread
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
  const int chunks = (p.dim + kUnits - 1) / kUnits;  // per (row, head)
  const int64_t items = int64_t{kept} * p.kv_heads * chunks;
  const bool narrow = items <= INT32_MAX;
  for (int64_t first = threadIdx.x; first < items; first += int64_t{kBatch} * blockDim.x) {
    AppendChunk<Unit> k_chunk[kBatch], v_chunk[kBatch];
    Unit* k_dst[kBatch];
    Unit* v_dst[kBatch];
    int units[kBatch];
    bool k_vector[kBatch], v_vector[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t idx = first + int64_t{i} * blockDim.x;
      units[i] = 0;
      if (idx >= items) continue;
      // 32-bit index arithmetic unless the request's rows exceed it (warp-uniform).
      int64_t rh, r, h;
      int c;
      if (narrow) {
        const uint32_t rh32 = static_cast<uint32_t>(idx) / static_cast<uint32_t>(chunks);
        c = static_cast<int>(static_cast<uint32_t>(idx) - rh32 * static_cast<uint32_t>(chunks));
        rh = rh32, r = rh32 / static_cast<uint32_t>(p.kv_heads), h = rh - r * p.kv_heads;
      } else {
        c = static_cast<int>(idx % chunks);
        rh = idx / chunks, r = rh / p.kv_heads, h = rh % p.kv_heads;
      }
      const int64_t pos = start + r;
      const int d = c * kUnits;
      units[i] = min(kUnits, p.dim - d);
      const Unit* k_src = kn + b * p.kn_stride_b + r * p.kn_stride_r + h * p.kn_stride_h;
      const Unit* v_src = vn + b * p.vn_stride_b + r * p.vn_stride_r + h * p.vn_stride_h;
      k_dst[i] = kc + slot * p.kc_stride_n + pos * p.kc_stride_l + h * p.kc_stride_h;
      v_dst[i] = vc + slot * p.vc_stride_n + pos * p.vc_stride_l + h * p.vc_stride_h;
      // Whole rows aligned (row starts and the 16-byte steps within): vector chunks.
      k_vector[i] = aligned16(k_src, k_dst[i]);
      v_vector[i] = aligned16(v_src, v_dst[i]);
      k_dst[i] += d;
      v_dst[i] += d;
      k_chunk[i].load(k_src + d, units[i], k_vector[i]);
      v_chunk[i].load(v_src + d, units[i], v_vector[i]);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (units[i] == 0) continue;
      k_chunk[i].store(k_dst[i], units[i], k_vector[i]);
      v_chunk[i].store(v_dst[i], units[i], v_vector[i]);
    }
  }
  __syncthreads();  // every thread has read cache_seqlens[b] before it changes
  if (threadIdx.x == 0) p.cache_seqlens[b] = start + min(count, p.length - start);  // no overflow
}

}  // namespace dspark_ops::kernels
