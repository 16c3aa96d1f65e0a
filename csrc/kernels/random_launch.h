// The launch interface of the random family: what the ATen glue (cuda/random_cuda.cpp, g++)
// calls and cuda/random_launch.cu (nvcc, torch-free) defines.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

// out[i, k] for i < total / count, k < count: philox_uniform_kernel over `total` elements.
cudaError_t launch_philox_uniform(const int64_t* seed, const int64_t* position, uint32_t purpose,
                                  int64_t count, int64_t total, float* out, cudaStream_t stream);

}  // namespace dspark_ops::kernels
