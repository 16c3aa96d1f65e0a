// The kernel of draft_confidence (docs/semantics.md §3.3), torch-free: one warp per (request,
// slot) row; the block stages the weight vector in shared memory as float32, each lane reads its
// share of [h_j; W1[x_j]] with 16-byte loads (eight in flight), float32 dot product, warp
// reduction. A row whose float32 sum is not finite is summed again in float64 (exact_dot).
// Input contract: ConfidenceParams (kernels/draft_launch.h), filled and checked by
// cuda/draft_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "convert.cuh"
#include "draft_math.h"
#include "draft_launch.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

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
