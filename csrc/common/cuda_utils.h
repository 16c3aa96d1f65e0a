// Small CUDA helpers for the ATen glue in cuda/*.cu.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>

namespace dspark_ops {

// The CUDA type with the same bits as a c10 logit type.
template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<c10::BFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<c10::Half> { using type = __half; };
template <typename T> using cuda_type_t = typename CudaType<T>::type;

// Streaming multiprocessors of a device, queried once per device (no sync, capture-safe).
inline int multiprocessor_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Major compute capability of a device, queried once per device.
inline int compute_capability_major(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int major = cache[device].load(std::memory_order_relaxed);
  if (major == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cache[device].store(major, std::memory_order_relaxed);
  }
  return major;
}

}  // namespace dspark_ops
