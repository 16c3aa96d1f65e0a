// The kernel of draft_confidence (docs/semantics.md §3.3), torch-free: one warp per (request,
// slot) row. The block copies the weight vector [d + r] into shared memory asynchronously while
// each lane issues its 16-byte loads of [h_j; W1[x_j]], so the weights' and the rows' HBM waits
// overlap (one per row at the modelled shapes); float32 dot product, warp reduction. A row whose
// float32 sum is not finite is summed again in float64 (exact_dot). A programmatic dependent
// launch (kernels/launch.cuh): its launch overlaps the kernel before it on the stream (on sm_90 the
// drafting walk's last slot kernel, which lets it start once its tiles are done), and every thread
// waits for that kernel before it reads anything.
// Input contract: ConfidenceParams (kernels/draft_launch.h), filled and checked by
// cuda/draft_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "async_copy.cuh"
#include "convert.cuh"
#include "draft_math.h"
#include "draft_launch.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

constexpr int kConfidenceThreads = 128;   // one warp per (request, slot) row
// A lane sums the products of each segment of the row on their own and adds the segments' sums in
// order: the summation order the kernel has always had (a segment was once the staged weights).
constexpr int kConfidenceSegment = 2048;
constexpr int kConfidenceLoads = 6;       // 16-byte row loads per lane and round; two rounds in flight
// Dynamic shared memory of a block: the weight vector [d + r] of element size `weight_bytes`,
// rounded up to whole 16-byte copies.
inline int confidence_shared_bytes(int width, int weight_bytes) {
  return (width * weight_bytes + 15) / 16 * 16;
}

// Starts copying weight[0, width) into `staged` (16-byte aligned): 16-byte asynchronous copies,
// which hold no registers and are all in flight beside the rows' loads; the bytes past the last
// whole 16 (and every element of an unaligned weight tensor) element by element. Visible to the
// block after copy_async_wait<0>() and a barrier.
template <typename P>
__device__ __forceinline__ void stage_weights(P* staged, const P* weight, int width) {
  int copied = 0;
  if ((reinterpret_cast<uintptr_t>(weight) & 15) == 0) {
    const int chunks = static_cast<int>(width * sizeof(P) / 16);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      copy_async_16(reinterpret_cast<uint4*>(staged) + c, reinterpret_cast<const uint4*>(weight) + c,
                    true);
    }
    copied = static_cast<int>(chunks * 16 / sizeof(P));
  }
  copy_async_commit();
  for (int k = copied + threadIdx.x; k < width; k += blockDim.x) staged[k] = weight[k];
}

// A lane's share of one row's products with the staged weights, its 16-byte vectors
// (lane + 32 q, q = 0, 1, ...) loaded in rounds of kConfidenceLoads, the next round in flight while
// one is summed; element by element past the last whole vector and for unaligned rows. Each
// segment is summed on its own and the segments' sums added in order (kConfidenceSegment).
template <typename T>
struct LaneRow {
  static constexpr int kVec = 16 / sizeof(T);
  // Whole vectors of a lane per segment: segment boundaries fall between the same q for all lanes.
  static constexpr int kSegmentRounds = kConfidenceSegment / kVec / 32;
  static_assert(kConfidenceSegment % (32 * kVec) == 0);

  const T* row = nullptr;  // null: no row (an inactive warp, a token outside the vocabulary)
  int n = 0, vectors = 0, lane = 0;
  uint4 a[kConfidenceLoads], b[kConfidenceLoads];

  __device__ __forceinline__ void issue(uint4 (&v)[kConfidenceLoads], int q0) {
#pragma unroll
    for (int i = 0; i < kConfidenceLoads; ++i) {
      const int idx = lane + 32 * (q0 + i);
      v[i] = idx < vectors ? __ldg(reinterpret_cast<const uint4*>(row) + idx) : make_uint4(0, 0, 0, 0);
    }
  }

  // Issues the first round (and, with `ahead`, the second) before anything waits for them.
  __device__ __forceinline__ void start(const T* row_, int n_, int lane_, bool ahead) {
    row = row_;
    n = n_;
    lane = lane_;
    vectors = row != nullptr && (reinterpret_cast<uintptr_t>(row) & 15) == 0 ? n / kVec : 0;
    issue(a, 0);
    if (ahead) issue(b, kConfidenceLoads);
  }

  template <typename P>
  __device__ __forceinline__ void sum_round(const uint4 (&v)[kConfidenceLoads], int q0, const P* w,
                                            float& total, float& segment, int& segment_index) {
#pragma unroll
    for (int i = 0; i < kConfidenceLoads; ++i) {
      const int q = q0 + i, idx = lane + 32 * q;
      if (idx >= vectors) break;
      if (q / kSegmentRounds != segment_index) {
        total += segment;
        segment = 0.f;
        segment_index = q / kSegmentRounds;
      }
      const T* e = reinterpret_cast<const T*>(&v[i]);
      const P* wk = w + idx * kVec;
#pragma unroll
      for (int t = 0; t < kVec; ++t) segment = fmaf(to_float(e[t]), to_float(wk[t]), segment);
    }
  }

  // sum_k row[k] * w[k] over this lane's k; `ahead`: whether start issued the second round.
  template <typename P>
  __device__ __forceinline__ float finish(const P* w, bool ahead) {
    if (row == nullptr) return 0.f;
    if (!ahead) issue(b, kConfidenceLoads);
    float total = 0.f, segment = 0.f;
    int segment_index = 0;
    for (int q0 = 0; lane + 32 * q0 < vectors; q0 += 2 * kConfidenceLoads) {
      sum_round(a, q0, w, total, segment, segment_index);
      issue(a, q0 + 2 * kConfidenceLoads);
      sum_round(b, q0 + kConfidenceLoads, w, total, segment, segment_index);
      issue(b, q0 + 3 * kConfidenceLoads);
    }
    for (int k = vectors * kVec + lane; k < n; k += 32) {
      if (k / kConfidenceSegment != segment_index) {
        total += segment;
        segment = 0.f;
        segment_index = k / kConfidenceSegment;
      }
      segment = fmaf(to_float(row[k]), to_float(w[k]), segment);
    }
    // Segments past this lane's last element add their zero sums, as every segment always has.
    const int segments = (n + kConfidenceSegment - 1) / kConfidenceSegment;
    for (; segment_index < segments - 1; ++segment_index) {
      total += segment;
      segment = 0.f;
    }
    return segments > 0 ? total + segment : total;
  }
};

// This lane's share of w . [h; W1[x]]: the weights' copies, the hidden row's first two rounds and
// the W1 row's first round are all issued before the block waits for the weights, so their HBM
// waits overlap; the W1 row waits for its token (read first) only.
template <typename T, typename W, typename P>
__device__ __forceinline__ float row_products(const T* h, const W* w1, const ConfidenceParams& p,
                                              const P* staged, int lane) {
  LaneRow<T> hidden;
  hidden.start(h, p.hidden_size, lane, true);
  LaneRow<W> markov;
  markov.start(w1, p.rank, lane, false);
  copy_async_wait<0>();
  __syncthreads();  // the block's weights are staged
  const float sum = hidden.finish(staged, true);
  return sum + markov.finish(staged + p.hidden_size, false);
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

// W: W1's type, P: the weight vector's. Four blocks per SM (up to 128 registers): a lane holds
// three rounds of row loads in flight.
template <typename W, typename P>
__global__ void __launch_bounds__(kConfidenceThreads, 4)
    draft_confidence_kernel(const ConfidenceParams p) {
  DSPARK_EXTERN_SHARED(uint4, staged_bytes);
  P* const staged = reinterpret_cast<P*>(staged_bytes);
  wait_for_previous_grid();  // the tokens, hidden rows and weights may be the stream's last writes
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
  stage_weights(staged, static_cast<const P*>(p.weight), p.hidden_size + p.rank);
  const bool in_range = x >= 0 && x < p.vocab;
  const int64_t h_offset = b * p.hidden_stride_b + j * p.hidden_stride_j;
  const W* w1 = in_range ? static_cast<const W*>(p.w1) + x * p.w1_stride : nullptr;
  float sum;
  switch (p.hidden_type) {  // uniform over the block, as row_products' barrier needs
    case kElementBFloat16: {
      const auto* h = static_cast<const __nv_bfloat16*>(p.hidden) + h_offset;
      sum = row_products(active ? h : nullptr, w1, p, staged, lane);
      break;
    }
    case kElementHalf: {
      const auto* h = static_cast<const __half*>(p.hidden) + h_offset;
      sum = row_products(active ? h : nullptr, w1, p, staged, lane);
      break;
    }
    default: {
      const auto* h = static_cast<const float*>(p.hidden) + h_offset;
      sum = row_products(active ? h : nullptr, w1, p, staged, lane);
    }
  }
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

template <typename W, typename P>
cudaError_t launch_draft_confidence(const ConfidenceParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.block;
  if (rows == 0) return cudaSuccess;
  constexpr int kRowsPerBlock = kConfidenceThreads / 32;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int shared = confidence_shared_bytes(p.hidden_size + p.rank, sizeof(P));
  const cudaError_t opted_in = allow_dynamic_shared(draft_confidence_kernel<W, P>, shared);
  if (opted_in != cudaSuccess) return opted_in;
  DSPARK_LAUNCH_DEPENDENT(static_cast<unsigned>(blocks), kConfidenceThreads, shared, stream,
                          draft_confidence_kernel<W, P>)(p);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
