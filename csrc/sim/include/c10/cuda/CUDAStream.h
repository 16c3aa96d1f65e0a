// The emulator build's stand-in for c10's CUDA streams: launches run synchronously, in order.
#pragma once

#include <cuda_runtime.h>

namespace c10::cuda {

struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
  cudaStream_t stream() const { return nullptr; }
};

inline CUDAStream getCurrentCUDAStream(int = -1) { return {}; }

}  // namespace c10::cuda
