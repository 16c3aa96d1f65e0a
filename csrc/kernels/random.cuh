// CUDA kernel of philox_uniform (torch-free): out[i, k] = element k of stream
// (seed[i], position[i], purpose), one thread per element.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/philox.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

__global__ void philox_uniform_kernel(const int64_t* seed, const int64_t* position,
                                      uint32_t purpose, int64_t count, int64_t total, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / count;
    out[i] = philox_uniform(seed[row], position[row], purpose, static_cast<uint32_t>(i % count));
  }
}

inline cudaError_t launch_philox_uniform(const int64_t* seed, const int64_t* position,
                                         uint32_t purpose, int64_t count, int64_t total, float* out,
                                         cudaStream_t stream) {
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535);
  DSPARK_LAUNCH(static_cast<unsigned>(blocks), threads, 0, stream, philox_uniform_kernel)(
      seed, position, purpose, count, total, out);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
