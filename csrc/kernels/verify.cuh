// CUDA kernels of verify (docs/semantics.md §3.1), torch-free.
//
// Math: kernels/sampling_math.h (shared with the CPU kernel). Input contract: VerifyParams below;
// the ATen glue in cuda/verify_cuda.cpp checks shapes, dtypes and devices. Values are not trusted:
// out-of-range rows and draft ids are rejected and reported, never used as addresses.
//
// Geometry: grid (C, B): the vocabulary of each request is split into C chunks, C a function of V
// alone (verify_num_chunks: at most 16; one block per request, as FlashInfer's chain kernel does,
// cannot reach HBM bandwidth at B <= 132). Blocks never wait for each other, so a grid of several
// waves is fine. Two launches, no host work in between:
//
//  1. verify_row_stats_kernel: block (c, b) walks rows j = 0..n of request b over its chunk,
//     reading the target row and (when the draft is a distribution) the draft row in one loop, and
//     publishes partial softmax statistics (max, sum of weights, argmax). The last block to finish
//     a row (an atomic arrival counter after a __threadfence: the CUDA "threadFenceReduction"
//     pattern) merges the C partials and decides the row. Blocks never wait for each other, so no
//     co-residency is needed. Rows are decided in order, since the decider of row j is among the
//     blocks row j+1 must wait for; a decider that rejects publishes the row and stops, so the
//     first rejected row is the only one ever decided as rejected, and rows after it never
//     complete. The other blocks of the request are then already streaming the next row (they
//     arrived at the rejected row before it was decided); they poll the published rejection as
//     they stream and abandon that row part-way. Whatever a block does on a row past the first
//     rejection is never used, so reading the rejection late only costs bandwidth.
//     The block that decides a request's final row j* (its first rejection, or the bonus row n)
//     writes the outputs of a greedy request (the argmax just merged). A sampled request's token is
//     drawn by the exponential race over r = max(p - q, 0) on row j*, split into the C chunks:
//     each block that knows j* (its decider, and the blocks that stop on seeing the rejection)
//     claims one unraced chunk (an atomic counter) and races it right after streaming the row,
//     so the re-read comes from L2 and overlaps other requests' streaming. The block that
//     publishes the last chunk merges them in chunk order and writes the outputs.
//  2. verify_emit_kernel: races the chunks no block claimed, typically those of requests that
//     accepted every draft (their other blocks had finished before the bonus row was decided):
//     claims hand out chunks in order, so block c races chunk c if c is past them, and every chunk
//     is raced exactly once. Who races a chunk does not change its result, so the outcome does
//     not depend on the timing. It also returns to zero the counters the statistics kernel leaves
//     set (every counter's last user resets it, so the counters need no fill before a call:
//     common/stream_counters.h keeps one buffer per stream). It is a dependent launch
//     (launch.cuh): on sm_90 its blocks start as the statistics kernel's last ones finish and wait
//     for that grid to complete, instead of paying a launch after it.
//
// Sampling filters: the allowed-token bitmask is applied as the rows stream in (one 32-bit word
// per 32 elements). A request with top-k / top-p / min-p has its filters computed by the block
// that decides the row, over the whole row (kernels/filter.cuh: a radix descent, at most seven
// passes through L2, in dynamic shared memory the launch provides only when a filter is given),
// for the rows the decision needs only; the row's result carries the threshold and the kept
// weight, so the acceptance test, the race and the logprobs use the processed distribution. With
// top-k, every block publishes each warp's largest allowed logit of its chunk of the row, and the
// decider's gather starts from the k-th largest of those (a floor under every token top-k keeps),
// which saves it the first-digit pass over the row.
//
// Each element of a needed row is read once from HBM; the race reads row j* of a sampled request
// again (from L2 when raced in step 1). Chunks start at multiples of 16 elements, so rows whose
// start is 16-byte aligned use 16-byte vector loads, all issued before any is used. Rows starting
// past a boundary (odd V in 16-bit types, sliced rows): the emit kernel's race uses 16-byte loads
// re-cut in registers; the statistics kernel (80 registers) loads one element at a time. Either
// way each thread handles the same elements in the same order, so the results do not depend on
// where a row starts. Partials are merged in chunk order, and the chunks depend on V only: a
// request's outputs are bitwise the same in any batch, on any GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "convert.cuh"
#include "filter.cuh"
#include "reduce.cuh"
#include "sampling_math.h"
#include "launch.cuh"
#include "verify_launch.h"

namespace dspark_ops::kernels {

constexpr int kVerifyThreads = 256;
constexpr int kVerifyWarps = kVerifyThreads / 32;
constexpr int kElementsPerThread = 8;  // two Philox blocks; one 16-byte load of 16-bit logits
// The statistics pass keeps two such groups of the target row and of the draft row in flight per
// thread: at 3-4 resident blocks per SM (64-80 registers) that is 36-72 KB of loads per SM, above
// the ~25 KB an H200 SM needs to cover HBM latency.
constexpr int kStatsGroups = 2;

struct RowPartial {
  SoftmaxStats target;
  SoftmaxStats draft;
};

enum RowFlags : int32_t {
  kTargetInvalid = 8,  // the target row is out of range or has no finite logit
  kDraftInvalid = 16,  // the draft id is out of range or the draft row has no finite logit
};

struct RowResult {
  SoftmaxStats target;  // sum: of the kept weights when the row was filtered
  SoftmaxStats draft;
  int32_t decision;  // RowDecision | RowFlags
  FilterResult filter;
};

struct RacePartial {
  float mass;
  RaceCandidate best;
};


// A row's start past a 16-byte boundary, in bytes (a multiple of the element size).
__device__ __forceinline__ int misalignment16(const void* p) {
  return static_cast<int>(reinterpret_cast<uintptr_t>(p) & 15);
}

// Whether elements [x, x + 8) of a row starting `mis` bytes past a 16-byte boundary can be read
// with 16-byte loads: aligned, or (mis > 0) the two aligned words around them lie within the
// row's first `end` elements.
// A `mis` that asks load8 for one element at a time: the statistics kernel (capped at 80
// registers) reads rows past a 16-byte boundary so, since the re-cut words would spill there.
constexpr int kSingleLoads = 16;

template <typename T>
__device__ __forceinline__ bool vector_ok(int64_t x, int64_t end, int mis) {
  constexpr int64_t kSize = sizeof(T);
  return x + kElementsPerThread <= end && mis < kSingleLoads &&
         (mis == 0 || (x * kSize >= mis &&
                       (x + kElementsPerThread) * kSize + (16 - mis) <= end * kSize));
}

template <typename T>
__device__ __forceinline__ void unpack_words(const uint32_t* words, float (&v)[kElementsPerThread]) {
  const T* e = reinterpret_cast<const T*>(words);
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) v[k] = finite_or_neg_inf(to_float(e[k]));
}

// Elements [x, x + 8) (8 * sizeof(T) bytes) of a row starting `mis` > 0 bytes past a 16-byte
// boundary: the aligned 16-byte words around them, re-cut at `mis` (a byte shift of two words; the
// same elements as the aligned path gives, so the sums do not depend on where a row starts).
template <typename T>
__device__ __forceinline__ void load8_shifted(const T* row, int64_t x, int mis,
                                              float (&v)[kElementsPerThread]) {
  constexpr int kWords = kElementsPerThread * int{sizeof(T)} / 4;  // 32-bit words out: 4 or 8
  constexpr int kIn = kWords / 4 + 1;                              // 16-byte loads: 2 or 3
  const uint4* at = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(row + x) - mis);
  uint32_t w[4 * kIn];
#pragma unroll
  for (int h = 0; h < kIn; ++h) {
    const uint4 raw = __ldg(at + h);
    w[4 * h] = raw.x;
    w[4 * h + 1] = raw.y;
    w[4 * h + 2] = raw.z;
    w[4 * h + 3] = raw.w;
  }
  const int q = mis >> 2, shift = 8 * (mis & 3);
  uint32_t out[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    const uint32_t lo = q == 0 ? w[i] : q == 1 ? w[i + 1] : q == 2 ? w[i + 2] : w[i + 3];
    const uint32_t hi = q == 0 ? w[i + 1] : q == 1 ? w[i + 2] : q == 2 ? w[i + 3] : w[i + 4];
    out[i] = static_cast<uint32_t>(((uint64_t{hi} << 32) | lo) >> shift);
  }
  unpack_words<T>(out, v);
}

// Loads elements [x, x + 8) of a row starting `mis` bytes past a 16-byte boundary (non-finite and
// past-the-end elements as -inf): 16-byte loads where vector_ok, else one element at a time.
template <typename T>
__device__ __forceinline__ void load8(const T* row, int64_t x, int64_t end, int mis,
                                      float (&v)[kElementsPerThread]) {
  if (vector_ok<T>(x, end, mis)) {
    if (mis != 0) {
      load8_shifted(row, x, mis, v);
      return;
    }
    constexpr int kPerLoad = 16 / sizeof(T);
#pragma unroll
    for (int h = 0; h < kElementsPerThread / kPerLoad; ++h) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + x) + h);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPerLoad; ++k) v[h * kPerLoad + k] = finite_or_neg_inf(to_float(e[k]));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kElementsPerThread; ++k) {
      v[k] = x + k < end ? finite_or_neg_inf(to_float(row[x + k])) : -INFINITY;
    }
  }
}

// Eight elements as raw 16-byte words, so a thread can issue all its loads before using any.
template <typename T>
struct Raw8 {
  uint4 word[kElementsPerThread * sizeof(T) / 16];
};

template <typename T>
__device__ __forceinline__ void issue8(const T* row, int64_t x, Raw8<T>& raw) {
#pragma unroll
  for (int h = 0; h < kElementsPerThread * int{sizeof(T)} / 16; ++h) {
    raw.word[h] = __ldg(reinterpret_cast<const uint4*>(row + x) + h);
  }
}

template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& raw, float (&v)[kElementsPerThread]) {
  const T* e = reinterpret_cast<const T*>(raw.word);
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) v[k] = finite_or_neg_inf(to_float(e[k]));
}

// Per-request scalars, the same in every block of the request.
struct Request {
  int n;
  bool greedy, use_draft, draft_greedy;
  bool need_distribution;  // sampled, or logprobs asked for (greedy: at T = 1)
  bool filtered;           // need_distribution and a filter is on
  float inv_t, inv_td;
  int64_t start, seed, position;
  FilterSpec spec;
};

DSPARK_HOST_DEVICE bool has_filters(const VerifyParams& p) {
  return p.top_k || p.top_p || p.min_p;
}

__device__ __forceinline__ Request load_request(const VerifyParams& p, int b) {
  Request r;
  r.n = min(max(p.num_draft[b], 0), p.block);
  const float t = p.temperature[b];
  r.greedy = is_greedy(t);
  r.inv_t = r.greedy ? 1.f : 1.f / t;
  const float td = p.draft_temperature ? p.draft_temperature[b] : t;
  r.use_draft = p.draft != nullptr && !r.greedy;
  r.draft_greedy = is_greedy(td);
  r.inv_td = r.draft_greedy ? 1.f : 1.f / td;
  r.start = p.target_start ? p.target_start[b] : int64_t{b} * (p.block + 1);
  r.need_distribution = !r.greedy || p.logprobs != nullptr;
  r.spec = make_filter_spec(p.top_k, p.top_p, p.min_p, b, p.vocab);
  r.filtered = r.need_distribution && r.spec.active();
  r.seed = p.seed[b];
  r.position = p.position[b];
  return r;
}

__device__ __forceinline__ int64_t draft_token(const VerifyParams& p, int b, int j) {
  const int64_t offset = b * p.token_stride_b + j * p.token_stride_j;
  return p.tokens_int32 ? static_cast<const int32_t*>(p.draft_tokens)[offset]
                        : static_cast<const int64_t*>(p.draft_tokens)[offset];
}

template <typename T>
__device__ __forceinline__ const T* target_row(const VerifyParams& p, int64_t row) {
  int64_t offset = row * p.target_row_stride;
  if (p.target_group_rows > 0) {  // row is in [0, B * (G + 1)): a 32-bit division
    const uint32_t i = static_cast<uint32_t>(row);
    const uint32_t rows = static_cast<uint32_t>(p.target_group_rows), request = i / rows;
    offset = request * p.target_group_stride + (i - request * rows) * p.target_row_stride;
  }
  return static_cast<const T*>(p.target) + offset;
}

// The bitmask row of a target row (null: all allowed); out-of-range rows have none.
__device__ __forceinline__ const int32_t* mask_row(const VerifyParams& p, int64_t row) {
  return p.allowed_token_mask && row >= 0 && row < p.target_rows
             ? p.allowed_token_mask + row * p.mask_words
             : nullptr;
}

// Drops the disallowed ones of elements [x, x + 8) (x a multiple of 8: one byte of one word).
__device__ __forceinline__ void drop_disallowed8(const int32_t* mrow, int64_t x, int64_t end,
                                                 float (&v)[kElementsPerThread]) {
  if (!mrow || x >= end) return;  // past the end: all -inf already, and no word to read
  const uint32_t bits = static_cast<uint32_t>(__ldg(mrow + (x >> 5))) >> (x & 31);
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) {
    if (!((bits >> k) & 1u)) v[k] = -INFINITY;
  }
}

__device__ __forceinline__ bool allowed(const int32_t* mrow, int64_t x) {
  return !mrow || ((static_cast<uint32_t>(__ldg(mrow + (x >> 5))) >> (x & 31)) & 1u);
}

// Drops what the row's filters drop from elements [x, x + 8) (already masked).
__device__ __forceinline__ void drop_filtered8(const FilterResult& f, float row_max, float inv_t,
                                               float (&v)[kElementsPerThread]) {
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) {
    if (v[k] != -INFINITY && !filter_keeps(f, v[k], softmax_weight(v[k], row_max, inv_t))) {
      v[k] = -INFINITY;
    }
  }
}

template <typename T>
__device__ __forceinline__ const T* draft_row(const VerifyParams& p, int b, int j) {
  return static_cast<const T*>(p.draft) + b * p.draft_stride_b + j * p.draft_stride_j;
}

// Folds elements [x, x + 8) into running statistics: online max / first argmax / sum of weights.
__device__ __forceinline__ void accumulate8(SoftmaxStats& s, const float (&v)[kElementsPerThread],
                                            int64_t x, bool with_sum, float inv_t) {
  float m = -INFINITY;
  int32_t arg = -1;
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) {
    if (v[k] > m) {
      m = v[k];
      arg = static_cast<int32_t>(x + k);
    }
  }
  if (m > s.max) {  // a tie keeps the earlier (lower) index
    if (with_sum) s.sum = s.max == -INFINITY ? 0.f : s.sum * softmax_weight(s.max, m, inv_t);
    s.max = m;
    s.argmax = arg;
  }
  if (with_sum && s.max != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kElementsPerThread; ++k) s.sum += softmax_weight(v[k], s.max, inv_t);
  }
}

// This thread's statistics of the target row and (if drow) the draft row over [x0, x1), read in
// one loop so both rows' loads are in flight together. Stops early once `*reject_mark` exceeds
// `abandon_above` (an earlier row was rejected, so this row will never be decided); the load is
// issued at the top of an iteration and used at its end, so its latency hides behind the row's.
template <typename TT, typename DT>
__device__ RowPartial thread_row_stats(const TT* trow, const int32_t* mrow, const DT* drow,
                                       int64_t x0, int64_t x1, const Request& r,
                                       const int32_t* reject_mark, int32_t abandon_above) {
  RowPartial s{empty_stats(), empty_stats()};
  const bool t_sum = r.need_distribution, d_sum = !r.draft_greedy;
  const bool aligned = ((reinterpret_cast<uintptr_t>(trow) | reinterpret_cast<uintptr_t>(drow)) &
                        15) == 0;
  // Group g of an iteration is 8 elements at base + g * kGroupStride: a warp's 16-byte loads
  // cover 512 contiguous bytes (whole sectors), not every other 16 bytes. (blockDim.x is
  // kVerifyThreads: constant strides keep registers free under the cap of 80.)
  constexpr int64_t kGroupStride = int64_t{kVerifyThreads} * kElementsPerThread;
  constexpr int64_t kLastGroup = (kStatsGroups - 1) * kGroupStride;
  for (int64_t base = x0 + int64_t{threadIdx.x} * kElementsPerThread; base < x1;
       base += kGroupStride * kStatsGroups) {
    const int32_t mark = *reinterpret_cast<const volatile int32_t*>(reject_mark);
    float v[kElementsPerThread];
    if (aligned && base + kLastGroup + kElementsPerThread <= x1) {
      Raw8<TT> t_raw[kStatsGroups];
      Raw8<DT> d_raw[kStatsGroups];
#pragma unroll
      for (int g = 0; g < kStatsGroups; ++g) {
        if (trow) issue8(trow, base + g * kGroupStride, t_raw[g]);
        if (drow) issue8(drow, base + g * kGroupStride, d_raw[g]);
      }
#pragma unroll
      for (int g = 0; g < kStatsGroups; ++g) {
        const int64_t x = base + g * kGroupStride;
        if (trow) {
          unpack8(t_raw[g], v);
          drop_disallowed8(mrow, x, x1, v);
          accumulate8(s.target, v, x, t_sum, r.inv_t);
        }
        if (drow) {
          unpack8(d_raw[g], v);
          accumulate8(s.draft, v, x, d_sum, r.inv_td);
        }
      }
    } else {  // a row past a 16-byte boundary, or the tail
#pragma unroll
      for (int g = 0; g < kStatsGroups; ++g) {
        const int64_t x = base + g * kGroupStride;
        if (trow) {
          load8(trow, x, x1, kSingleLoads, v);
          drop_disallowed8(mrow, x, x1, v);
          accumulate8(s.target, v, x, t_sum, r.inv_t);
        }
        if (drow) {
          load8(drow, x, x1, kSingleLoads, v);
          accumulate8(s.draft, v, x, d_sum, r.inv_td);
        }
      }
    }
    if (mark > abandon_above) break;
  }
  return s;
}

__device__ __forceinline__ RowPartial shfl_down(RowPartial s, int offset) {
  return RowPartial{shfl_down(s.target, offset), shfl_down(s.draft, offset)};
}

// What the emitted token is raced against: r = max(p - q, 0).
struct Proposal {
  enum Kind { kNone, kOneHot, kDistribution } kind;
  int64_t token;       // kOneHot
  SoftmaxStats stats;  // kDistribution
  float inv_t;         // kDistribution
};

// This thread's part of the exponential race over row[x0, x1). kRecut: rows past a 16-byte
// boundary are read with 16-byte loads re-cut in registers, else one element at a time (the
// statistics kernel, whose register cap the re-cut words would spill).
template <bool kRecut, typename TT, typename DT>
__device__ void thread_race(const TT* trow, const DT* drow, int64_t x0, int64_t x1,
                            const int32_t* mrow, bool filtered, FilterResult filter,
                            const SoftmaxStats& t, float inv_t, const Proposal& q, int64_t seed,
                            int64_t position, float& mass, RaceCandidate& best) {
  const auto mis = [](const void* row) {
    const int m = misalignment16(row);
    return kRecut || m == 0 ? m : kSingleLoads;
  };
  const int t_mis = mis(trow), d_mis = drow ? mis(drow) : 0;
  const float t_inv_sum = 1.f / t.sum;
  const float q_inv_sum = q.kind == Proposal::kDistribution ? 1.f / q.stats.sum : 0.f;
  for (int64_t x = x0 + int64_t{threadIdx.x} * kElementsPerThread; x < x1;
       x += int64_t{blockDim.x} * kElementsPerThread) {
    float v[kElementsPerThread], w[kElementsPerThread], u[kElementsPerThread];
    load8(trow, x, x1, t_mis, v);
    drop_disallowed8(mrow, x, x1, v);
    if (filtered) drop_filtered8(filter, t.max, inv_t, v);
    if (q.kind == Proposal::kDistribution) load8(drow, x, x1, d_mis, w);
#pragma unroll
    for (int g = 0; g < kElementsPerThread / 4; ++g) {
      const Philox4 block =
          philox_block(seed, position, kPurposeResample, static_cast<uint32_t>((x >> 2) + g));
#pragma unroll
      for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
    }
#pragma unroll
    for (int k = 0; k < kElementsPerThread; ++k) {
      // -inf (dropped) elements weigh 0 without a test: both maxima are finite here.
      const float p_x = softmax_weight(v[k], t.max, inv_t) * t_inv_sum;
      float q_x = 0.f;
      if (q.kind == Proposal::kDistribution) {
        q_x = softmax_weight(w[k], q.stats.max, q.inv_t) * q_inv_sum;
      } else if (q.kind == Proposal::kOneHot && x + k == q.token) {
        q_x = 1.f;
      }
      const float r = fmaxf(p_x - q_x, 0.f);
      mass += r;
      // E = -log1p(-u) >= u, so key = r / E <= r / u (up to an ulp or two): an element whose
      // bound is clearly below this thread's best cannot win, and skips the log and the divide.
      // Ties and near-ties are always computed, so the winner is bit-identical.
      if (r > 0.f && !(r * 1.00001f < best.key * u[k])) {
        best = better_candidate(
            best, RaceCandidate{r / exponential_from_uniform(u[k]), static_cast<int32_t>(x + k)});
      }
    }
  }
}

// Writes request b's outputs, one slot k per thread (the draft-id loads in parallel, not a chain
// in one thread); `logprob` is called by the thread of slot j only. The logprobs of the accepted
// rows k < j were written as they were decided.
template <typename Logprob>
__device__ __forceinline__ void write_outputs(const VerifyParams& p, int b, int j, int64_t token,
                                              bool valid, Logprob logprob) {
  int64_t* out = p.tokens + int64_t{b} * (p.block + 1);
  float* lp = p.logprobs ? p.logprobs + int64_t{b} * (p.block + 1) : nullptr;
  for (int k = threadIdx.x; k <= p.block; k += blockDim.x) {
    out[k] = k < j ? draft_token(p, b, k) : (k == j ? token : -1);
    if (lp && k == j) lp[k] = logprob();
    if (lp && k > j) lp[k] = -INFINITY;
  }
  if (threadIdx.x == 0) {
    p.num_accepted[b] = j;
    p.valid[b] = valid;
  }
}

// Shared memory of one block's race of one chunk, and of the merge of a request's chunks.
struct RaceShared {
  RaceCandidate candidates[32];
  float mass[32];
  int32_t claim;
  bool last;
};

// A row's result as another block of this launch published it (read through L2).
__device__ __forceinline__ RowResult load_result(const RowResult* at) {
  static_assert(sizeof(RowResult) % 4 == 0, "RowResult is copied as 32-bit words");
  RowResult out;
  const int32_t* from = reinterpret_cast<const int32_t*>(at);
  int32_t* to = reinterpret_cast<int32_t*>(&out);
#pragma unroll
  for (int i = 0; i < int{sizeof(RowResult) / 4}; ++i) to[i] = __ldcg(from + i);
  return out;
}

// Hands this block of the statistics kernel the next unraced chunk of request b's final row
// (block-uniform; -1: none left): chunks 0, 1, ... in order. Claims count past C once every chunk
// is taken; the emit kernel races the chunks past the last one taken.
__device__ __forceinline__ int claim_race_chunk(const VerifyParams& p, int b, RaceShared& sh) {
  if (threadIdx.x == 0) sh.claim = atomicAdd(p.race_claims + b, 1);
  __syncthreads();
  return sh.claim < p.num_chunks ? sh.claim : -1;
}

// Request b ended at row j (its first rejection, or its bonus row n) with result `res`, its
// target row valid: races chunk k of row j over r = max(p - q, 0) and publishes the chunk's mass
// and winner. The block that publishes the request's last chunk merges them in chunk order (so
// the outcome does not depend on which blocks raced which chunks) and writes the outputs.
template <bool kRecut, typename TT, typename DT>
__device__ void race_chunk(const VerifyParams& p, int b, const Request& r, int j,
                           const RowResult& res, int k, RaceShared& sh) {
  const bool valid = !(res.decision & kDraftInvalid);
  const SoftmaxStats& t = res.target;
  Proposal q{Proposal::kNone, -1, res.draft, r.inv_td};
  if (j < r.n && r.use_draft && res.draft.max != -INFINITY) {
    q.kind = r.draft_greedy ? Proposal::kOneHot : Proposal::kDistribution;
    q.token = res.draft.argmax;
  } else if (j < r.n && !r.use_draft && !(res.decision & kDraftInvalid)) {
    q.kind = Proposal::kOneHot;
    q.token = draft_token(p, b, j);
  }
  const TT* trow = target_row<TT>(p, r.start + j);
  const int32_t* mrow = mask_row(p, r.start + j);
  const DT* drow = q.kind == Proposal::kDistribution ? draft_row<DT>(p, b, j) : nullptr;
  const int64_t position = offset_position(r.position, 1 + j);
  const int64_t x0 = k * p.chunk, x1 = min(x0 + p.chunk, p.vocab);
  const auto merge_cand = [](RaceCandidate a, RaceCandidate s) { return better_candidate(a, s); };
  const auto add = [](float a, float s) { return a + s; };

  float mass = 0.f;
  RaceCandidate best = empty_candidate();
  thread_race<kRecut>(trow, drow, x0, x1, mrow, r.filtered, res.filter, t, r.inv_t, q, r.seed,
                      position, mass, best);
  mass = block_reduce(mass, add, 0.f, sh.mass);
  best = block_reduce(best, merge_cand, empty_candidate(), sh.candidates);
  if (threadIdx.x == 0) {
    p.race_partials[int64_t{b} * p.num_chunks + k] = RacePartial{mass, best};
    __threadfence();
    sh.last = atomicAdd(p.race_arrivals + b, 1) == p.num_chunks - 1;
  }
  __syncthreads();
  if (!sh.last) return;
  __threadfence();
  if (threadIdx.x == 0) p.race_arrivals[b] = 0;  // every chunk has arrived: back to zero
  mass = 0.f;
  best = empty_candidate();
  for (int c = threadIdx.x; c < p.num_chunks; c += blockDim.x) {
    const RacePartial* part = p.race_partials + int64_t{b} * p.num_chunks + c;
    mass += __ldcg(&part->mass);
    best = better_candidate(best,
                            RaceCandidate{__ldcg(&part->best.key), __ldcg(&part->best.index)});
  }
  mass = block_reduce(mass, add, 0.f, sh.mass);
  best = block_reduce(best, merge_cand, empty_candidate(), sh.candidates);
  if (!(mass > kMinResidualMass)) {
    // No residual mass (p <= q everywhere up to rounding): race over p itself, whole row here.
    const Proposal none{Proposal::kNone, -1, res.draft, r.inv_td};
    float unused = 0.f;
    best = empty_candidate();
    thread_race<kRecut>(trow, static_cast<const DT*>(nullptr), 0, p.vocab, mrow, r.filtered,
                        res.filter, t, r.inv_t, none, r.seed, position, unused, best);
    best = block_reduce(best, merge_cand, empty_candidate(), sh.candidates);
  }
  const bool won = best.index >= 0;  // every thread holds the block's `best`
  write_outputs(p, b, j, won ? best.index : 0, valid && won, [&] {
    return won ? logf(softmax_prob(to_float(trow[best.index]), t.max, 1.f / t.sum, r.inv_t))
               : -INFINITY;
  });
}

// Resident blocks per SM the statistics kernel is compiled for: the decider's filter code and the
// race must not cost the streaming loop its occupancy. Three on sm_90, two before (where three
// would make the race spill); two for float32 target and draft rows, whose wider loads keep twice
// the bytes in flight per thread and need the registers. The bytes-in-flight arithmetic behind
// each count: docs/performance-model.md, "Why the launch constants are what they are".
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kStatsBlocksPerSM = 2;
#else
constexpr int kStatsBlocksPerSM = 3;
#endif

template <typename TT, typename DT>
constexpr int stats_blocks_per_sm() {
  return sizeof(TT) == 4 && sizeof(DT) == 4 ? 2 : kStatsBlocksPerSM;
}

template <typename TT, typename DT>
__global__ void __launch_bounds__(kVerifyThreads, stats_blocks_per_sm<TT, DT>())
    verify_row_stats_kernel(const VerifyParams p) {
  // The emit kernel may start launching once every block has begun (it waits for this grid).
  allow_dependent_launch();
  const int b = blockIdx.y, c = blockIdx.x, rows = p.block + 1;
  const Request r = load_request(p, b);
  const int64_t x0 = c * p.chunk, x1 = min(x0 + p.chunk, p.vocab);
  const auto merge = [&](RowPartial a, RowPartial s) {
    return RowPartial{merge_stats(a.target, s.target, r.inv_t), merge_stats(a.draft, s.draft, r.inv_td)};
  };
  const RowPartial empty{empty_stats(), empty_stats()};
  __shared__ RowPartial scratch[32];
  __shared__ RowPartial merged;
  __shared__ bool stop, last;
  __shared__ RowResult decided;  // the row this block decided, for the whole block
  __shared__ int final_row;      // the request's first rejected row or n, if this block decided it
  __shared__ int race_row;       // ... or learnt it from the published rejection
  __shared__ RaceShared race;
  if (threadIdx.x == 0) final_row = -1;
  // Dynamic shared memory: sizeof(FilterShared) when the call has filters, else none.
  DSPARK_EXTERN_SHARED(unsigned char, filter_shared_raw);
  auto* const filter_shared = reinterpret_cast<FilterShared*>(filter_shared_raw);  // null: none

  for (int j = 0; j <= r.n; ++j) {
    const int64_t row = r.start + j;
    const bool row_ok = row >= 0 && row < p.target_rows;
    const bool need_draft = r.use_draft && j < r.n;
    const TT* trow = row_ok ? target_row<TT>(p, row) : nullptr;
    const int32_t* mrow = mask_row(p, row);
    const DT* drow = need_draft ? draft_row<DT>(p, b, j) : nullptr;

    // Thread 0 may decide the row: issue its loads of the draft id and the two logits at that id
    // now, so their latency hides behind the streaming pass.
    int64_t x = -1;
    float t_x = -INFINITY, d_x = -INFINITY;
    if (threadIdx.x == 0 && j < r.n) {
      x = draft_token(p, b, j);
      if (x >= 0 && x < p.vocab) {
        if (trow && allowed(mrow, x)) t_x = to_float(trow[x]);
        if (drow) d_x = to_float(drow[x]);
      }
    }

    const RowPartial mine =
        thread_row_stats(trow, mrow, drow, x0, x1, r, p.reject_marks + b, rows - j);
    const int64_t slot = int64_t{b} * rows + j;
    if (p.part_maxima && r.filtered && r.spec.top_k > 0) {  // request-uniform
      float m = mine.target.max;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      }
      if ((threadIdx.x & 31) == 0) {
        p.part_maxima[(slot * p.num_chunks + c) * kVerifyWarps + (threadIdx.x >> 5)] = m;
        __threadfence();  // published before the barrier that precedes this block's arrival
      }
    }
    const RowPartial part = block_reduce(mine, merge, empty, scratch);

    if (threadIdx.x == 0) {
      p.partials[slot * p.num_chunks + c] = part;
      __threadfence();  // publish the partial before counting this block as arrived
      last = atomicAdd(p.row_arrivals + slot, 1) == p.num_chunks - 1;
      if (last) p.row_arrivals[slot] = 0;  // every block has arrived: back to zero
      // A rejection of this row or an earlier one: stop after this row (a hint, see the header).
      stop = *reinterpret_cast<volatile int32_t*>(p.reject_marks + b) > rows - (j + 1);
    }
    __syncthreads();
    if (last) {  // block-uniform: this block decides the row
      __threadfence();
      if (threadIdx.x < 32) {
        // Merge every chunk's partial (read through L2: __ldcg).
        RowPartial m = empty;
        for (int k = threadIdx.x; k < p.num_chunks; k += 32) {
          const RowPartial* q = p.partials + slot * p.num_chunks + k;
          m = merge(m, RowPartial{
                           SoftmaxStats{__ldcg(&q->target.max), __ldcg(&q->target.sum),
                                        __ldcg(&q->target.argmax)},
                           SoftmaxStats{__ldcg(&q->draft.max), __ldcg(&q->draft.sum),
                                        __ldcg(&q->draft.argmax)}});
        }
        m = warp_reduce(m, merge);
        if (threadIdx.x == 0) merged = m;
      }
      __syncthreads();
      SoftmaxStats mt = merged.target;
      const SoftmaxStats md = merged.draft;
      FilterResult filter{-INFINITY, 0.f, mt.sum};
      if (r.filtered && row_ok && mt.max != -INFINITY) {
        const int mis = misalignment16(trow) == 0 ? 0 : kSingleLoads;
        const auto masked8 = [&](int64_t at, float (&v)[kElementsPerThread]) {
          load8(trow, at, p.vocab, mis, v);
          drop_disallowed8(mrow, at, p.vocab, v);
        };
        int parts = 0;  // the warps' maxima of every chunk: top-k's floor
        if (p.part_maxima && r.spec.top_k > 0) {
          parts = p.num_chunks * kVerifyWarps;
          const float* maxima = p.part_maxima + slot * parts;
          for (int i = threadIdx.x; i < parts; i += blockDim.x) {
            filter_shared->candidate_key[i] = logit_key(__ldcg(maxima + i));
          }
          if (threadIdx.x == 0) filter_shared->candidates = parts;
          __syncthreads();
        }
        filter = block_filter_row(masked8, p.vocab, mt.max, r.inv_t, r.spec, *filter_shared,
                                  parts);
        mt.sum = filter.kept_sum;
      }
      if (threadIdx.x == 0) {
        if (r.filtered && t_x != -INFINITY &&
            !filter_keeps(filter, finite_or_neg_inf(t_x), softmax_weight(t_x, mt.max, r.inv_t))) {
          t_x = -INFINITY;  // the filters drop the draft: p = 0
        }
        int32_t decision = kRowUndecided;
        if (!row_ok || mt.max == -INFINITY) {
          decision = int32_t{kRowRejected} | kTargetInvalid;
        } else if (j < r.n) {
          if (x < 0 || x >= p.vocab || (need_draft && md.max == -INFINITY)) {
            decision = int32_t{kRowRejected} | kDraftInvalid;
          } else if (r.greedy) {
            decision = x == mt.argmax ? kRowAccepted : kRowRejected;
          } else {
            const float p_x = softmax_prob(t_x, mt.max, 1.f / mt.sum, r.inv_t);
            float q_x = 1.f;
            if (need_draft) {
              q_x = r.draft_greedy ? (x == md.argmax ? 1.f : 0.f)
                                   : softmax_prob(d_x, md.max, 1.f / md.sum, r.inv_td);
            }
            const int64_t draw_at = offset_position(r.position, 1 + j);
            const float u = philox_uniform(r.seed, draw_at, kPurposeAccept, 0);
            decision = accept_draft(u, p_x, q_x) ? kRowAccepted : kRowRejected;
          }
        }
        decided = RowResult{mt, md, decision, filter};
        p.results[slot] = decided;
        if (p.logprobs && decision == kRowAccepted) {
          p.logprobs[slot] = logf(softmax_prob(t_x, mt.max, 1.f / mt.sum, r.inv_t));
        }
        if (decision & kRowRejected) {
          __threadfence();  // the result is visible before the rejection that points to it
          atomicMax(p.reject_marks + b, rows - j);
          stop = true;
        }
        if ((decision & kRowRejected) || j == r.n) {
          final_row = j;
          p.final_rows[b] = j;
        }
      }
    }
    __syncthreads();  // `stop`, `last` and `scratch` are rewritten for the next row
    if (stop) break;
  }

  // final_row >= 0: this block decided the request's final row (`decided`).
  const int decided_row = final_row;
  if (decided_row >= 0 && (r.greedy || (decided.decision & kTargetInvalid))) {
    // Nothing to race: the emitted token is the argmax (greedy) or 0 (no valid target row).
    const SoftmaxStats t = decided.target;
    const bool target_invalid = decided.decision & kTargetInvalid;
    write_outputs(p, b, decided_row, target_invalid ? 0 : t.argmax,
                  !(decided.decision & (kTargetInvalid | kDraftInvalid)), [&] {
                    return target_invalid ? -INFINITY
                                          : logf(softmax_prob(t.max, t.max, 1.f / t.sum, r.inv_t));
                  });
    return;
  }
  // A sampled request's final row is raced chunk by chunk by the blocks that know it (the one
  // that decided it, and those that saw the rejection), one chunk each, right after streaming
  // it (from L2, typically); verify_emit_kernel takes the chunks left over.
  if (r.greedy) return;  // request-uniform
  if (threadIdx.x == 0) {
    int j = decided_row;
    if (j < 0) {
      const int32_t mark = *reinterpret_cast<const volatile int32_t*>(p.reject_marks + b);
      if (mark > 0) {
        __threadfence();  // the mark was published after the result it points to
        j = min(rows - mark, r.n);
      }
    }
    race_row = j;
  }
  __syncthreads();
  const int j = race_row;
  if (j < 0) return;
  const RowResult res = load_result(p.results + int64_t{b} * rows + j);
  if (res.decision & kTargetInvalid) return;  // written by its decider
  const int k = claim_race_chunk(p, b, race);
  if (k >= 0) race_chunk</*kRecut=*/false, TT, DT>(p, b, r, j, res, k, race);
}

// Races what is left of each sampled request's final row: the chunks the statistics kernel did not
// take (typically those of requests that accepted every draft, whose other blocks had finished
// before the bonus row was decided). Its claims handed out chunks 0, 1, ... in order, so block c
// races chunk c if c is past them. Also returns the counters the statistics kernel leaves set to
// zero: the rejection mark, the arrivals at rows past j* (blocks that had moved on), the claims.
// Three blocks per SM, as the statistics kernel (without a minimum, ptxas capped the registers at
// 64 and spilled).
template <typename TT, typename DT>
__global__ void __launch_bounds__(kVerifyThreads, 3) verify_emit_kernel(const VerifyParams p) {
  const int b = blockIdx.y, c = blockIdx.x, rows = p.block + 1;
  const Request r = load_request(p, b);  // inputs only: may precede the wait
  // Launched dependent: the statistics kernel may still run until this returns.
  wait_for_previous_grid();
  const int j = p.final_rows[b];
  if (c == 0) {
    for (int k = j + 1 + threadIdx.x; k < rows; k += blockDim.x) {
      p.row_arrivals[int64_t{b} * rows + k] = 0;
    }
    if (threadIdx.x == 0) p.reject_marks[b] = 0;
  }
  if (r.greedy) return;  // written by the block that decided the final row
  const RowResult res = p.results[int64_t{b} * rows + j];
  if (res.decision & kTargetInvalid) return;  // written too; no block claimed a chunk
  __shared__ RaceShared sh;
  if (threadIdx.x == 0) {
    sh.claim = p.race_claims[b];
    __threadfence();  // read before this block counts as arrived
    if (atomicAdd(p.emit_arrivals + b, 1) == p.num_chunks - 1) {  // every block has read it
      __threadfence();
      p.race_claims[b] = 0;
      p.emit_arrivals[b] = 0;
    }
  }
  __syncthreads();
  if (c >= sh.claim) race_chunk</*kRecut=*/true, TT, DT>(p, b, r, j, res, c, sh);
}

// Dynamic shared memory of the statistics kernel: the filters' histograms, when the call has any.
inline int verify_shared_bytes(bool filters) { return filters ? int{sizeof(FilterShared)} : 0; }

}  // namespace dspark_ops::kernels
