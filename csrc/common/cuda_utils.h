// Small CUDA helpers for the ATen glue in cuda/*_cuda.cpp.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "device_cache.h"
#include "element_type.h"

namespace dspark_ops {

// The traits an op's entry (args/<family>_args.h) reads from a CUDA backend (common/backend.h):
// the entry makes the inputs' device current before it allocates, for the outputs, the workspace
// and the launch. An op's backend whose kernels have limits of their own hides check().
struct CudaBackend {
  using Guard = c10::cuda::CUDAGuard;
  template <typename Args>
  static void check(const Args&) {}
};

// The kernels' runtime code (common/element_type.h) of a float32, bfloat16 or float16
// tensor's element type.
inline int element_type(c10::ScalarType dtype) {
  return dtype == c10::kBFloat16 ? kernels::kElementBFloat16
         : dtype == c10::kHalf   ? kernels::kElementHalf
                                 : kernels::kElementFloat;
}

// The CUDA device a tensor lives on (the SIMT emulator's CPU tensors: the emulated device), the
// key of the per-device caches below and in the kernels' occupancy queries.
template <typename Tensor>
int device_index(const Tensor& t) {
#if defined(DSPARK_OPS_SIM)
  (void)t;
  return ::dspark_sim::device_ordinal();
#else
  return t.get_device();
#endif
}

// Streaming multiprocessors of a device, queried once per device (no sync, capture-safe).
inline int multiprocessor_count(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [device] {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  });
}

// Major compute capability of a device, queried once per device.
inline int compute_capability_major(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [device] {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major;
  });
}

}  // namespace dspark_ops
