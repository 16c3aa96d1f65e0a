// Warp and block reductions over the small records of sampling_math.h (torch-free).
#pragma once

#include <cuda_runtime.h>

#include "sampling_math.h"

namespace dspark_ops::kernels {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ SoftmaxStats shfl_down(SoftmaxStats s, int offset) {
  return SoftmaxStats{__shfl_down_sync(kFullMask, s.max, offset),
                      __shfl_down_sync(kFullMask, s.sum, offset),
                      __shfl_down_sync(kFullMask, s.argmax, offset)};
}

__device__ __forceinline__ RaceCandidate shfl_down(RaceCandidate c, int offset) {
  return RaceCandidate{__shfl_down_sync(kFullMask, c.key, offset),
                       __shfl_down_sync(kFullMask, c.index, offset)};
}

__device__ __forceinline__ float shfl_down(float v, int offset) {
  return __shfl_down_sync(kFullMask, v, offset);
}

__device__ __forceinline__ double shfl_down(double v, int offset) {
  return __shfl_down_sync(kFullMask, v, offset);
}

__device__ __forceinline__ unsigned long long shfl_down(unsigned long long v, int offset) {
  return __shfl_down_sync(kFullMask, v, offset);
}

__device__ __forceinline__ int shfl_down(int v, int offset) {
  return __shfl_down_sync(kFullMask, v, offset);
}

// Reduces over a full warp; lane 0 holds the result.
template <typename T, typename Merge>
__device__ __forceinline__ T warp_reduce(T value, Merge merge) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = merge(value, shfl_down(value, offset));
  return value;
}

// Reduces over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` must hold 32 values and may be reused after the call returns.
template <typename T, typename Merge>
__device__ __forceinline__ T block_reduce(T value, Merge merge, T identity, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  value = warp_reduce(value, merge);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = warp_reduce(lane < warps ? scratch[lane] : identity, merge);
    if (lane == 0) scratch[0] = value;
  }
  __syncthreads();
  value = scratch[0];
  __syncthreads();
  return value;
}

// Exclusive prefix sum over the block of one value per thread (blockDim.x a multiple of 32);
// `total` receives the block's sum. `scratch` must hold 32 values.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T value, T* scratch, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  T inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T sums = lane < warps ? scratch[lane] : T{0};
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const T up = __shfl_up_sync(kFullMask, sums, offset);
      if (lane >= offset) sums += up;
    }
    scratch[lane] = sums;
  }
  __syncthreads();
  const T before = (warp > 0 ? scratch[warp - 1] : T{0}) + inclusive - value;
  total = scratch[warps - 1];
  __syncthreads();
  return before;
}

}  // namespace dspark_ops::kernels
