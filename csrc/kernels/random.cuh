// CUDA kernel of philox_uniform (torch-free): out[i, k] = element k of stream
// (seed[i], position[i], purpose), one thread per element. Launched by cuda/random_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/philox.h"
#include "random_launch.h"

namespace dspark_ops::kernels {

__global__ void philox_uniform_kernel(const int64_t* seed, const int64_t* position,
                                      uint32_t purpose, int64_t count, int64_t total, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / count;
    out[i] = philox_uniform(seed[row], position[row], purpose, static_cast<uint32_t>(i % count));
  }
}

}  // namespace dspark_ops::kernels
