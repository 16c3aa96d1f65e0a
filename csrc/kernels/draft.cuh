// CUDA kernels of the drafting family (docs/semantics.md §3.2, §3.3), torch-free.
//
// Math: kernels/draft_math.h (shared with the CPU kernel). Input contract: DraftParams and
// ConfidenceParams below; the ATen glue in cuda/draft_cuda.cu checks shapes, dtypes and devices.
// Ids are not trusted: an id outside [0, V) embeds as a zero row and is never used as an address.
//
// markov_draft: one launch of draft_slot_kernel per slot j (G launches, no host work between).
//   Grid (tiles, request groups): a block takes up to 64 requests and its warps walk 16-row tiles
//   of the vocabulary, interleaved over the grid so every block gets the same share to within one
//   tile. Its prologue gathers the group's bias inputs W1[x_j] (x_j = the anchor, or the token
//   the previous launch wrote) into shared memory, every thread's loads in flight together; per
//   tile a warp multiplies 16 rows of W2 by all of them with mma.sync m16n8k16 (bf16/fp16 in,
//   float32 accumulate; float32 weights use CUDA-core FMAs in the same register layout), so W2 is
//   read from HBM once per slot for up to 64 requests. The epilogue (base logits of the kernel's
//   Base type) adds the base logits, stores z = draft_logits (float32, or z rounded to bfloat16,
//   a runtime choice: the key is then that of the rounded value), and computes Gumbel-max keys
//   z/T - log(-log1p(-u)) with Philox uniforms (a lane computes one Philox block and a 4 x 4
//   transpose by shuffles hands each lane its words, so no block is computed twice). A token's
//   logarithms are needed only when a cheap exact bound of its key (key_bound: no logarithm)
//   reaches the best key known so far; a warp computes them only when one of its lanes needs them
//   (a warp vote), which after the first tiles is rare. Warp maxima go straight to the slot's
//   packed 64-bit maxima in global memory (atomicMax, key order then lower id; only where they can
//   still win), and each block folds the grid's maxima into its shared best keys once per tile.
//   The last block of the group to arrive (threadfence + arrival counter) writes the tokens, which
//   the next slot's launch reads, and returns the group's keys and counter to zero (they live in
//   a buffer kept per stream, not filled per call: common/stream_counters.h). A persistent kernel
//   with a grid barrier per slot would save G - 1 launch gaps (~2-4 us each) but needs
//   co-residency of the whole grid.
// rnn_draft: per slot, the head computes [g; c; o] = J [s; W1[x]; h] + b for every request:
//   rnn_head_mma_kernel for 16-bit J on tensor cores (a block per 16 rows x 8 requests, its warps
//   splitting the columns; float32 inputs enter as three 16-bit parts, so the products are those
//   of the float32 values), rnn_head_kernel for float32 J on CUDA cores (each warp 4 rows of J x 8
//   requests, each lane a pair of columns per step); then
//   draft_slot_kernel runs as above with the activation tanh(o) split into a high and a low 16-bit
//   part (two MMAs against the same W2 fragments: ~16-bit mantissa instead of 8), and its blocks
//   advance the state.
// Sampling filters (top-k / top-p / min-p): after each slot launch, draft_filter_kernel gives every
//   filtered request one block of 1024 threads that computes the filters over its stored row
//   (kernels/filter.cuh), writes -inf into draft_logits where they drop a token and redraws the
//   token over the kept ones with the same keys, before the next slot reads it. Requests without
//   filters return at once.
// draft_confidence: one warp per (request, slot) row; the block stages the weight vector in shared
//   memory as float32, each lane reads its share of [h_j; W1[x_j]] with 16-byte loads (eight in
//   flight), float32 dot product, warp reduction.
//
// Float32 accumulation in an order of the hardware's choosing (explicit fmaf: the build's
// --fmad=false only keeps the sampling arithmetic unfused), so draft_logits match the float64
// reference to ~1e-6 of the bias scale (|base| + sum |w2| |input|; ~2^-17 for the RNN head's
// split activation) and tokens match except at float-rounding near-ties. A head sum that is not
// finite or reaches kExactHeadAbove (huge finite weights) is summed again in float64 by the lane
// that stores it (exact_head_logit, exact_preactivation; draft_confidence's rows likewise): a
// branch that ordinary inputs never take.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cuda/atomic>
#include <map>
#include <type_traits>
#include <utility>
#include <mutex>

#include "../common/device_cache.h"
#include "convert.cuh"
#include "draft_math.h"
#include "filter.cuh"
#include "mma.cuh"
#include "sampling_math.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

constexpr int kDraftThreads = 256;
constexpr int kDraftWarps = kDraftThreads / 32;
constexpr int kTileRows = 16 * kDraftWarps;  // vocabulary rows per block tile: 16 per warp
constexpr int kMaxGroup = 64;                // requests per block: 8 MMA column tiles of 8
constexpr int kKChunk = 32;                  // k per fragment load (two m16n8k16 steps)
constexpr int kChunksInFlight = 4;           // W2 fragment loads issued before the first MMA
// Shared memory a slot block keeps besides its group's inputs: the static GroupSampling and the
// 1 KB the runtime reserves per block.
constexpr int kSlotSharedReserve = 5 * 1024;
// The group's inputs when the device cannot be queried: below the 48 KB that needs no opt-in.
constexpr int kFallbackInputBytes = 44 * 1024;

struct DraftParams {
  const void* w1;  // [V, r] of type W, unit stride along r
  int64_t w1_stride;
  bool w1_aligned;  // rows start 16-byte aligned: vector gathers
  const void* w2;  // [V, r] of type W, unit stride along r
  int64_t w2_stride;
  bool w2_aligned;  // rows start 16-byte aligned: vector fragment loads
  const void* base;  // [B, G, V] of the kernel's Base type, unit stride along V
  int64_t base_stride_b, base_stride_j;
  const void* anchor;  // int32 or int64 [B]
  bool anchor_int32;
  const float* temperature;
  const int64_t* seed;
  const int64_t* position;
  const int32_t* top_k;  // [B] or null (off), as the three filters
  const float* top_p;
  const float* min_p;
  int64_t* tokens;     // [B, G]
  void* draft_logits;  // [B, G, V]: float32, or bfloat16 when logits_bf16
  bool logits_bf16;    // z rounded to bfloat16 before it is stored and sampled
  // rnn_draft only.
  const void* hidden;  // [B, G, d], unit stride along d, ElementType hidden_type
  int hidden_type;
  int64_t hidden_stride_b, hidden_stride_j;
  const void* joint_weight;  // [3r, 2r + d] of type W, unit stride along columns
  int64_t joint_stride;
  const void* joint_bias;  // [3r] of type W
  float* preactivation;    // [B, 3r] workspace
  float* state;            // [B, r] workspace: s_0 = 0 is never read, so it needs no fill
  // Counters: zero when a call starts, and returned to zero by the last block of each group.
  unsigned long long* best;  // [G, B] packed candidates
  int32_t* arrivals;         // [G, groups]
  int batch, block, rank, hidden_size, group_size, num_tiles, slot;
  int64_t vocab;
};

// x_j of request b: the anchor for slot 0, else the token the previous slot's launch wrote.
__device__ __forceinline__ int64_t previous_token(const DraftParams& p, int b) {
  if (p.slot == 0) {
    return p.anchor_int32 ? static_cast<const int32_t*>(p.anchor)[b]
                          : static_cast<const int64_t*>(p.anchor)[b];
  }
  return p.tokens[int64_t{b} * p.block + p.slot - 1];
}

// Shared-memory row stride (elements) of the bias inputs: an odd multiple of 64 bytes for 16-bit
// types and 16 extra bytes for float32 keep the fragment reads of one quarter-warp on distinct
// banks.
template <typename W>
__host__ __device__ constexpr int input_stride(int padded_rank) {
  return sizeof(W) == 2 ? (padded_rank + 63) / 64 * 64 + 32 : padded_rank + 4;
}

__host__ __device__ constexpr int padded_rank(int rank) { return (rank + kKChunk - 1) / kKChunk * kKChunk; }

// Passes over W2 per tile: the RNN activation enters 16-bit MMAs as a high and a low part.
template <typename W, bool kRnn>
constexpr int input_passes() { return kRnn && sizeof(W) == 2 ? 2 : 1; }

template <typename W, bool kRnn>
__host__ int draft_shared_bytes(int group_size, int rank) {
  return input_passes<W, kRnn>() * group_size * input_stride<W>(padded_rank(rank)) * int{sizeof(W)};
}

// ------------------------------------------------------------------------------------------------
// Tensor-core fragments. Lane (g = lane / 4, t = lane % 4) of a warp owns W2 rows g and g + 8 of
// its 16-row tile and, for each k chunk of 32, the 8 consecutive k at 8t: that is one 16-byte
// load per row, feeding two m16n8k16 MMAs. The MMA's k positions {2t, 2t+1, 2t+8, 2t+9} map to
// k = 8t + {0..3} in the first MMA and 8t + {4..7} in the second; the B fragment (bias inputs of
// request g of the column tile) uses the same map, so the sum over k is unchanged.

struct Frag16 {
  uint4 row_lo, row_hi;  // rows g and g + 8: 8 values each as 4 x 32-bit pairs
};

// Eight k values of one W2 row starting at k (zero past the rank or past the vocabulary).
template <typename W>
__device__ __forceinline__ uint4 load_w2_8(const DraftParams& p, int64_t v, int k) {
  uint4 out = make_uint4(0, 0, 0, 0);
  if (v >= p.vocab || k >= p.rank) return out;
  const W* row = static_cast<const W*>(p.w2) + v * p.w2_stride;
  if (p.w2_aligned && k + 8 <= p.rank) return __ldg(reinterpret_cast<const uint4*>(row + k));
  W* e = reinterpret_cast<W*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = k + i < p.rank ? row[k + i] : from_float<W>(0.f);
  return out;
}

// acc[nt] += W2[16 rows] x inputs[column tile nt] over all k, for 16-bit weights.
template <typename W, int kPasses>
__device__ __forceinline__ void tile_products(const DraftParams& p, int64_t row0,
                                              const W* inputs, int stride, int plane,
                                              int column_tiles, float (&acc)[kMaxGroup / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = padded_rank(p.rank) / kKChunk;
  for (int c0 = 0; c0 < chunks; c0 += kChunksInFlight) {
    Frag16 a[kChunksInFlight];
#pragma unroll
    for (int i = 0; i < kChunksInFlight; ++i) {
      if (c0 + i < chunks) {
        const int k = (c0 + i) * kKChunk + 8 * t;
        a[i].row_lo = load_w2_8<W>(p, row0 + g, k);
        a[i].row_hi = load_w2_8<W>(p, row0 + g + 8, k);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunksInFlight; ++i) {
      if (c0 + i >= chunks) break;
      const int k = (c0 + i) * kKChunk + 8 * t;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
#pragma unroll
        for (int nt = 0; nt < kMaxGroup / 8; ++nt) {
          if (nt >= column_tiles) break;
          const W* in = inputs + (pass * plane + nt * 8 + g) * stride + k;
          const uint4 b = *reinterpret_cast<const uint4*>(in);
          mma_m16n8k16<W>(acc[nt], a[i].row_lo.x, a[i].row_hi.x, a[i].row_lo.y, a[i].row_hi.y,
                          b.x, b.y);
          mma_m16n8k16<W>(acc[nt], a[i].row_lo.z, a[i].row_hi.z, a[i].row_lo.w, a[i].row_hi.w,
                          b.z, b.w);
        }
      }
    }
  }
}

// The same products for float32 weights on CUDA cores, in the MMA's accumulator layout: lane
// (g, t) sums over all k for rows g, g + 8 and requests 2t, 2t + 1 of each column tile.
template <>
__device__ __forceinline__ void tile_products<float, 1>(const DraftParams& p, int64_t row0,
                                                        const float* inputs, int stride, int,
                                                        int column_tiles,
                                                        float (&acc)[kMaxGroup / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float* rows[2] = {nullptr, nullptr};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t v = row0 + g + 8 * h;
    if (v < p.vocab) rows[h] = static_cast<const float*>(p.w2) + v * p.w2_stride;
  }
  for (int k = 0; k < p.rank; k += 4) {
    float a[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows[h] && p.w2_aligned && k + 4 <= p.rank) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(rows[h] + k));
        a[h][0] = f.x, a[h][1] = f.y, a[h][2] = f.z, a[h][3] = f.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[h][e] = rows[h] && k + e < p.rank ? rows[h][k + e] : 0.f;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kMaxGroup / 8; ++nt) {
      if (nt >= column_tiles) break;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 b = *reinterpret_cast<const float4*>(inputs + (nt * 8 + 2 * t + q) * stride + k);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& c = acc[nt][2 * h + q];
          c = fmaf(a[h][0], b.x, c);
          c = fmaf(a[h][1], b.y, c);
          c = fmaf(a[h][2], b.z, c);
          c = fmaf(a[h][3], b.w, c);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Epilogue helpers.

// A lane's warp index, through a shuffle so the compiler knows it is warp-uniform (branches on it
// then keep the warp converged, and the epilogue's shuffles need no divergence handling).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0); }

__device__ __forceinline__ uint32_t select_word(const Philox4& x, int i) {
  return i == 0 ? x.x[0] : i == 1 ? x.x[1] : i == 2 ? x.x[2] : x.x[3];
}

// The key of an ordered word (pack_candidate's high half); -inf for 0, "no candidate".
__device__ __forceinline__ float ordered_key(uint32_t ordered) {
  if (ordered == 0) return -INFINITY;
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

// An upper bound of the Gumbel key zt - log(E), E = -log1p(-u), for u in [2^-33, 1), without a
// logarithm: E >= u, and log2(u) = e + log2(m) >= e + m - 1 for u = m 2^e, m in [1, 2) (log2 is
// concave), which is u's bit pattern read as an integer times 2^-23, minus 127; so
// -log(E) <= 127 ln 2 - (ln 2) 2^-23 bits(u), within 0.06 of -log(u). Its float rounding
// (< 2e-5 + 2e-7 |zt|) and the key's (logf, log1pf: < 3e-5 + 3e-7 |zt|) are far inside the
// margin of the threshold the bound is compared with (tile_epilogue).
__device__ __forceinline__ float key_bound(float zt, float u) {
  constexpr float kLn2Ulp = 0x1.62e42ep-24f;  // (ln 2) 2^-23, rounded down
  constexpr float k127Ln2 = 0x1.601e68p+6f;   // 127 ln 2, rounded up
  return fmaf(static_cast<float>(__float_as_uint(u)), -kLn2Ulp, zt + k127Ln2);
}

struct GroupSampling {
  float inv_t[kMaxGroup];
  int64_t seed[kMaxGroup];
  int64_t position[kMaxGroup];  // p0 + 1 + j
  int64_t source[kMaxGroup];    // W1 row (Markov) or request (RNN) of the bias input; -1: zero
  const void* base_row[kMaxGroup];  // base_logits[b, j] (of the kernel's Base type)
  void* out_row[kMaxGroup];         // draft_logits[b, j] (float32 or bfloat16)
  // Best key known so far per request as pack_candidate's high word (0: none): this block's own
  // and, refreshed every tile, the grid's. A token whose key is below it cannot win.
  uint32_t seen[kMaxGroup];
  bool greedy[kMaxGroup];
  bool any_sampled;
};
static_assert(sizeof(GroupSampling) + 1024 <= kSlotSharedReserve, "kSlotSharedReserve too small");

// Dynamic shared memory a slot block may take for its group's inputs on `device` (a host query,
// once per device): __launch_bounds__ lets two blocks share an SM by registers, so half the SM's
// shared memory, less kSlotSharedReserve, and no more than one block may opt in to.
__host__ inline int draft_input_budget(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [device] {
    int per_sm = 0, per_block = 0;
    if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // the query's own error
      return kFallbackInputBytes;
    }
    return std::max(kFallbackInputBytes,
                    std::min(per_sm / 2, per_block) - kSlotSharedReserve);
  });
}

// Fills the group's bias inputs (kPasses planes of [group, stride] W values) and sampling state.
// Each thread resolves one request's source first, then all loads of the rows are independent:
// one round trip for the whole gather instead of a few per request.
template <typename W, typename Base, bool kRnn>
__device__ void load_group(const DraftParams& p, int first, int members, W* inputs, int stride,
                           GroupSampling& s) {
  constexpr int kPasses = input_passes<W, kRnn>();
  constexpr int kBatch = 8;  // loads in flight per thread
  const int plane = p.group_size;
  const int width = padded_rank(p.rank);
  for (int i = threadIdx.x; i < p.group_size; i += blockDim.x) {
    const int b = first + i;
    const float temperature = i < members ? p.temperature[b] : 0.f;
    s.greedy[i] = is_greedy(temperature);
    s.inv_t[i] = s.greedy[i] ? 1.f : 1.f / temperature;
    s.seed[i] = i < members ? p.seed[b] : 0;
    s.position[i] = i < members ? offset_position(p.position[b], 1 + p.slot) : 0;
    s.seen[i] = 0;
    s.base_row[i] = i < members ? static_cast<const Base*>(p.base) + int64_t{b} * p.base_stride_b +
                                      int64_t{p.slot} * p.base_stride_j
                                : nullptr;
    s.out_row[i] = i < members ? static_cast<char*>(p.draft_logits) +
                                     (int64_t{b} * p.block + p.slot) * p.vocab *
                                         (p.logits_bf16 ? 2 : 4)
                               : nullptr;
    int64_t source = -1;
    if (i < members && kRnn) source = b;
    if (i < members && !kRnn) {
      const int64_t x = previous_token(p, b);
      if (x >= 0 && x < p.vocab) source = x;
    }
    s.source[i] = source;
  }
  __syncthreads();
  const int threads = blockDim.x;
  // 16-byte rows of W1: one vector load per 16 bytes (a chunk past the rank is partly zero).
  constexpr int kVec = 16 / int{sizeof(W)};
  if (!kRnn && p.w1_aligned) {
    const int chunks = width / kVec, items = p.group_size * chunks;
    for (int base = threadIdx.x; base < items; base += kBatch * threads) {
      uint4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / chunks, k = (idx % chunks) * kVec;
        v[j] = make_uint4(0, 0, 0, 0);
        const int64_t x = idx < items ? s.source[i] : -1;
        if (x < 0 || k >= p.rank) continue;
        const W* row = static_cast<const W*>(p.w1) + x * p.w1_stride + k;
        if (k + kVec <= p.rank) {
          v[j] = __ldg(reinterpret_cast<const uint4*>(row));
        } else {
          W* e = reinterpret_cast<W*>(&v[j]);
          for (int m = 0; m < kVec && k + m < p.rank; ++m) e[m] = row[m];
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads;
        if (idx < items) {
          *reinterpret_cast<uint4*>(inputs + (idx / chunks) * stride + (idx % chunks) * kVec) = v[j];
        }
      }
    }
  } else {
    const int items = p.group_size * width;
    for (int base = threadIdx.x; base < items; base += kBatch * threads) {
      float value[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / width, k = idx % width;
        const int64_t source = idx < items ? s.source[i] : -1;
        value[j] = 0.f;
        if (source < 0 || k >= p.rank) continue;
        if (kRnn) {
          value[j] = __ldg(p.preactivation + (source * 3 + 2) * p.rank + k);
        } else {
          value[j] = to_float(static_cast<const W*>(p.w1)[source * p.w1_stride + k]);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / width, k = idx % width;
        if (idx >= items) continue;
        const float v = kRnn ? tanhf(value[j]) : value[j];  // tanh(0) = 0 for the padding
        const W hi = from_float<W>(v);
        inputs[i * stride + k] = hi;
        if (kPasses == 2) inputs[(plane + i) * stride + k] = from_float<W>(v - to_float(hi));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool any = false;
    for (int i = 0; i < members; ++i) any = any || !s.greedy[i];
    s.any_sampled = any;
  }
  __syncthreads();
}

// A relaxed read of a shared word that other threads update atomically.
__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const volatile uint32_t*>(p);  // one LDS (an atomic_ref load is generic)
#else
  return cuda::atomic_ref<uint32_t, cuda::thread_scope_block>(*const_cast<uint32_t*>(p))
      .load(cuda::memory_order_relaxed);
#endif
}

// Float32 head sums at or above this magnitude (or not finite) are summed again in float64: an
// overflow (inf, or inf - inf = NaN) or a sum of terms too large for float32 rounding to be
// trusted, from finite weights near float32's range where the float64 z may be finite. Logits
// never come near it, so for ordinary inputs the slow path is one untaken branch per element.
constexpr float kExactHeadAbove = 1e30f;

// z = fl32(W2[v] . x + base) with the dot product in float64 for request b's bias input (the
// previous token's W1 row, or tanh(o) of the RNN head's float32 preactivation); `source` is
// s.source (-1: a zero input). The rare path of tile_epilogue: one lane, global memory only.
template <typename W, bool kRnn>
__device__ float exact_head_logit(const DraftParams& p, int64_t source, int64_t v,
                                  float base) {
  double bias = 0.0;
  if (source >= 0) {
    const W* w2 = static_cast<const W*>(p.w2) + v * p.w2_stride;
    for (int k = 0; k < p.rank; ++k) {
      const float x = kRnn ? tanhf(p.preactivation[(source * 3 + 2) * p.rank + k])
                           : to_float(static_cast<const W*>(p.w1)[source * p.w1_stride + k]);
      bias += static_cast<double>(to_float(w2[k])) * static_cast<double>(x);
    }
  }
  return static_cast<float>(bias + static_cast<double>(base));
}

// Stores z and folds the keys of one 16-row x 8-request accumulator tile into the slot's maxima
// (`best`, in global memory) and s.seen. `any_sampled` is warp-uniform.
template <typename W, typename Base, bool kRnn>
__device__ __forceinline__ void tile_epilogue(const DraftParams& p, int64_t row0, int members,
                                              int nt, const float (&c)[4], bool any_sampled,
                                              GroupSampling& s, unsigned long long* best_out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, quad = g & 3;
  // Philox: the lane at quad position m computes block m of its quad's four, m = (rows g+8?,
  // request 2t+1?); two butterfly stages transpose the quad's 4 x 4 words, so each lane ends with
  // word `quad` (its row's) of all four blocks.
  float u[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  if (any_sampled) {
    const int i_m = nt * 8 + 2 * t + (quad & 1);
    const int64_t v_m = row0 + (g & ~3) + 8 * (quad >> 1);
    const Philox4 block = philox_block(s.seed[i_m], s.position[i_m], kPurposeDraft,
                                       static_cast<uint32_t>(v_m >> 2));
    uint32_t x[4] = {block.x[0], block.x[1], block.x[2], block.x[3]};
#pragma unroll
    for (int stage = 1; stage <= 2; stage <<= 1) {
      const bool upper = (quad & stage) != 0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r & stage) continue;
        const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? x[r] : x[r | stage], stage << 2);
        x[r] = upper ? got : x[r];
        x[r | stage] = upper ? x[r | stage] : got;
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) u[m] = uniform_from_bits(x[m]);
  }
  // Per request q of the lane (2t + q): its state, and the threshold below which a key bound
  // proves a token cannot win: the best key seen so far less a margin far above the float rounding
  // of the bound and of the key (ties are kept: the lower id would win those).
  bool member[2], greedy[2];
  float inv_t[2], threshold[2];
  uint32_t seen[2];
  void* out_row[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int i = nt * 8 + 2 * t + q;
    member[q] = i < members;
    greedy[q] = s.greedy[i];
    inv_t[q] = s.inv_t[i];  // 1 when greedy: z * inv_t = z
    seen[q] = load_relaxed(&s.seen[i]);
    const float seen_key = ordered_key(seen[q]);
    // -inf while none is known; +inf when a key overflowed (only +inf keys can win, by their id).
    threshold[q] = seen_key == INFINITY ? INFINITY : seen_key - 1e-4f * (1.f + fabsf(seen_key));
    out_row[q] = s.out_row[i];
  }
  // The four base logits first, so their loads are in flight together.
  float base[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int h = e >> 1, q = e & 1;
    const int64_t v = row0 + g + 8 * h;
    const Base* row = static_cast<const Base*>(s.base_row[nt * 8 + 2 * t + q]);
    base[e] = member[q] && v < p.vocab ? to_float(__ldg(row + v)) : 0.f;
  }
  float key[4];
  bool needs_log[4];
  // The stored type is chosen once per call (a uniform branch around the loop, not per element).
  const auto store_and_bound = [&](auto bf16) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1, q = e & 1;  // c[e]: row g + 8h, request 2t + q; u[e] is its uniform
      const int64_t v = row0 + g + 8 * h;
      const bool valid = member[q] && v < p.vocab;
      // bfloat16 logits: z is rounded first, and the key below is that of the stored value.
      float z = c[e] + base[e];
      if (!(fabsf(c[e]) < kExactHeadAbove) && valid) {
        z = exact_head_logit<W, kRnn>(p, s.source[nt * 8 + 2 * t + q], v, base[e]);
      }
      if constexpr (decltype(bf16)::value) {
        const __nv_bfloat16 rounded = __float2bfloat16_rn(z);
        z = __bfloat162float(rounded);
        if (valid) static_cast<__nv_bfloat16*>(out_row[q])[v] = rounded;
      } else if (valid) {
        static_cast<float*>(out_row[q])[v] = z;
      }
      const bool finite = valid && isfinite(z);
      const float zt = z * inv_t[q];
      const bool may_win = key_bound(zt, u[e]) >= threshold[q];
      needs_log[e] = finite && !greedy[q] && may_win;
      key[e] = finite && (greedy[q] || may_win) ? zt : -INFINITY;
    }
  };
  if (p.logits_bf16) {
    store_and_bound(std::true_type{});
  } else {
    store_and_bound(std::false_type{});
  }
  // The logarithms only when some lane needs them: once the best keys are established, most warps
  // skip them as a whole.
  if (__any_sync(0xffffffffu, needs_log[0] || needs_log[1] || needs_log[2] || needs_log[3])) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (needs_log[e]) key[e] = key[e] - logf(-log1pf(-u[e]));
    }
  }
  // Per request: the lane's better row (row g wins ties: the lower id), a candidate where it can
  // still win against the best key seen ("-inf": none, z / T overflowing; keys are never NaN).
  float best_key[2];
  int32_t best_id[2];
  bool can_win[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const bool upper_row = key[2 + q] > key[q];
    best_key[q] = upper_row ? key[2 + q] : key[q];
    best_id[q] = static_cast<int32_t>(row0 + g + (upper_row ? 8 : 0));
    can_win[q] = best_key[q] > -INFINITY && best_key[q] >= ordered_key(seen[q]);
  }
  // Once the best keys are established almost no warp has such a candidate: it skips the
  // reductions. Else over the 8 lanes of each t (rows) in two 32-bit steps: the largest key, then
  // the lowest id (largest low word) among the lanes holding it; lanes 0..3 publish requests
  // 2t, 2t + 1.
  if (!__any_sync(0xffffffffu, can_win[0] || can_win[1])) return;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const unsigned long long packed = can_win[q] ? pack_candidate(best_key[q], best_id[q]) : 0ull;
    uint32_t hi = static_cast<uint32_t>(packed >> 32);
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, mask));
    uint32_t lo = static_cast<uint32_t>(packed >> 32) == hi ? static_cast<uint32_t>(packed) : 0u;
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) lo = max(lo, __shfl_xor_sync(0xffffffffu, lo, mask));
    const int i = nt * 8 + 2 * t + q;
    if (g == 0 && member[q] && hi != 0) {
      atomicMax(best_out + i, (static_cast<unsigned long long>(hi) << 32) | lo);
      atomicMax(&s.seen[i], hi);
    }
  }
}

// One slot of the block walk (see the file header).
template <typename W, typename Base, bool kRnn>
__global__ void __launch_bounds__(kDraftThreads, 2) draft_slot_kernel(const DraftParams p) {
  constexpr int kPasses = input_passes<W, kRnn>();
  DSPARK_EXTERN_SHARED(unsigned char, shared_raw);
  W* inputs = reinterpret_cast<W*>(shared_raw);
  __shared__ GroupSampling s;
  __shared__ bool last;
  const int group = blockIdx.y;
  const int first = group * p.group_size;
  const int members = min(p.group_size, p.batch - first);
  const int stride = input_stride<W>(padded_rank(p.rank));
  load_group<W, Base, kRnn>(p, first, members, inputs, stride, s);
  const bool any_sampled = __any_sync(0xffffffffu, s.any_sampled);  // warp-uniform to the compiler
  unsigned long long* best = p.best + int64_t{p.slot} * p.batch;

  const int column_tiles = (members + 7) / 8;
  const int warp = warp_index();
  // Warp w of block x takes the 16-row warp tiles w * gridDim.x + x, x + (w + 8) * gridDim.x, ...:
  // the leftover of the last round falls on the low warps of every block, not on whole blocks, so
  // every block holds its share of the vocabulary to within a warp tile and the SMs finish
  // together whichever blocks the hardware pairs on one.
  const int64_t warp_tiles = (p.vocab + 15) / 16;
  for (int64_t tile = int64_t{warp} * gridDim.x + blockIdx.x; tile < warp_tiles;
       tile += int64_t{kDraftWarps} * gridDim.x) {
    // The grid's best keys so far (other blocks publish theirs as they go), loaded before the
    // products and folded into s.seen after them, so the load's latency is hidden.
    unsigned long long grid_best = 0;
    if (any_sampled && static_cast<int>(threadIdx.x) < members) {
      grid_best = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(
                      best[first + threadIdx.x])
                      .load(cuda::memory_order_relaxed);
    }
    const int64_t row0 = tile * 16;
    float acc[kMaxGroup / 8][4] = {};
    tile_products<W, kPasses>(p, row0, inputs, stride, p.group_size, column_tiles, acc);
    if (grid_best != 0) atomicMax(&s.seen[threadIdx.x], static_cast<uint32_t>(grid_best >> 32));
#pragma unroll
    for (int nt = 0; nt < kMaxGroup / 8; ++nt) {
      if (nt >= column_tiles) break;
      tile_epilogue<W, Base, kRnn>(p, row0, members, nt, acc[nt], any_sampled, s, best + first);
    }
  }

  // The last block of the group to arrive writes the tokens (every thread's maxima are fenced
  // before the barrier that precedes the arrival).
  __threadfence();
  __syncthreads();
  int32_t* const arrivals = p.arrivals + p.slot * static_cast<int>(gridDim.y) + group;
  if (threadIdx.x == 0) last = atomicAdd(arrivals, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (last) {  // every block of the group has arrived: its counters go back to zero
    __threadfence();
    for (int i = threadIdx.x; i < members; i += blockDim.x) {
      const int32_t id = candidate_id(__ldcg(best + first + i));
      p.tokens[int64_t{first + i} * p.block + p.slot] = id < 0 ? 0 : id;
      best[first + i] = 0;
    }
    if (threadIdx.x == 0) *arrivals = 0;
  }
  if (kRnn) {
    // s_{j+1} = sigmoid(g) * s_j + (1 - sigmoid(g)) * tanh(c), spread over the group's blocks;
    // rnn_head_kernel of this slot has read s_j already, and nothing in this launch reads it.
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < members * p.rank;
         e += gridDim.x * blockDim.x) {
      const int i = e / p.rank, k = e % p.rank, b = first + i;
      const float* pre = p.preactivation + int64_t{b} * 3 * p.rank;
      const float gate = 1.f / (1.f + expf(-pre[k]));
      float& state = p.state[int64_t{b} * p.rank + k];
      state = gate * (p.slot > 0 ? state : 0.f) + (1.f - gate) * tanhf(pre[p.rank + k]);
    }
  }
}

__host__ __device__ inline bool has_filters(const DraftParams& p) {
  return p.top_k || p.top_p || p.min_p;
}

// The sampling filters of slot p.slot (see the file header): block b filters request b's row in
// place and redraws its token. Dynamic shared memory: FilterShared. Logit: the stored rows' type
// (float, or __nv_bfloat16 with p.logits_bf16: the values the slot kernel sampled from).
constexpr int kFilterThreads = 1024;  // one block per request: as many row loads in flight as fit
static_assert(kFilterThreads <= kFilterCandidates, "each thread's maximum has a candidate slot");

template <typename Logit>
__global__ void __launch_bounds__(kFilterThreads) draft_filter_kernel(const DraftParams p) {
  const int b = blockIdx.x;
  const FilterSpec spec = make_filter_spec(p.top_k, p.top_p, p.min_p, b, p.vocab);
  if (!spec.active()) return;
  const float t = p.temperature[b];
  const bool greedy = is_greedy(t);
  const float inv_t = greedy ? 1.f : 1.f / t;
  DSPARK_EXTERN_SHARED(unsigned char, filter_shared_raw);
  FilterShared& sh = *reinterpret_cast<FilterShared*>(filter_shared_raw);
  __shared__ unsigned long long candidate_scratch[32];
  Logit* z = static_cast<Logit*>(p.draft_logits) + (int64_t{b} * p.block + p.slot) * p.vocab;
  // 16-byte loads where the row starts on a 16-byte boundary (x is a multiple of 8); plain loads,
  // as the last pass writes the row.
  const bool vector_row = (reinterpret_cast<uintptr_t>(z) & 15) == 0;
  const auto load8 = [&](int64_t x, float (&v)[kFilterValues]) {
    Logit raw[kFilterValues];
    if (vector_row && x + kFilterValues <= p.vocab) {
      constexpr int kChunks = kFilterValues * sizeof(Logit) / 16;
      uint4 chunk[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) chunk[c] = reinterpret_cast<const uint4*>(z + x)[c];
      memcpy(raw, chunk, sizeof(raw));
    } else {
#pragma unroll
      for (int k = 0; k < kFilterValues; ++k) {
        raw[k] = x + k < p.vocab ? z[x + k] : from_float<Logit>(-INFINITY);
      }
    }
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) {
      const float value = to_float(raw[k]);
      v[k] = isfinite(value) ? value : -INFINITY;
    }
  };

  double row_max = -INFINITY;
  for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < p.vocab;
       x += int64_t{blockDim.x} * kFilterValues) {
    float v[kFilterValues];
    load8(x, v);
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) row_max = fmax(row_max, double{v[k]});
  }
  const auto larger = [](double a, double c) { return fmax(a, c); };
  // Each thread's maximum (its load8 elements'): the parts top-k's floor is taken from.
  sh.candidate_key[threadIdx.x] = logit_key(static_cast<float>(row_max));
  if (threadIdx.x == 0) sh.candidates = blockDim.x;
  const float m = static_cast<float>(block_reduce(row_max, larger, double{-INFINITY}, sh.sum_scratch));
  if (m == -INFINITY) {
    // No finite logit: the slot kernel's token 0 stands; the row is stored as every filtered
    // row is, non-finite values as -inf (as the CPU kernel and the reference store it).
    for (int64_t x = threadIdx.x; x < p.vocab; x += blockDim.x) {
      z[x] = from_float<Logit>(-INFINITY);
    }
    return;
  }
  const FilterResult f = block_filter_row(load8, p.vocab, m, inv_t, spec, sh, blockDim.x);

  const int64_t position = offset_position(p.position[b], 1 + p.slot);
  unsigned long long best = 0;
  for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < p.vocab;
       x += int64_t{blockDim.x} * kFilterValues) {
    float v[kFilterValues], u[kFilterValues];
    load8(x, v);
#pragma unroll
    for (int g = 0; g < kFilterValues / 4; ++g) {
      const Philox4 block =
          philox_block(p.seed[b], position, kPurposeDraft, static_cast<uint32_t>((x >> 2) + g));
#pragma unroll
      for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
    }
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) {
      if (x + k >= p.vocab) break;
      if (v[k] == -INFINITY || !filter_keeps(f, v[k], softmax_weight(v[k], m, inv_t))) {
        z[x + k] = from_float<Logit>(-INFINITY);  // dropped (and non-finite values, as stored)
        continue;
      }
      const float key = greedy ? v[k] : v[k] * inv_t - logf(-log1pf(-u[k]));
      if (!(key > -INFINITY)) continue;
      const unsigned long long packed = pack_candidate(key, static_cast<int32_t>(x + k));
      best = packed > best ? packed : best;
    }
  }
  const auto higher = [](unsigned long long a, unsigned long long c) { return a > c ? a : c; };
  best = block_reduce(best, higher, 0ull, candidate_scratch);
  if (threadIdx.x == 0) {
    const int32_t id = candidate_id(best);
    p.tokens[int64_t{b} * p.block + p.slot] = id < 0 ? 0 : id;
  }
}

// [g; c; o] = J [s; W1[x]; h] + b for slot p.slot. Grid (3r / 32, ceil(B / 8)): warp w of block
// (x, y) computes rows 32x + 4w .. +4 of J for requests 8y .. 8y + 8, each lane taking pairs of
// consecutive columns of each input segment: 12 loads (one 32- or 64-bit load per row of J and
// per request where the segment's rows are pair-aligned) per 64 multiply-adds, no branch in the
// loop. Rows past 3r and requests past B read the last valid one and are not stored.
constexpr int kHeadRowsPerWarp = 4;
constexpr int kHeadRequests = 8;

// Whether pairs (2i, 2i + 1) of rows base + m * stride_a + n * stride_b are 2-element aligned.
template <typename T>
__device__ __forceinline__ bool pairs_aligned(const T* base, int64_t stride_a, int64_t stride_b = 0) {
  return reinterpret_cast<uintptr_t>(base) % (2 * sizeof(T)) == 0 && stride_a % 2 == 0 &&
         stride_b % 2 == 0;
}

// at[0] and at[1] as floats: one load when kAligned.
template <bool kAligned, typename T>
__device__ __forceinline__ float2 load_pair(const T* at) {
  if constexpr (!kAligned) {
    return make_float2(to_float(at[0]), to_float(at[1]));
  } else if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const float2*>(at));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // a bfloat16 is a float's high half
    const unsigned int bits = __ldg(reinterpret_cast<const unsigned int*>(at));
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  } else {
    const unsigned int bits = __ldg(reinterpret_cast<const unsigned int*>(at));
    const uint16_t lo = bits & 0xffffu, hi = bits >> 16;
    T a, b;
    memcpy(&a, &lo, sizeof(T));
    memcpy(&b, &hi, sizeof(T));
    return make_float2(to_float(a), to_float(b));
  }
}

// acc[r][q] += J[row r, k0 + k] * in_q[k] over k in [0, len): the lane's pairs, then the odd last
// column. `in[q]` is request q's segment row; with kMasked, requests whose bit of `valid` is clear
// read zeros (an id outside [0, V)).
template <bool kAligned, bool kMasked, typename W, typename T>
__device__ __forceinline__ void head_segment(const W* const (&joint)[kHeadRowsPerWarp], int k0,
                                             int len, const T* const (&in)[kHeadRequests],
                                             unsigned valid, int lane,
                                             float (&acc)[kHeadRowsPerWarp][kHeadRequests]) {
  // The loads' addresses advance by 64 columns a step (no per-load index arithmetic).
  const W* weight_at[kHeadRowsPerWarp];
  const T* input_at[kHeadRequests];
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) weight_at[r] = joint[r] + k0 + 2 * lane;
#pragma unroll
  for (int q = 0; q < kHeadRequests; ++q) input_at[q] = in[q] + 2 * lane;
  int k = 2 * lane;
#pragma unroll 1
  for (; k + 1 < len; k += 64) {
    float2 weight[kHeadRowsPerWarp], x[kHeadRequests];
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
      weight[r] = load_pair<kAligned>(weight_at[r]);
      weight_at[r] += 64;
    }
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      x[q] = !kMasked || (valid >> q & 1u) ? load_pair<kAligned>(input_at[q]) : make_float2(0.f, 0.f);
      input_at[q] += 64;
    }
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
#pragma unroll
      for (int q = 0; q < kHeadRequests; ++q) {
        acc[r][q] = fmaf(weight[r].y, x[q].y, fmaf(weight[r].x, x[q].x, acc[r][q]));
      }
    }
  }
  if (k < len) {
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
      const float weight = to_float(joint[r][k0 + k]);
#pragma unroll
      for (int q = 0; q < kHeadRequests; ++q) {
        const float x = !kMasked || (valid >> q & 1u) ? to_float(in[q][k]) : 0.f;
        acc[r][q] = fmaf(weight, x, acc[r][q]);
      }
    }
  }
}

// Row `row` of [g; c; o] = J [s; W1[x]; h] + b for request b with the dot product in float64: the
// rare path of both head kernels, for a float32 sum at or above kExactHeadAbove or not finite
// (finite weights near float32's range). s_0 = 0 is multiplied as the float32 path does.
template <typename W>
__device__ float exact_preactivation(const DraftParams& p, int b, int row) {
  const W* joint = static_cast<const W*>(p.joint_weight) + int64_t{row} * p.joint_stride;
  const auto term = [&](int k, float input) {
    return static_cast<double>(to_float(joint[k])) * static_cast<double>(input);
  };
  double sum = 0.0;
  for (int k = 0; k < p.rank; ++k) {
    sum += term(k, p.slot > 0 ? p.state[int64_t{b} * p.rank + k] : 0.f);
  }
  const int64_t x = previous_token(p, b);
  if (x >= 0 && x < p.vocab) {
    const W* w1 = static_cast<const W*>(p.w1) + x * p.w1_stride;
    for (int k = 0; k < p.rank; ++k) sum += term(p.rank + k, to_float(w1[k]));
  }
  const int64_t h = int64_t{b} * p.hidden_stride_b + int64_t{p.slot} * p.hidden_stride_j;
  for (int k = 0; k < p.hidden_size; ++k) {
    sum += term(2 * p.rank + k, load_float(p.hidden, p.hidden_type, h + k));
  }
  const double bias = static_cast<double>(to_float(static_cast<const W*>(p.joint_bias)[row]));
  return static_cast<float>(sum + bias);
}

template <typename W>
__global__ void __launch_bounds__(kDraftThreads, 2) rnn_head_kernel(const DraftParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kDraftWarps + warp) * kHeadRowsPerWarp;
  const int b0 = blockIdx.y * kHeadRequests;
  const int rows = 3 * p.rank;
  if (row0 >= rows) return;
  const W* joint_weight = static_cast<const W*>(p.joint_weight);
  const W* joint[kHeadRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) {
    joint[r] = joint_weight + int64_t{min(row0 + r, rows - 1)} * p.joint_stride;
  }
  int request[kHeadRequests];
#pragma unroll
  for (int q = 0; q < kHeadRequests; ++q) request[q] = min(b0 + q, p.batch - 1);
  float acc[kHeadRowsPerWarp][kHeadRequests] = {};
  // Each segment's loop runs with pair loads when J's and the segment's rows are pair-aligned.
  const auto segment = [&](int k0, int len, const auto* const (&in)[kHeadRequests], bool aligned,
                           unsigned valid, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    if (aligned && pairs_aligned(joint_weight, p.joint_stride, k0)) {
      head_segment<true, kMasked>(joint, k0, len, in, valid, lane, acc);
    } else {
      head_segment<false, kMasked>(joint, k0, len, in, valid, lane, acc);
    }
  };
  using Unmasked = std::false_type;
  {  // W1[x_j]: a zero row for an id outside [0, V)
    const W* w1 = static_cast<const W*>(p.w1);
    const W* in[kHeadRequests];
    unsigned valid = 0;
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      const int64_t x = previous_token(p, request[q]);
      const bool ok = x >= 0 && x < p.vocab;
      valid |= unsigned{ok} << q;
      in[q] = w1 + (ok ? x : 0) * p.w1_stride;
    }
    segment(p.rank, p.rank, in, pairs_aligned(w1, p.w1_stride), valid, std::true_type{});
  }
  {  // s_j: zeros at slot 0 (multiplied, as the reference does, but not read)
    const float* in[kHeadRequests];
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) in[q] = p.state + int64_t{request[q]} * p.rank;
    if (p.slot > 0) {
      segment(0, p.rank, in, pairs_aligned(p.state, p.rank), ~0u, Unmasked{});
    } else {
      segment(0, p.rank, in, pairs_aligned(p.state, p.rank), 0u, std::true_type{});
    }
  }
  // h_j, its dtype dispatched once, outside the loops.
  const auto hidden_segment = [&](auto* hidden) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(hidden)>>;
    const T* in[kHeadRequests];
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      in[q] = hidden + request[q] * p.hidden_stride_b + p.slot * p.hidden_stride_j;
    }
    segment(2 * p.rank, p.hidden_size, in,
            pairs_aligned(hidden, p.hidden_stride_b, p.hidden_stride_j), ~0u, Unmasked{});
  };
  switch (p.hidden_type) {
    case kElementBFloat16: hidden_segment(static_cast<const __nv_bfloat16*>(p.hidden)); break;
    case kElementHalf: hidden_segment(static_cast<const __half*>(p.hidden)); break;
    default: hidden_segment(static_cast<const float*>(p.hidden)); break;
  }
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) {
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      float v = acc[r][q];
#pragma unroll
      for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
      const int b = b0 + q;
      if (lane == 0 && b < p.batch && row0 + r < rows) {
        p.preactivation[int64_t{b} * rows + row0 + r] =
            fabsf(v) < kExactHeadAbove ? v + to_float(static_cast<const W*>(p.joint_bias)[row0 + r])
                                       : exact_preactivation<W>(p, b, row0 + r);
      }
    }
  }
}

// The same product on tensor cores for 16-bit weights W: block (x, y) owns the 16 x 8 output tile
// of rows 16x .. 16x + 16 and requests 8y .. 8y + 8; its eight warps split each input segment's
// 16-column steps (warp w takes steps w, w + 8, ...), each accumulating its share of the tile with
// mma.sync m16n8k16 (J rows as A, the requests' inputs as B, float32 accumulators), and the warps'
// partial tiles are summed in warp order, so a request's sums do not depend on the batch. An input
// of type W is exact in one B fragment; any other (the float32 state, a hidden state of another
// type) enters as three W parts, hi + mid + lo, which carry float32's 24-bit significand (bf16:
// 3 x 8 bits; fp16 past its range's lower end loses only bits below 2^-24), so the products are
// those of the float32 inputs. Rows past 3r and requests past B read the last valid one and are
// not stored.
constexpr int kHeadMmaWarps = 8;
constexpr int kHeadMmaThreads = 32 * kHeadMmaWarps;

template <typename W>
__device__ __forceinline__ uint16_t head_bits(W v) {
  uint16_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Elements k, k + 1 of `row` as a packed pair of W (the lower index in the low half); with
// kGuarded, zero from `len` on. One 32-bit load when kAligned and both are read.
template <bool kAligned, bool kGuarded, typename W>
__device__ __forceinline__ uint32_t head_weight_pair(const W* row, int k, int len) {
  if (kAligned && (!kGuarded || k + 1 < len)) {
    return __ldg(reinterpret_cast<const unsigned int*>(row + k));
  }
  const uint32_t lo = !kGuarded || k < len ? head_bits(row[k]) : 0u;
  const uint32_t hi = !kGuarded || k + 1 < len ? head_bits(row[k + 1]) : 0u;
  return lo | (hi << 16);
}

// Elements k, k + 1 of an input row as floats (kGuarded: zero from `len` on).
template <bool kAligned, bool kGuarded, typename T>
__device__ __forceinline__ float2 head_input_pair(const T* row, int k, int len) {
  if (kAligned && (!kGuarded || k + 1 < len)) return load_pair<true>(row + k);
  return make_float2(!kGuarded || k < len ? to_float(row[k]) : 0.f,
                     !kGuarded || k + 1 < len ? to_float(row[k + 1]) : 0.f);
}

template <typename W>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return static_cast<uint32_t>(head_bits(from_float<W>(lo))) |
         (static_cast<uint32_t>(head_bits(from_float<W>(hi))) << 16);
}

// acc += the 16 x 8 x 16 product of the step whose lane columns are k, k + 1, k + 8, k + 9 (of
// the segment starting at column k0 of J): `jg` and `jg8` are rows g and g + 8 of the tile, `in`
// the lane's request's segment row (its B column g); `valid` false reads zeros (an id outside
// [0, V)). kGuarded: the segment's last, partial step (columns from `len` on are zero).
template <bool kAligned, bool kGuarded, typename W, typename T>
__device__ __forceinline__ void head_mma_step(const W* jg, const W* jg8, int k, int len,
                                              const T* in, bool valid, float (&acc)[4]) {
  const uint32_t a0 = head_weight_pair<kAligned, kGuarded>(jg, k, len);
  const uint32_t a1 = head_weight_pair<kAligned, kGuarded>(jg8, k, len);
  const uint32_t a2 = head_weight_pair<kAligned, kGuarded>(jg, k + 8, len);
  const uint32_t a3 = head_weight_pair<kAligned, kGuarded>(jg8, k + 8, len);
  if constexpr (std::is_same_v<T, W>) {  // exact in one fragment
    const uint32_t b0 = valid ? head_weight_pair<kAligned, kGuarded>(in, k, len) : 0u;
    const uint32_t b1 = valid ? head_weight_pair<kAligned, kGuarded>(in, k + 8, len) : 0u;
    mma_m16n8k16<W>(acc, a0, a1, a2, a3, b0, b1);
  } else {
    float2 x0 = valid ? head_input_pair<kAligned, kGuarded>(in, k, len) : make_float2(0.f, 0.f);
    float2 x1 = valid ? head_input_pair<kAligned, kGuarded>(in, k + 8, len) : make_float2(0.f, 0.f);
#pragma unroll
    for (int part = 0; part < 3; ++part) {  // hi, mid, lo: each the W rounding of what is left
      mma_m16n8k16<W>(acc, a0, a1, a2, a3, pack_pair<W>(x0.x, x0.y), pack_pair<W>(x1.x, x1.y));
      const auto rest = [](float v) { return v - to_float(from_float<W>(v)); };
      x0 = make_float2(rest(x0.x), rest(x0.y));
      x1 = make_float2(rest(x1.x), rest(x1.y));
    }
  }
}

// acc += J[rows, k0 + k] x in[k] over k in [0, len): the warp's share of the segment's 16-column
// steps (w, w + 8, ...), the whole ones unguarded, then the partial last one if it is the warp's.
template <bool kAligned, typename W, typename T>
__device__ __forceinline__ void head_mma_segment(const W* jg, const W* jg8, int k0, int len,
                                                 const T* in, bool valid, int warp, int lane,
                                                 float (&acc)[4]) {
  const int t = lane & 3, whole = len / 16;
  jg += k0, jg8 += k0;
  int step = warp;
#pragma unroll 4
  for (; step < whole; step += kHeadMmaWarps) {
    head_mma_step<kAligned, false>(jg, jg8, 16 * step + 2 * t, len, in, valid, acc);
  }
  if (16 * step < len) {
    head_mma_step<kAligned, true>(jg, jg8, 16 * step + 2 * t, len, in, valid, acc);
  }
}

template <typename W>
__global__ void __launch_bounds__(kHeadMmaThreads) rnn_head_mma_kernel(const DraftParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rows = 3 * p.rank, row0 = blockIdx.x * 16, b0 = blockIdx.y * 8;
  const W* joint_weight = static_cast<const W*>(p.joint_weight);
  const W* jg = joint_weight + int64_t{min(row0 + g, rows - 1)} * p.joint_stride;
  const W* jg8 = joint_weight + int64_t{min(row0 + g + 8, rows - 1)} * p.joint_stride;
  const int request = min(b0 + g, p.batch - 1);  // the lane's B column
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // Each segment's loop with pair loads when J's and the segment's rows are pair-aligned.
  const auto segment = [&](int k0, int len, const auto* in, bool in_aligned, bool valid) {
    if (in_aligned && pairs_aligned(joint_weight, p.joint_stride, k0)) {
      head_mma_segment<true>(jg, jg8, k0, len, in, valid, warp, lane, acc);
    } else {
      head_mma_segment<false>(jg, jg8, k0, len, in, valid, warp, lane, acc);
    }
  };
  // s_j: zeros at slot 0 (multiplied, as the reference does, but not read).
  segment(0, p.rank, p.state + int64_t{request} * p.rank, pairs_aligned(p.state, p.rank),
          p.slot > 0);
  {  // W1[x_j]: a zero row for an id outside [0, V)
    const W* w1 = static_cast<const W*>(p.w1);
    const int64_t x = previous_token(p, request);
    const bool ok = x >= 0 && x < p.vocab;
    segment(p.rank, p.rank, w1 + (ok ? x : 0) * p.w1_stride, pairs_aligned(w1, p.w1_stride), ok);
  }
  // h_j, its dtype dispatched once, outside the loops.
  const auto hidden_segment = [&](const auto* hidden) {
    segment(2 * p.rank, p.hidden_size,
            hidden + request * p.hidden_stride_b + p.slot * p.hidden_stride_j,
            pairs_aligned(hidden, p.hidden_stride_b, p.hidden_stride_j), true);
  };
  switch (p.hidden_type) {
    case kElementBFloat16: hidden_segment(static_cast<const __nv_bfloat16*>(p.hidden)); break;
    case kElementHalf: hidden_segment(static_cast<const __half*>(p.hidden)); break;
    default: hidden_segment(static_cast<const float*>(p.hidden)); break;
  }
  // The warps' partial tiles, summed in warp order by warp 0 (C fragment: rows g, g + 8, requests
  // 2t, 2t + 1).
  __shared__ float partial[kHeadMmaWarps][32][4];
#pragma unroll
  for (int e = 0; e < 4; ++e) partial[warp][lane][e] = acc[e];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kHeadMmaWarps; ++w) sum += partial[w][lane][e];
    const int row = row0 + g + 8 * (e >> 1), b = b0 + 2 * t + (e & 1);
    if (row < rows && b < p.batch) {
      p.preactivation[int64_t{b} * rows + row] =
          fabsf(sum) < kExactHeadAbove ? sum + to_float(static_cast<const W*>(p.joint_bias)[row])
                                       : exact_preactivation<W>(p, b, row);
    }
  }
}

// Lets draft_slot_kernel take `shared_bytes` of dynamic shared memory (past 48 KB only with this
// opt-in; it is per device, so it is set on every call).
template <typename W, typename Base, bool kRnn>
cudaError_t allow_draft_shared(int shared_bytes) {
  return cudaFuncSetAttribute(draft_slot_kernel<W, Base, kRnn>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
}

// Blocks of draft_slot_kernel resident per SM on the current device (a host query, cached per
// instantiation, device and shared-memory size; the caller has called allow_draft_shared).
template <typename W, typename Base, bool kRnn>
int draft_blocks_per_sm(int device, int shared_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find({device, shared_bytes});
  if (found != cache.end()) return found->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, draft_slot_kernel<W, Base, kRnn>, kDraftThreads,
                                                    shared_bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error; nothing else is pending at this point
    n = 2;
  }
  return cache[{device, shared_bytes}] = n > 0 ? n : 1;
}

// One draft_filter_kernel launch over rows of type Logit.
template <typename Logit>
cudaError_t launch_draft_filter(const DraftParams& p, cudaStream_t stream) {
  DSPARK_LAUNCH(dim3(p.batch), kFilterThreads, sizeof(FilterShared), stream,
                draft_filter_kernel<Logit>)(p);
  return cudaGetLastError();
}

// Launches the whole block walk on `stream`: G slot launches (plus G head launches for the RNN).
// `grid_tiles` blocks per group walk the p.num_tiles vocabulary tiles; the caller has called
// allow_draft_shared.
template <typename W, typename Base, bool kRnn>
cudaError_t launch_draft(DraftParams p, int grid_tiles, cudaStream_t stream) {
  const int groups = (p.batch + p.group_size - 1) / p.group_size;
  const int shared_bytes = draft_shared_bytes<W, kRnn>(p.group_size, p.rank);
  for (int j = 0; j < p.block; ++j) {
    p.slot = j;
    if constexpr (kRnn && sizeof(W) == 2) {  // 16-bit weights: tensor cores
      const dim3 head_grid((3 * p.rank + 15) / 16, (p.batch + 7) / 8);
      DSPARK_LAUNCH(head_grid, kHeadMmaThreads, 0, stream, rnn_head_mma_kernel<W>)(p);
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    } else if constexpr (kRnn) {
      const dim3 head_grid((3 * p.rank + kDraftWarps * kHeadRowsPerWarp - 1) /
                               (kDraftWarps * kHeadRowsPerWarp),
                           (p.batch + kHeadRequests - 1) / kHeadRequests);
      DSPARK_LAUNCH(head_grid, kDraftThreads, 0, stream, rnn_head_kernel<W>)(p);
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    }
    DSPARK_LAUNCH(dim3(grid_tiles, groups), kDraftThreads, shared_bytes, stream,
                  draft_slot_kernel<W, Base, kRnn>)(p);
    cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    if (has_filters(p)) {
      error = p.logits_bf16 ? launch_draft_filter<__nv_bfloat16>(p, stream)
                            : launch_draft_filter<float>(p, stream);
      if (error != cudaSuccess) return error;
    }
  }
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------------
// draft_confidence.

struct ConfidenceParams {
  const void* hidden;  // [B, G, d], unit stride along d
  int hidden_type;
  int64_t hidden_stride_b, hidden_stride_j;
  const void* prev_tokens;  // int32/int64 [B, G]
  bool ids_int32;
  int64_t id_stride_b, id_stride_j;
  const void* w1;  // [V, r] of type W
  int64_t w1_stride;
  const void* weight;  // [d + r]
  int weight_type;
  const void* bias;  // one element or null
  int bias_type;
  const float* calib_temperature;  // [G] or null
  float* out;                      // [B, G]
  int batch, block, rank, hidden_size;
  int64_t vocab;
};

constexpr int kConfidenceThreads = 128;   // one warp per (request, slot) row
constexpr int kConfidenceSegment = 2048;  // weights staged in shared memory at a time (float32)
constexpr int kConfidenceLoads = 8;       // 16-byte loads a lane issues before its first FMA

// This lane's share of sum_k row[k] * w[k] over k < n (n <= kConfidenceSegment): 16-byte loads when
// the row is 16-byte aligned, a round of kConfidenceLoads all issued before the first multiply-add;
// element by element past the last whole vector and for unaligned rows.
template <typename T>
__device__ __forceinline__ float lane_dot(const T* row, int n, const float* w, int lane) {
  constexpr int kVec = 16 / sizeof(T);
  float acc = 0.f;
  int tail = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int vectors = n / kVec;
    for (int first = lane; first < vectors; first += 32 * kConfidenceLoads) {
      uint4 v[kConfidenceLoads];
#pragma unroll
      for (int i = 0; i < kConfidenceLoads; ++i) {
        const int idx = first + 32 * i;
        v[i] = idx < vectors ? __ldg(reinterpret_cast<const uint4*>(row) + idx) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kConfidenceLoads; ++i) {
        const int idx = first + 32 * i;
        if (idx >= vectors) break;
        const T* e = reinterpret_cast<const T*>(&v[i]);
#pragma unroll
        for (int t = 0; t < kVec; t += 4) {
          const float4 w4 = *reinterpret_cast<const float4*>(w + idx * kVec + t);
          acc = fmaf(to_float(e[t]), w4.x, acc);
          acc = fmaf(to_float(e[t + 1]), w4.y, acc);
          acc = fmaf(to_float(e[t + 2]), w4.z, acc);
          acc = fmaf(to_float(e[t + 3]), w4.w, acc);
        }
      }
    }
    tail = vectors * kVec;
  }
  for (int k = tail + lane; k < n; k += 32) acc = fmaf(to_float(row[k]), w[k], acc);
  return acc;
}

// This lane's share of sum_k row[k] * weight[offset + k] over k < n, the weights staged through
// shared memory a segment at a time by the whole block (n is the same for every warp; a warp
// without a row, row = null, still takes part in staging).
template <typename T>
__device__ float staged_dot(const T* row, int n, const ConfidenceParams& p, int offset,
                            float* w_seg, int lane) {
  float acc = 0.f;
  for (int s0 = 0; s0 < n; s0 += kConfidenceSegment) {
    const int len = min(kConfidenceSegment, n - s0);
    __syncthreads();  // the previous segment is consumed
    for (int k = threadIdx.x; k < len; k += blockDim.x) {
      w_seg[k] = load_float(p.weight, p.weight_type, offset + s0 + k);
    }
    __syncthreads();
    if (row != nullptr) acc += lane_dot(row + s0, len, w_seg, lane);
  }
  return acc;
}

// sum_k row[k] * weight[offset + k] over k < n in float64, the whole warp reducing it (every lane
// gets the sum): the rare rows whose float32 sum is not finite. Weights are read from global
// memory, so no barrier is needed and one warp can take this path alone.
template <typename T>
__device__ double exact_dot(const T* row, int n, const ConfidenceParams& p, int offset, int lane) {
  double acc = 0.0;
  if (row != nullptr) {
    for (int k = lane; k < n; k += 32) {
      acc += static_cast<double>(to_float(row[k])) *
             static_cast<double>(load_float(p.weight, p.weight_type, offset + k));
    }
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, mask);
  return acc;
}

// Eight blocks per SM (64 registers): with no minimum, sm_80's float32 instantiation saved a
// register to the stack around the IEEE division's slow-path call.
template <typename W>
__global__ void __launch_bounds__(kConfidenceThreads, 8)
    draft_confidence_kernel(const ConfidenceParams p) {
  __shared__ __align__(16) float w_seg[kConfidenceSegment];
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t{blockIdx.x} * (kConfidenceThreads / 32) + (threadIdx.x >> 5);
  const bool active = row < int64_t{p.batch} * p.block;  // inactive warps still stage weights
  const int b = active ? static_cast<int>(row / p.block) : 0;
  const int j = active ? static_cast<int>(row % p.block) : 0;
  int64_t x = -1;
  if (active) {
    const int64_t id_offset = b * p.id_stride_b + j * p.id_stride_j;
    x = p.ids_int32 ? static_cast<const int32_t*>(p.prev_tokens)[id_offset]
                    : static_cast<const int64_t*>(p.prev_tokens)[id_offset];
  }
  const bool in_range = x >= 0 && x < p.vocab;
  const int64_t h_offset = b * p.hidden_stride_b + j * p.hidden_stride_j;
  float sum;
  switch (p.hidden_type) {  // uniform over the block, as staged_dot's barriers need
    case kElementBFloat16: {
      const auto* h = static_cast<const __nv_bfloat16*>(p.hidden) + h_offset;
      sum = staged_dot(active ? h : nullptr, p.hidden_size, p, 0, w_seg, lane);
      break;
    }
    case kElementHalf: {
      const auto* h = static_cast<const __half*>(p.hidden) + h_offset;
      sum = staged_dot(active ? h : nullptr, p.hidden_size, p, 0, w_seg, lane);
      break;
    }
    default: {
      const auto* h = static_cast<const float*>(p.hidden) + h_offset;
      sum = staged_dot(active ? h : nullptr, p.hidden_size, p, 0, w_seg, lane);
    }
  }
  const W* w1 = in_range ? static_cast<const W*>(p.w1) + x * p.w1_stride : nullptr;
  sum += staged_dot(w1, p.rank, p, p.hidden_size, w_seg, lane);
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  const float bias = p.bias ? load_float(p.bias, p.bias_type, 0) : 0.f;
  float logit = sum + bias;
  // A float32 sum that overflowed (inf, or inf - inf = NaN for huge finite weights) where the
  // float64 logit the CPU kernel and the reference round may be finite: the row again in float64.
  // Lane 0's value decides, so the branch is the warp's (warps are whole rows).
  if (active && !isfinite(__shfl_sync(0xffffffffu, logit, 0))) {
    double exact;
    switch (p.hidden_type) {
      case kElementBFloat16:
        exact = exact_dot(static_cast<const __nv_bfloat16*>(p.hidden) + h_offset, p.hidden_size,
                          p, 0, lane);
        break;
      case kElementHalf:
        exact = exact_dot(static_cast<const __half*>(p.hidden) + h_offset, p.hidden_size, p, 0,
                          lane);
        break;
      default:
        exact = exact_dot(static_cast<const float*>(p.hidden) + h_offset, p.hidden_size, p, 0,
                          lane);
    }
    exact += exact_dot(w1, p.rank, p, p.hidden_size, lane);
    logit = static_cast<float>(exact + static_cast<double>(bias));
  }
  if (active && lane == 0) {
    if (p.calib_temperature) logit = logit / p.calib_temperature[j];
    p.out[row] = confidence_sigmoid(logit);
  }
}

template <typename W>
cudaError_t launch_draft_confidence(const ConfidenceParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.block;
  if (rows == 0) return cudaSuccess;
  constexpr int kRowsPerBlock = kConfidenceThreads / 32;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  DSPARK_LAUNCH(static_cast<unsigned>(blocks), kConfidenceThreads, 0, stream,
                draft_confidence_kernel<W>)(p);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
