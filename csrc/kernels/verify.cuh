// CUDA kernels of verify (docs/semantics.md §3.1), torch-free.
//
// Math: kernels/sampling_math.h (shared with the CPU kernel). Input contract: VerifyParams below;
// the ATen glue in cuda/verify_cuda.cpp checks shapes, dtypes and devices. Values are not trusted:
// out-of-range rows and draft ids are rejected and reported, never used as addresses.
//
// Geometry: the vocabulary of each request is split into C chunks, C a function of V alone
// (verify_num_chunks: at most 16; one block per request, as FlashInfer's chain kernel does,
// cannot reach HBM bandwidth at B <= 132). Row j's accept test needs only row j's statistics and
// its own uniform, so rows are decided independently and the first rejected row is the minimum
// over the rejected ones. Blocks never wait for each other, so no co-residency is needed. Two
// launches, no host work in between:
//
//  1. verify_row_stats_kernel, grid (B * C, G + 1): block (b * C + c, j) is the item (row j of
//     request b, chunk c). Blocks start in the order of their index, x fastest, so row j of every
//     request is streamed before row j + 1 of any (row-major): by the time a request's row j + 1
//     starts, its row j has mostly been decided. An item reads the target row over its chunk in
//     one loop, its loads issued in groups before any is used (when the draft is a distribution,
//     both rows through a per-thread cp.async ring in shared memory, a chunk's next iterations in
//     flight while one is folded), and publishes partial softmax statistics (max, sum of weights,
//     argmax) with one release/acquire arrival atomic. The last block to arrive at a row (the CUDA
//     "threadFenceReduction" pattern, without the fence) merges the C partials in chunk order and
//     decides the row; a rejection raises the request's mark (the largest G + 1 - j over its
//     rejected rows). An item of a row past a published rejection is skipped, and a block
//     streaming one polls the mark and abandons it part-way; whatever happens to a row past the
//     first rejection is never used, so reading the mark late only costs bandwidth. Every row up
//     to the first rejection is always decided, since nothing skips or abandons it.
//  2. verify_emit_kernel, grid (C, B): the final row j* of each request is the first rejected
//     row (from the mark) or the bonus row n. A greedy request's block 0 writes the argmax of row
//     j*. A sampled request's token is drawn by the exponential race over r = max(p - q, 0) on row
//     j*, split into the C chunks: block c races chunk c (its rows through a per-thread cp.async
//     ring, as the statistics pass's), and the block that publishes the last chunk merges them
//     in chunk order and writes the outputs. It also returns to zero the
//     counters the statistics kernel leaves set (every counter's last user resets it, so the
//     counters need no fill before a call: common/stream_counters.h keeps one buffer per
//     stream). It is a dependent launch (launch.cuh): on sm_90 its blocks start as the statistics
//     kernel's last ones finish and wait for that grid to complete, instead of paying a launch
//     after it; that wait also makes every decision visible, so the mark needs no fence.
//
// Sampling filters: the allowed-token bitmask is applied as the rows stream in (one 32-bit word
// per 32 elements). A request with top-k / top-p / min-p has its filters computed by the block
// that decides the row (kernels/filter.cuh), for the rows the decision needs only; the row's
// result carries the threshold and the kept weight, so the acceptance test, the race and the
// logprobs use the processed distribution. With top-k <= kVerifyTopK every item of the row also
// publishes its chunk's floor (at or below the row's k-th largest logit) and the keys of its
// tokens at or above it (ChunkFloor: read again from L2 right after the streaming pass), and the
// decider runs the thresholds' radix digits on those lists on chip, reading nothing of the row;
// a list that overflows, or 64 < k <= kVerifyFloorK (floors only), costs it one gather from the
// row from the highest floor; larger k, top-p or min-p alone, a radix descent over the row (at
// most seven passes through L2). Dynamic shared memory: the ring with draft rows, then in the
// deciding block FilterShared when a filter is given (the same bytes, the larger of the two).
//
// Each element of a needed row is read once from HBM; the race reads row j* of a sampled request
// again. Chunks start at multiples of 16 elements, so rows whose
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
#include <cuda/atomic>

#include "async_copy.cuh"
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
// Groups of 8 elements per thread in one iteration of the statistics pass: with a draft row, an
// iteration is one stage of the ring (kMaxVerifyStages), three groups of both rows (two when one
// row is 16-bit and the other float32: 96 bytes a thread, 24 KB a block per stage); without one,
// the target row's loads are issued in registers before any is used, about 80 bytes: five groups
// of a 16-bit row, which cover a 9,504-element chunk (V = 151,936) in one iteration, one HBM wait
// per item; two of a float32 row.
constexpr int kStatsGroups = 3;
constexpr int kMixedStatsGroups = 2;
constexpr int kTargetGroups = 5;

template <typename TT>
constexpr int target_groups() {
  return sizeof(TT) == 2 ? kTargetGroups : kTargetGroups * 2 / 4;
}

template <typename TT, typename DT>
constexpr int stats_groups() {
  return sizeof(TT) != sizeof(DT) && sizeof(TT) + sizeof(DT) == 6 ? kMixedStatsGroups
                                                                  : kStatsGroups;
}

// With a draft row the statistics pass streams both rows through a ring in dynamic shared memory
// (stream_rows_staged): each thread copies (cp.async) its groups' 16-byte words up to
// VerifyParams::stages iterations ahead of their use into slots that only it reads, so no
// registers hold loads in flight, nothing waits for another thread, and a chunk's next iterations
// load while this one is folded. The launcher takes the most stages (up to the iterations a chunk
// needs, at most kMaxVerifyStages) that cost the kernel no resident block: a 9,504-element chunk
// of bf16 target and float32 draft rows is three iterations, 72 KB a block.
constexpr int kMaxVerifyStages = 4;

// 16-byte words of one ring stage per thread: one iteration, stats_groups() groups of both rows.
template <typename TT, typename DT>
constexpr int ring_stage_words() {
  return stats_groups<TT, DT>() * kElementsPerThread * int{sizeof(TT) + sizeof(DT)} / 16;
}

template <typename TT, typename DT>
constexpr int ring_stage_bytes() {
  return ring_stage_words<TT, DT>() * 16 * kVerifyThreads;
}

// Iterations of the ring's stream over a chunk of `chunk` elements.
template <typename TT, typename DT>
constexpr int64_t ring_iterations(int64_t chunk) {
  const int64_t per_iteration = int64_t{kVerifyThreads} * kElementsPerThread * stats_groups<TT, DT>();
  return (chunk + per_iteration - 1) / per_iteration;
}

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

// Top-k's candidates (see the file header). An item of a row with top-k <= kVerifyFloorK
// publishes its chunk's floor: each warp's ceil(k / kVerifyWarps)-th largest thread maximum,
// the least over the warps (a bitonic sort of a warp's 32 maxima and one barrier): kVerifyWarps
// warps then hold that many distinct threads' maxima at or above it, so the chunk has at least k
// tokens there, and its k-th largest, a floor under the row's k-th largest, is not below it.
// With top-k <= kVerifyTopK the item also keeps its chunk's tokens at or above the floor (their
// keys; a key gives the logit and hence the weight, and the filters need no index), at most
// kChunkCandidates of them: for normal logits about 2k at k = 50 (100 at k = 50, 115 at k = 64
// on average, 190 at most in 300 draws of 9,496 bf16 logits), so an overflow, which sends the
// row back to a gather from the row, is rare. Larger k keeps the floor only: more tokens than
// the list holds would qualify.
constexpr int kVerifyTopK = 64;
constexpr int kChunkCandidates = 256;
constexpr int kVerifyFloorK = kVerifyWarps * 32;
constexpr int kCandidateBatch = 8;  // the decider's loads of the lists issued before any is used

struct ChunkFloor {
  uint32_t floor;  // a key (logit_key) at or below the chunk's k-th largest
  uint32_t count;  // the chunk's tokens at or above it (kept: the first kChunkCandidates)
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

// A relaxed read of request b's rejection mark, which is zero when the call starts and only
// grows: a late value only costs bandwidth (rows past the first rejection are never used). The
// emulator can return the launch-start value (zero) to every read, as blocks that all run at
// once may see: the outputs must not change.
__device__ __forceinline__ int32_t poll_mark(const int32_t* mark) {
#if defined(DSPARK_OPS_SIM)
  return ::dspark_sim::poll_counter(DSPARK_SIM_SITE, mark);
#else
  return *reinterpret_cast<const volatile int32_t*>(mark);
#endif
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

// This thread's statistics of the target row over [x0, x1) (no draft row), in iterations of
// kGroups groups of 8 elements whose 16-byte loads are all issued before any is used (one HBM
// wait per iteration; the chunk's tail too, where whole 16-byte words remain; only elements past
// a 16-byte boundary are read one at a time). Group g of an iteration is 8 elements at
// base + g * kGroupStride: a warp's 16-byte loads cover 512 contiguous bytes (whole sectors).
// Every thread folds its groups in the order of their index whatever kGroups is, so the sums do
// not depend on how many groups are in flight. Stops early once `*reject_mark` exceeds
// `abandon_above` (an earlier row was rejected, so this row is not needed); the poll is issued
// at the top of an iteration and used at its end, so its latency hides behind the row's.
template <int kGroups, typename TT>
__device__ __forceinline__ void stream_target_row(const TT* trow, const int32_t* mrow, int64_t x0,
                                                  int64_t x1, const Request& r,
                                                  const int32_t* reject_mark,
                                                  int32_t abandon_above, SoftmaxStats& s) {
  const bool t_sum = r.need_distribution;
  const bool aligned = (reinterpret_cast<uintptr_t>(trow) & 15) == 0;
  // blockDim.x is kVerifyThreads: constant strides keep registers free under the cap.
  constexpr int64_t kGroupStride = int64_t{kVerifyThreads} * kElementsPerThread;
  for (int64_t base = x0 + int64_t{threadIdx.x} * kElementsPerThread; base < x1;
       base += kGroupStride * kGroups) {
    const int32_t mark = poll_mark(reject_mark);
    Raw8<TT> t_raw[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = base + g * kGroupStride;
      if (aligned && x + kElementsPerThread <= x1) issue8(trow, x, t_raw[g]);
    }
    float v[kElementsPerThread];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = base + g * kGroupStride;
      if (x >= x1) break;  // the groups past the end would add nothing
      if (aligned && x + kElementsPerThread <= x1) {
        unpack8(t_raw[g], v);
      } else {
        load8(trow, x, x1, kSingleLoads, v);
      }
      drop_disallowed8(mrow, x, x1, v);
      accumulate8(s, v, x, t_sum, r.inv_t);
    }
    if (mark > abandon_above) break;
  }
}

// This thread's statistics of the target row (if any) and the draft row over [x0, x1): the same
// groups, folded in the same order as stream_target_row folds them, but each group's 16-byte
// words of both rows arrive through this thread's ring (a ThreadRing, async_copy.cuh; see
// kMaxVerifyStages): iteration i's copies are issued at iteration i - stages + 1 and waited for
// at iteration i.
// Groups without whole 16-byte words (a chunk's tail, rows past a 16-byte boundary) are read one
// element at a time when folded. Every copy has landed when this returns (the deciding block
// reuses the ring's shared memory for the filters).
template <int kGroups, typename TT, typename DT>
__device__ __forceinline__ void stream_rows_staged(const TT* trow, const int32_t* mrow,
                                                   const DT* drow, int64_t x0, int64_t x1,
                                                   const Request& r, const int32_t* reject_mark,
                                                   int32_t abandon_above, int stages, uint4* ring,
                                                   RowPartial& s) {
  const bool t_sum = r.need_distribution, d_sum = !r.draft_greedy;
  const bool aligned = ((reinterpret_cast<uintptr_t>(trow) | reinterpret_cast<uintptr_t>(drow)) &
                        15) == 0;
  constexpr int64_t kGroupStride = int64_t{kVerifyThreads} * kElementsPerThread;
  constexpr int64_t kIteration = kGroupStride * kGroups;
  constexpr int kTargetWords = kElementsPerThread * int{sizeof(TT)} / 16;
  constexpr int kDraftWords = kElementsPerThread * int{sizeof(DT)} / 16;
  constexpr int kGroupWords = kTargetWords + kDraftWords;
  static_assert(kGroups * kGroupWords == ring_stage_words<TT, DT>());
  ThreadRing<kGroups * kGroupWords, kVerifyThreads, kMaxVerifyStages> staged(ring, stages);
  const int64_t first = x0 + int64_t{threadIdx.x} * kElementsPerThread;
  int64_t ahead = first;  // the next iteration to issue
  const auto issue = [&] {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = ahead + g * kGroupStride;
      if (!aligned || x + kElementsPerThread > x1) continue;
      if (trow) {
#pragma unroll
        for (int h = 0; h < kTargetWords; ++h) {
          staged.copy(g * kGroupWords + h, reinterpret_cast<const uint4*>(trow + x) + h);
        }
      }
#pragma unroll
      for (int h = 0; h < kDraftWords; ++h) {
        staged.copy(g * kGroupWords + kTargetWords + h,
                    reinterpret_cast<const uint4*>(drow + x) + h);
      }
    }
    staged.commit();  // empty past the chunk
    ahead += kIteration;
  };
  for (int k = 1; k < stages; ++k) issue();
  for (int64_t base = first; base < x1; base += kIteration) {
    const int32_t mark = poll_mark(reject_mark);
    issue();  // stages - 1 iterations after this one
    const uint4* const stage = staged.next();
    float v[kElementsPerThread];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = base + g * kGroupStride;
      if (x >= x1) break;  // the groups past the end would add nothing
      const bool vector = aligned && x + kElementsPerThread <= x1;
      if (trow) {
        if (vector) {
          Raw8<TT> raw;
#pragma unroll
          for (int h = 0; h < kTargetWords; ++h) {
            raw.word[h] = staged.word(stage, g * kGroupWords + h);
          }
          unpack8(raw, v);
        } else {
          load8(trow, x, x1, kSingleLoads, v);
        }
        drop_disallowed8(mrow, x, x1, v);
        accumulate8(s.target, v, x, t_sum, r.inv_t);
      }
      if (vector) {
        Raw8<DT> raw;
#pragma unroll
        for (int h = 0; h < kDraftWords; ++h) {
          raw.word[h] = staged.word(stage, g * kGroupWords + kTargetWords + h);
        }
        unpack8(raw, v);
      } else {
        load8(drow, x, x1, kSingleLoads, v);
      }
      accumulate8(s.draft, v, x, d_sum, r.inv_td);
    }
    if (mark > abandon_above) break;
  }
  staged.drain();
}

// This thread's statistics of the target row and (if drow) the draft row over [x0, x1): both
// rows through the ring, or, without a draft row, more of the target row's loads in flight in
// registers.
template <typename TT, typename DT>
__device__ RowPartial thread_row_stats(const TT* trow, const int32_t* mrow, const DT* drow,
                                       int64_t x0, int64_t x1, const Request& r,
                                       const int32_t* reject_mark, int32_t abandon_above,
                                       int stages, uint4* ring) {
  RowPartial s{empty_stats(), empty_stats()};
  if (drow) {
    stream_rows_staged<stats_groups<TT, DT>()>(trow, mrow, drow, x0, x1, r, reject_mark,
                                               abandon_above, stages, ring, s);
  } else if (trow) {
    stream_target_row<target_groups<TT>()>(trow, mrow, x0, x1, r, reject_mark, abandon_above,
                                           s.target);
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

// The race's ring (race_chunk): a stage is one iteration of a thread's race, 8 elements of the
// target row and of the draft row (when it is raced against), 48 bytes a thread for a bf16
// target with a float32 draft, 12 KB a block; a 9,504-element chunk is five iterations. A
// ThreadRing (async_copy.cuh) like the statistics pass's: each thread copies its own words ahead
// of their use and reads them back, no barrier; the launcher plans the depth
// (VerifyParams::race_stages).
constexpr int kMaxRaceStages = 8;
// Resident blocks per SM the emit kernel is compiled for (without a minimum, ptxas capped the
// registers at 64 and spilled), and which the launcher sizes the race's ring to keep.
constexpr int kEmitBlocksPerSM = 3;

template <typename TT, typename DT>
constexpr int race_stage_words() {
  return kElementsPerThread * int{sizeof(TT) + sizeof(DT)} / 16;
}

template <typename TT, typename DT>
constexpr int race_stage_bytes() {
  return race_stage_words<TT, DT>() * 16 * kVerifyThreads;
}

// Iterations of a thread's race over a chunk of `chunk` elements.
constexpr int64_t race_iterations(int64_t chunk) {
  const int64_t per_iteration = int64_t{kVerifyThreads} * kElementsPerThread;
  return (chunk + per_iteration - 1) / per_iteration;
}

// This thread's part of the exponential race over row[x0, x1). Rows that start on 16-byte
// boundaries stream through the race's ring of `stages` iterations (`ring`: dynamic shared
// memory, every copy landed when this returns); rows past a boundary are read in registers, as
// 16-byte loads re-cut (kRecut) or one element at a time. Either way a thread races the same
// elements in the same order with the same values.
template <bool kRecut, typename TT, typename DT>
__device__ void thread_race(const TT* trow, const DT* drow, int64_t x0, int64_t x1,
                            const int32_t* mrow, bool filtered, FilterResult filter,
                            const SoftmaxStats& t, float inv_t, const Proposal& q, int64_t seed,
                            int64_t position, int stages, uint4* ring, float& mass,
                            RaceCandidate& best) {
  const auto mis = [](const void* row) {
    const int m = misalignment16(row);
    return kRecut || m == 0 ? m : kSingleLoads;
  };
  const bool with_q = q.kind == Proposal::kDistribution;
  const int t_mis = mis(trow), d_mis = with_q ? mis(drow) : 0;
  const float t_inv_sum = 1.f / t.sum;
  const float q_inv_sum = with_q ? 1.f / q.stats.sum : 0.f;
  // Races elements [x, x + 8): v the target's logits, w the draft's (with_q).
  const auto race8 = [&](int64_t x, float (&v)[kElementsPerThread],
                         const float (&w)[kElementsPerThread]) {
    drop_disallowed8(mrow, x, x1, v);
    if (filtered) drop_filtered8(filter, t.max, inv_t, v);
    float u[kElementsPerThread];
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
      if (with_q) {
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
  };
  constexpr int64_t kStride = int64_t{kVerifyThreads} * kElementsPerThread;
  const int64_t first = x0 + int64_t{threadIdx.x} * kElementsPerThread;
  if (t_mis != 0 || d_mis != 0) {
    for (int64_t x = first; x < x1; x += kStride) {
      float v[kElementsPerThread], w[kElementsPerThread];
      load8(trow, x, x1, t_mis, v);
      if (with_q) load8(drow, x, x1, d_mis, w);
      race8(x, v, w);
    }
    return;
  }
  constexpr int kTargetWords = kElementsPerThread * int{sizeof(TT)} / 16;
  constexpr int kDraftWords = kElementsPerThread * int{sizeof(DT)} / 16;
  ThreadRing<race_stage_words<TT, DT>(), kVerifyThreads, kMaxRaceStages> staged(ring, stages);
  int64_t ahead = first;  // the next iteration to issue
  const auto issue = [&] {
    if (ahead + kElementsPerThread <= x1) {
#pragma unroll
      for (int h = 0; h < kTargetWords; ++h) {
        staged.copy(h, reinterpret_cast<const uint4*>(trow + ahead) + h);
      }
      if (with_q) {
#pragma unroll
        for (int h = 0; h < kDraftWords; ++h) {
          staged.copy(kTargetWords + h, reinterpret_cast<const uint4*>(drow + ahead) + h);
        }
      }
    }
    staged.commit();  // empty past the whole words
    ahead += kStride;
  };
  for (int k = 1; k < stages; ++k) issue();
  for (int64_t x = first; x < x1; x += kStride) {
    issue();  // stages - 1 iterations after this one
    const uint4* const stage = staged.next();
    float v[kElementsPerThread], w[kElementsPerThread];
    if (x + kElementsPerThread <= x1) {
      Raw8<TT> t_raw;
#pragma unroll
      for (int h = 0; h < kTargetWords; ++h) t_raw.word[h] = staged.word(stage, h);
      unpack8(t_raw, v);
      if (with_q) {
        Raw8<DT> d_raw;
#pragma unroll
        for (int h = 0; h < kDraftWords; ++h) d_raw.word[h] = staged.word(stage, kTargetWords + h);
        unpack8(d_raw, w);
      }
    } else {  // the row's last elements: one at a time
      load8(trow, x, x1, 0, v);
      if (with_q) load8(drow, x, x1, 0, w);
    }
    race8(x, v, w);
  }
  staged.drain();
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

// The chunk's floor for top-k (see ChunkFloor) from each thread's maximum, by the whole block;
// also sets `count` to zero for gather_candidates (one barrier before both are used).
__device__ __forceinline__ uint32_t chunk_floor(float thread_max, int top_k,
                                                uint32_t (&warp_floor)[kVerifyWarps],
                                                uint32_t& count) {
  uint32_t key = logit_key(thread_max);  // a thread without a finite logit: below them all
  const int lane = threadIdx.x & 31;
  // Bitonic sort of the warp's keys, largest first.
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, key, stride);
      const bool keep_max = ((lane & stride) == 0) == ((lane & size) == 0);
      key = keep_max ? max(key, other) : min(key, other);
    }
  }
  const int j = (top_k + kVerifyWarps - 1) / kVerifyWarps;  // 1..32
  const uint32_t jth = __shfl_sync(0xffffffffu, key, j - 1);
  if (lane == 0) warp_floor[threadIdx.x >> 5] = jth;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  uint32_t floor = warp_floor[0];
#pragma unroll
  for (int w = 1; w < kVerifyWarps; ++w) floor = min(floor, warp_floor[w]);
  return floor;
}

// Appends this thread's allowed tokens of trow[x0, x1) whose keys are at or above `floor` to
// out[0, kChunkCandidates) (slots from `count`, a shared counter; past the end only counted).
// The chunk was just streamed, so it comes from L1/L2; its loads are issued in groups as the
// streaming pass issues them (one wait for a bf16 chunk at V = 151,936).
template <int kGroups, typename TT>
__device__ __forceinline__ void gather_candidates(const TT* trow, const int32_t* mrow, int64_t x0,
                                                  int64_t x1, uint32_t floor, uint32_t* out,
                                                  uint32_t& count) {
  const float low = key_logit(floor);  // keys and logits order alike (-0 keys as +0)
  const bool aligned = (reinterpret_cast<uintptr_t>(trow) & 15) == 0;
  constexpr int64_t kGroupStride = int64_t{kVerifyThreads} * kElementsPerThread;
  for (int64_t base = x0 + int64_t{threadIdx.x} * kElementsPerThread; base < x1;
       base += kGroupStride * kGroups) {
    Raw8<TT> raw[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = base + g * kGroupStride;
      if (aligned && x + kElementsPerThread <= x1) issue8(trow, x, raw[g]);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t x = base + g * kGroupStride;
      if (x >= x1) break;
      float v[kElementsPerThread];
      if (aligned && x + kElementsPerThread <= x1) {
        unpack8(raw[g], v);
      } else {
        load8(trow, x, x1, kSingleLoads, v);
      }
      drop_disallowed8(mrow, x, x1, v);
#pragma unroll
      for (int k = 0; k < kElementsPerThread; ++k) {
        if (v[k] != -INFINITY && v[k] >= low) {
          const uint32_t i = atomicAdd(&count, 1u);
          if (i < kChunkCandidates) out[i] = logit_key(v[k]);
        }
      }
    }
  }
}

// Shared memory of one block's race of one chunk, and of the merge of a request's chunks.
struct RaceShared {
  RaceCandidate candidates[32];
  float mass[32];
  int32_t final_row;
  bool last;
};

// Counts a block as arrived at `counter` (thread 0): a release of what the block wrote before
// its last barrier, and an acquire of what the blocks that arrived earlier released, in one
// atomic (atom.acq_rel.gpu) instead of a sequentially consistent __threadfence and a relaxed
// atomic. Returns the blocks that arrived before this one.
__device__ __forceinline__ int32_t arrive(int32_t* counter) {
  return cuda::atomic_ref<int32_t, cuda::thread_scope_device>(*counter).fetch_add(
      1, cuda::memory_order_acq_rel);
}

// Returns request b's counters to zero once nothing of this call reads them any more: the
// rejection mark and the arrivals at rows past the final row j (rows whose blocks stopped or
// were skipped after the rejection; the decider of every completed row reset its own).
__device__ __forceinline__ void reset_request_counters(const VerifyParams& p, int b, int j) {
  const int rows = p.block + 1;
  for (int k = j + 1 + threadIdx.x; k < rows; k += blockDim.x) {
    p.row_arrivals[int64_t{b} * rows + k] = 0;
  }
  if (threadIdx.x == 0) p.reject_marks[b] = 0;
}

// The outputs of a request whose final row j needs no race: a greedy request (the row's argmax)
// or a row without a valid target (0, reported invalid).
__device__ __forceinline__ void write_unraced(const VerifyParams& p, int b, const Request& r,
                                              int j, const RowResult& res) {
  const SoftmaxStats t = res.target;
  const bool target_invalid = res.decision & kTargetInvalid;
  write_outputs(p, b, j, target_invalid ? 0 : t.argmax,
                !(res.decision & (kTargetInvalid | kDraftInvalid)), [&] {
                  return target_invalid ? -INFINITY
                                        : logf(softmax_prob(t.max, t.max, 1.f / t.sum, r.inv_t));
                });
}

// Sampled request b ended at row j (its first rejection, or its bonus row n) with result `res`:
// block k races chunk k of row j over r = max(p - q, 0) (nothing when the row has no valid
// target) and publishes the chunk's mass and winner. The block that publishes the request's last
// chunk merges them in chunk order and writes the outputs, and returns the request's counters to
// zero (every block of the request has read the mark by then).
template <bool kRecut, typename TT, typename DT>
__device__ void race_chunk(const VerifyParams& p, int b, const Request& r, int j,
                           const RowResult& res, int k, RaceShared& sh, uint4* ring) {
  const bool target_valid = !(res.decision & kTargetInvalid);
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
  if (target_valid) {  // request-uniform
    thread_race<kRecut>(trow, drow, x0, x1, mrow, r.filtered, res.filter, t, r.inv_t, q, r.seed,
                        position, p.race_stages, ring, mass, best);
    mass = block_reduce(mass, add, 0.f, sh.mass);
    best = block_reduce(best, merge_cand, empty_candidate(), sh.candidates);
  }
  if (threadIdx.x == 0) {
    p.race_partials[int64_t{b} * p.num_chunks + k] = RacePartial{mass, best};
    sh.last = arrive(p.race_arrivals + b) == p.num_chunks - 1;
  }
  __syncthreads();
  if (!sh.last) return;
  if (threadIdx.x == 0) p.race_arrivals[b] = 0;  // every chunk has arrived: back to zero
  reset_request_counters(p, b, j);
  if (!target_valid) {
    write_unraced(p, b, r, j, res);
    return;
  }
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
                        res.filter, t, r.inv_t, none, r.seed, position, p.race_stages, ring,
                        unused, best);
    best = block_reduce(best, merge_cand, empty_candidate(), sh.candidates);
  }
  const bool won = best.index >= 0;  // every thread holds the block's `best`
  write_outputs(p, b, j, won ? best.index : 0, valid && won, [&] {
    return won ? logf(softmax_prob(to_float(trow[best.index]), t.max, 1.f / t.sum, r.inv_t))
               : -INFINITY;
  });
}

// Resident blocks per SM the statistics kernel is compiled for on a GPU of compute capability
// `major` (its register cap), and which the launcher sizes the ring to keep (plan_verify_rings):
// the decider's filter code must not cost the streaming loop its occupancy. Three on sm_90, two
// before; two for float32 target and draft rows, whose wider groups need the registers. The
// arithmetic behind each count: docs/performance-model.md, "Why the launch constants are what
// they are".
template <typename TT, typename DT>
constexpr int stats_blocks_per_sm(int major) {
  return (sizeof(TT) == 4 && sizeof(DT) == 4) || major < 9 ? 2 : 3;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kStatsArchMajor = 8;
#else
constexpr int kStatsArchMajor = 9;
#endif

// The count of the code being compiled (the kernel's __launch_bounds__).
template <typename TT, typename DT>
constexpr int stats_blocks_per_sm() {
  return stats_blocks_per_sm<TT, DT>(kStatsArchMajor);
}

// Block (b * C + c, j) streams chunk c of row j of request b and publishes its partial; the
// last of the row's C blocks to arrive merges them and decides the row. See the file header.
template <typename TT, typename DT>
__global__ void __launch_bounds__(kVerifyThreads, stats_blocks_per_sm<TT, DT>())
    verify_row_stats_kernel(const VerifyParams p) {
  // The emit kernel may start launching once every block has begun (it waits for this grid).
  allow_dependent_launch();
  const int j = blockIdx.y, rows = p.block + 1;
  const int b = blockIdx.x / p.num_chunks, c = blockIdx.x - b * p.num_chunks;
  const Request r = load_request(p, b);
  if (j > r.n) return;  // request-uniform: the request has no such row
  const auto merge = [&](RowPartial a, RowPartial s) {
    return RowPartial{merge_stats(a.target, s.target, r.inv_t), merge_stats(a.draft, s.draft, r.inv_td)};
  };
  const RowPartial empty{empty_stats(), empty_stats()};
  __shared__ RowPartial scratch[32];
  __shared__ RowPartial merged;
  __shared__ bool skip, last;
  // Dynamic shared memory (verify_shared_bytes): the ring while the rows stream (with a draft
  // row), then in the deciding block the filters' FilterShared (with filters).
  DSPARK_EXTERN_SHARED(unsigned char, shared_raw);
  auto* const filter_shared = reinterpret_cast<FilterShared*>(shared_raw);
  uint4* const ring = reinterpret_cast<uint4*>(shared_raw);

  const int64_t row = r.start + j;
  const bool row_ok = row >= 0 && row < p.target_rows;
  const bool need_draft = r.use_draft && j < r.n;
  const TT* trow = row_ok ? target_row<TT>(p, row) : nullptr;
  const int32_t* mrow = mask_row(p, row);
  const DT* drow = need_draft ? draft_row<DT>(p, b, j) : nullptr;

  // Thread 0 may decide the row: issue its loads of the draft id and the two logits at that id
  // now, so their latency hides behind the streaming pass. It also reads the request's mark: an
  // earlier row already rejected makes this row unneeded (one thread reads it, so the whole block
  // skips or none of it does).
  int64_t x = -1;
  float t_x = -INFINITY, d_x = -INFINITY;
  if (threadIdx.x == 0) {
    skip = poll_mark(p.reject_marks + b) > rows - j;
    if (j < r.n) {
      x = draft_token(p, b, j);
      if (x >= 0 && x < p.vocab) {
        if (trow && allowed(mrow, x)) t_x = to_float(trow[x]);
        if (drow) d_x = to_float(drow[x]);
      }
    }
  }
  __syncthreads();
  if (skip) return;

  const int64_t x0 = c * p.chunk, x1 = min(x0 + p.chunk, p.vocab);
  const RowPartial mine =
      thread_row_stats(trow, mrow, drow, x0, x1, r, p.reject_marks + b, rows - j, p.stages, ring);
  const int64_t slot = int64_t{b} * rows + j;
  // Top-k's floor and candidates of this chunk (ChunkFloor), published by thread 0's arrival
  // below, after the reduction's barriers.
  __shared__ uint32_t warp_floor[kVerifyWarps];
  __shared__ uint32_t kept;
  const bool floors = p.chunk_floors && r.filtered && r.spec.top_k > 0 &&
                      r.spec.top_k <= kVerifyFloorK;  // request-uniform
  const bool candidates = floors && p.candidates && r.spec.top_k <= kVerifyTopK;
  uint32_t floor = 0;
  if (floors) {
    floor = chunk_floor(mine.target.max, r.spec.top_k, warp_floor, kept);
    if (candidates && trow) {  // block-uniform
      gather_candidates<target_groups<TT>()>(
          trow, mrow, x0, x1, floor, p.candidates + (slot * p.num_chunks + c) * kChunkCandidates,
          kept);
    }
  }
  const RowPartial part = block_reduce(mine, merge, empty, scratch);

  if (threadIdx.x == 0) {
    p.partials[slot * p.num_chunks + c] = part;
    if (floors) p.chunk_floors[slot * p.num_chunks + c] = ChunkFloor{floor, kept};
    last = arrive(p.row_arrivals + slot) == p.num_chunks - 1;
    if (last) p.row_arrivals[slot] = 0;  // every block has arrived: back to zero
  }
  __syncthreads();
  if (!last) return;  // block-uniform: the last block to arrive decides the row

  if (threadIdx.x < 32) {
    // Merge every chunk's partial in chunk order (read through L2: __ldcg).
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
    FilterStart start = FilterStart::kRow;
    uint32_t row_floor = 0;
    if (floors) {
      // Every chunk's tokens at or above its floor include the row's at or above the highest
      // floor, which is at or below the row's k-th largest: the candidates at or above it are
      // all top-k needs (and all top-p and min-p then keep), when no chunk's list overflowed.
      __shared__ uint32_t chunk_count[kVerifyMaxChunks];
      __shared__ uint32_t highest;
      __shared__ bool complete;
      if (threadIdx.x < 32) {
        uint32_t h = 0;
        bool fits = true;
        for (int k = threadIdx.x; k < p.num_chunks; k += 32) {
          const ChunkFloor* f = p.chunk_floors + slot * p.num_chunks + k;
          const uint32_t n = __ldcg(&f->count);
          h = max(h, __ldcg(&f->floor));
          fits = fits && n <= kChunkCandidates;
          chunk_count[k] = n;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          h = max(h, __shfl_xor_sync(0xffffffffu, h, offset));
        }
        fits = !__any_sync(0xffffffffu, !fits);
        if (threadIdx.x == 0) {
          highest = h;
          complete = candidates && fits;
          filter_shared->candidates = 0;
        }
      }
      __syncthreads();
      row_floor = highest;
      start = FilterStart::kFloor;
      if (complete) {  // block-uniform
        // The C lists, in batches of loads issued before any is used.
        const int total = p.num_chunks * kChunkCandidates;
        for (int base = threadIdx.x; base < total; base += kCandidateBatch * kVerifyThreads) {
          uint32_t key[kCandidateBatch];
#pragma unroll
          for (int u = 0; u < kCandidateBatch; ++u) {
            const int i = base + u * kVerifyThreads;
            const int k = i / kChunkCandidates;
            key[u] = i < total && static_cast<uint32_t>(i - k * kChunkCandidates) < chunk_count[k]
                         ? __ldcg(p.candidates + slot * p.num_chunks * kChunkCandidates + i)
                         : kNoCandidate;
          }
#pragma unroll
          for (int u = 0; u < kCandidateBatch; ++u) {
            if (key[u] == kNoCandidate || key[u] < row_floor) continue;
            const uint32_t i = atomicAdd(&filter_shared->candidates, 1u);
            if (i < kFilterCandidates) {
              filter_shared->candidate_key[i] = key[u];
              filter_shared->candidate_weight[i] =
                  softmax_weight(key_logit(key[u]), mt.max, r.inv_t);
            }
          }
        }
        __syncthreads();
        if (filter_shared->candidates <= kFilterCandidates) start = FilterStart::kOnChip;
        __syncthreads();  // read by all before a gather from the row may reset it
      }
    }
    filter = block_filter_from(masked8, p.vocab, mt.max, r.inv_t, r.spec, *filter_shared, start,
                               row_floor);
    mt.sum = filter.kept_sum;
  }
  if (threadIdx.x != 0) return;
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
      // Row j's test needs row j's statistics and its own uniform only: no other row's outcome.
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
  p.results[slot] = RowResult{mt, md, decision, filter};
  if (p.logprobs && decision == kRowAccepted) {
    p.logprobs[slot] = logf(softmax_prob(t_x, mt.max, 1.f / mt.sum, r.inv_t));
  }
  // The first rejected row is the minimum over the rejected rows: the mark keeps the largest
  // rows - j. Relaxed: in this kernel the mark only lets later blocks skip unneeded rows; the
  // emit kernel reads it, and the results, after this grid has completed.
  if (decision & kRowRejected) atomicMax(p.reject_marks + b, rows - j);
}

// The final row of each request and its outputs: j* = the first rejected row (from the mark), or
// n when every draft was accepted. A greedy request's block 0 writes the row's argmax; a sampled
// request's C blocks race the C chunks of row j* (race_chunk). Every row of a request up to j*
// was decided (a block skips a row only past a rejection), so row j*'s result is this call's.
// Also returns the counters the statistics kernel leaves set to zero. kEmitBlocksPerSM blocks per
// SM; dynamic shared memory: the race's ring.
template <typename TT, typename DT>
__global__ void __launch_bounds__(kVerifyThreads, kEmitBlocksPerSM)
    verify_emit_kernel(const VerifyParams p) {
  const int b = blockIdx.y, c = blockIdx.x, rows = p.block + 1;
  const Request r = load_request(p, b);  // inputs only: may precede the wait
  // Launched dependent: the statistics kernel may still run until this returns.
  wait_for_previous_grid();
  if (r.greedy && c > 0) return;  // request-uniform: block 0 writes a greedy request's outputs
  __shared__ RaceShared sh;
  if (threadIdx.x == 0) {
    const int32_t mark = p.reject_marks[b];
    sh.final_row = mark > 0 ? min(rows - mark, r.n) : r.n;
  }
  __syncthreads();  // the mark is read before any thread of the request may reset it
  const int j = sh.final_row;
  const RowResult res = p.results[int64_t{b} * rows + j];
  if (r.greedy) {
    reset_request_counters(p, b, j);
    write_unraced(p, b, r, j, res);
    return;
  }
  // Dynamic shared memory: the race's ring (verify_race_shared_bytes).
  DSPARK_EXTERN_SHARED(unsigned char, race_raw);
  race_chunk</*kRecut=*/true, TT, DT>(p, b, r, j, res, c, sh, reinterpret_cast<uint4*>(race_raw));
}

// Dynamic shared memory of the emit kernel: the race's ring of `stages` stages.
template <typename TT, typename DT>
int verify_race_shared_bytes(int stages) {
  return stages * race_stage_bytes<TT, DT>();
}

// Dynamic shared memory of the statistics kernel: the ring of `stages` stages while the rows
// stream (a call with draft rows), then the filters' histograms in the deciding block (a call
// with filters): the larger of the two.
template <typename TT, typename DT>
int verify_shared_bytes(bool draft_rows, bool filters, int stages) {
  const int ring_bytes = draft_rows ? stages * ring_stage_bytes<TT, DT>() : 0;
  const int filter_bytes = filters ? int{sizeof(FilterShared)} : 0;
  return ring_bytes > filter_bytes ? ring_bytes : filter_bytes;
}

}  // namespace dspark_ops::kernels
