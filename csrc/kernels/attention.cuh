// CUDA kernels of the attention family (docs/semantics.md §3.5), torch-free.
//
// block_draft_attention is decode-shaped: G slots x Hq/Hkv query heads per KV head against a long
// context, so it is bound by reading K/V, and split-KV (flash-decoding) keeps the GPU full when
// B * Hkv is small:
//  1. block_attention_split_kernel, grid (key splits, Hkv * row groups, B), 4 warps: the block's
//     up to 32 query rows sharing one KV head (of the G * Hq/Hkv that do; 32 at G 8 with 4 query
//     heads per KV head, so each K/V tile is read once per head) are two MMA row tiles in shared
//     memory. K/V tiles of attention_tile_keys(D) context rows (64 up to D 128, 16 KB of K above)
//     stream through a ring of kStages slots by cp.async (async_copy.cuh; 16-byte copies from the
//     request's cache row, in place, no registers holding them): kStages - 1 tiles are in flight
//     while the block uses one, and one barrier per tile both publishes a tile and frees the slot
//     the next copy refills. Warp w takes row tile w % 2 and output columns [D/2 (w / 2), + D/2):
//     S = Q K^T over all the tile's keys (both warps of a row tile compute it, so P never leaves
//     registers: S's accumulators are P's A fragment, as in FlashAttention-2), a float32 online
//     softmax (in base 2), then O += P V over its columns; mma.sync m16n8k16 (16-bit in, float32
//     accumulators) with every fragment read by ldmatrix (V's transposed). Each (row, column) of
//     the split's unnormalised partial (output, running max, sum) has one owner, written from
//     registers.
//  2. block_attention_merge_kernel, one warp per output row: scores of the row against the G
//     block keys (the block's K/V are read here and nowhere else, never written), then the splits
//     and the block keys are merged into the output and the log-sum-exp against one maximum over
//     all of them (no serial rescaling: the splits' loads are independent).
// P enters the second MMA rounded to the input type (float32 sums, as FlashAttention-2). The
// merge's scores use CUDA-core FMAs (G rows per output row). Decode kernels with grouped query
// heads packed into one MMA tile (FlashInfer, FlashAttention-3's decode path) are the model.
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

// Issues the copies of one K or V tile (kKeys context rows of D from row k0) to shared memory,
// uncommitted (the caller commits K and V of a tile as one group). Rows at or past `hi` are
// zero-filled (masked keys' V rows must be finite: 0 x NaN would poison O), their source address
// kept on row k0. Aligned rows go by cp.async, 16 bytes a copy, all of a thread's in flight with
// no registers to hold them; unaligned rows by element loads, kBatch chunks in flight per thread,
// stored to the tile at once.
template <typename T, int D, int kKeys>
__device__ __forceinline__ void fetch_kv_tile(const T* base, int64_t row_stride, int k0, int hi,
                                              bool aligned, T* tile, int stride) {
  constexpr int kChunks = D / 8;                            // 16-byte chunks per row
  constexpr int kCount = kKeys * kChunks / kAttnThreads;    // per thread
  static_assert(kAttnThreads % kChunks == 0, "a thread's chunks share a column");
  constexpr int kStep = kAttnThreads / kChunks;             // rows between them
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
}

template <typename T, int D, int kStages>
__global__ void __launch_bounds__(kAttnThreads) block_attention_split_kernel(const AttentionParams p) {
  // The layout of attention_shared_bytes (attention_launch.h).
  constexpr int kKeys = attention_tile_keys(D), kStride = D + 8, kSlot = 2 * kKeys * kStride;
  constexpr int kHalf = D / 2;  // output columns of a warp
  static_assert(kKeys % 16 == 0 && kHalf % 16 == 0, "whole MMA k-steps and ldmatrix pairs");
  static_assert(sizeof(T) == 2, "16-bit elements");
  static_assert(kStages == 2 || kStages == 3, "a ring of two or three tiles");
  DSPARK_EXTERN_SHARED(unsigned char, attn_smem);
  T* q_tile = reinterpret_cast<T*>(attn_smem);  // [kAttnRows][kStride]
  T* ring = q_tile + kAttnRows * kStride;       // [kStages][K, V][kKeys][kStride]

  const int split = blockIdx.x, b = blockIdx.z;
  const int ratio = p.heads / p.kv_heads, rows = p.block * ratio;
  const int groups = (rows + kAttnRows - 1) / kAttnRows;
  const int h = blockIdx.y / groups, row0 = (blockIdx.y % groups) * kAttnRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Warp w: the 16 query rows of row tile w % 2 against every key of a tile (the two warps of a
  // row tile compute the same S and softmax, so P never leaves registers), and output columns
  // [kHalf * (w / 2), + kHalf) of those rows.
  const int tile_row = 16 * (warp & 1), col0 = kHalf * (warp >> 1);
  const bool rows_here = row0 + tile_row < rows;  // warp-uniform: an all-padding row tile idles
  int begin, end;
  const int slot = context_range(p, b, begin, end);
  const int lo = begin + split * p.split_length, hi = min(end, lo + p.split_length);
  const T* k_base = static_cast<const T*>(p.k_cache) + slot * p.kc_stride_n + h * p.kc_stride_h;
  const T* v_base = static_cast<const T*>(p.v_cache) + slot * p.vc_stride_n + h * p.vc_stride_h;
  const auto fetch = [&](int k0, int stage) {
    T* k_tile = ring + stage * kSlot;
    fetch_kv_tile<T, D, kKeys>(k_base, p.kc_stride_l, k0, hi, p.kv_aligned, k_tile, kStride);
    fetch_kv_tile<T, D, kKeys>(v_base, p.vc_stride_l, k0, hi, p.kv_aligned,
                               k_tile + kKeys * kStride, kStride);
  };

  // The ring's first kStages - 1 tiles go out before the Q tile's loads (one copy group per tile,
  // empty past the split, so that the loop's wait counts groups uniformly).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (lo + s * kKeys < hi) fetch(lo + s * kKeys, s);
    copy_async_commit();
  }
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

  float o[kHalf / 8][4];
#pragma unroll
  for (int n = 0; n < kHalf / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Rows g and g + 8 of the warp's row tile (the C fragments' rows), in base 2.
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  // ldmatrix row addresses of this lane: A (Q) rows lane % 16, columns 8 (lane / 16); B from K
  // rows (keys) lane % 8 + 8 (lane / 16), columns 8 (lane / 8 % 2); B from V rows (keys)
  // lane % 8 + 8 (lane / 8 % 2), columns 8 (lane / 16).
  const T* q_lane = q_tile + (tile_row + (lane & 15)) * kStride + 8 * (lane >> 4);
  const int k_lane = ((lane & 7) + 8 * (lane >> 4)) * kStride + 8 * ((lane >> 3) & 1);
  const int v_lane = ((lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + col0 + 8 * (lane >> 4);

  int stage = 0;
  for (int k0 = lo; k0 < hi; k0 += kKeys) {
    // Tile k0 has landed (at most the kStages - 2 later groups are pending), and after the
    // barrier every thread's copies of it (and the Q tile) are visible and every warp is done
    // with the previous tile, whose slot the next fetch refills.
    copy_async_wait<kStages - 2>();
    __syncthreads();  // tile k0 visible, the previous tile consumed
    const int ahead = k0 + (kStages - 1) * kKeys;
    if (ahead < hi) fetch(ahead, stage == 0 ? kStages - 1 : stage - 1);
    copy_async_commit();
    if (rows_here) {
      const T* k_tile = ring + stage * kSlot;
      const T* v_tile = k_tile + kKeys * kStride;
      // S = Q K^T over the tile's keys: kKeys / 8 tiles of 16 x 8.
      float s[kKeys / 8][4];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4<false>(a, q_lane + 16 * kk);
#pragma unroll
        for (int j = 0; j < kKeys / 16; ++j) {
          uint32_t kb[4];
          ldmatrix_x4<false>(kb, k_tile + 16 * j * kStride + 16 * kk + k_lane);
          mma_m16n8k16<T>(s[2 * j], a[0], a[1], a[2], a[3], kb[0], kb[1]);
          mma_m16n8k16<T>(s[2 * j + 1], a[0], a[1], a[2], a[3], kb[2], kb[3]);
        }
      }
      // Scale, mask, and the online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * n + 2 * t + (e & 1);
          s[n][e] = key < hi ? s[n][e] * p.scale_log2 : -INFINITY;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        }
      }
      float rescale[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);  // finite: key k0 is visible
        rescale[r] = exp2_ftz(row_max[r] - new_max);            // 0 on the first tile
        row_max[r] = new_max;
      }
      // P, rounded to the input type for the second MMA; the sums stay float32 (exact
      // log-sum-exp; the output's weights are off by the rounding, up to 2^-8 relative for
      // bfloat16 and 2^-11 for float16). The S accumulators of keys 16j .. 16j + 15 are already
      // P's A fragment of k-step j.
      uint32_t pa[kKeys / 16][4];
      float tile_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kKeys / 16; ++j) {
        T prob[2][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float weight = exp2_ftz(s[2 * j + half][e] - row_max[e >> 1]);
            prob[half][e] = from_float<T>(weight);
            tile_sum[e >> 1] += weight;
          }
        }
        pa[j][0] = attn_pack(prob[0][0], prob[0][1]), pa[j][1] = attn_pack(prob[0][2], prob[0][3]);
        pa[j][2] = attn_pack(prob[1][0], prob[1][1]), pa[j][3] = attn_pack(prob[1][2], prob[1][3]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 1);
        tile_sum[r] += __shfl_xor_sync(0xffffffffu, tile_sum[r], 2);
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum[r];
      }
      // O += P V over the warp's columns.
#pragma unroll
      for (int n = 0; n < kHalf / 8; ++n) {
        o[n][0] *= rescale[0], o[n][1] *= rescale[0], o[n][2] *= rescale[1], o[n][3] *= rescale[1];
      }
#pragma unroll
      for (int j = 0; j < kKeys / 16; ++j) {
#pragma unroll
        for (int c = 0; c < kHalf / 16; ++c) {
          uint32_t vb[4];
          ldmatrix_x4<true>(vb, v_tile + 16 * j * kStride + 16 * c + v_lane);
          mma_m16n8k16<T>(o[2 * c], pa[j][0], pa[j][1], pa[j][2], pa[j][3], vb[0], vb[1]);
          mma_m16n8k16<T>(o[2 * c + 1], pa[j][0], pa[j][1], pa[j][2], pa[j][3], vb[2], vb[3]);
        }
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

  // The split's unnormalised partial straight from the fragments: every (row, column) has one
  // owner. A split without context writes (-inf, 0, 0), which the merge skips. No copy is left
  // in flight: the loop fetched only tiles it went on to wait for.
  if (!rows_here) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + tile_row + g + 8 * r;
    if (row >= rows) continue;
    const int64_t at = partial_index(p, b, h, row, split);
    float* dst = p.partial_out + at * D + col0 + 2 * t;
#pragma unroll
    for (int n = 0; n < kHalf / 8; ++n) {
      *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
    }
    if (col0 == 0 && t == 0) {
      p.partial_stats[at * 2] = row_max[r];
      p.partial_stats[at * 2 + 1] = row_sum[r];
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
