// Launcher of the random family (nvcc, torch-free): the grid of kernels/random.cuh's kernel.
#include "../kernels/random_launch.h"

#include <algorithm>

#include "../kernels/launch.cuh"
#include "../kernels/random.cuh"

namespace dspark_ops::kernels {

cudaError_t launch_philox_uniform(const int64_t* seed, const int64_t* position, uint32_t purpose,
                                  int64_t count, int64_t total, float* out, cudaStream_t stream) {
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535);
  DSPARK_LAUNCH(static_cast<unsigned>(blocks), threads, 0, stream, philox_uniform_kernel)(
      seed, position, purpose, count, total, out);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
