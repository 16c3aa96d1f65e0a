// The constructs whose spelling differs between nvcc and the SIMT emulator (csrc/sim/), so the
// same kernel source runs on both: a kernel launch, a launch that may overlap the kernel before
// it, the waits and hints that go with that, and the declaration of dynamic shared memory. Under
// nvcc they are <<<...>>>, cudaLaunchKernelEx, griddepcontrol and extern __shared__;
// csrc/sim/prelude.h defines the emulator's versions before this file is seen. Last, for both,
// the opt-in to more than the default dynamic shared memory.
#pragma once

#if !defined(DSPARK_OPS_SIM)
#include <cuda_runtime.h>

#include <utility>

#include "../common/device_cache.h"

// DSPARK_LAUNCH(grid, block, dynamic shared bytes, stream, kernel)(arguments...)
#define DSPARK_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
// DSPARK_EXTERN_SHARED(type, name): `type* name`, the block's dynamic shared memory (16-byte aligned)
#define DSPARK_EXTERN_SHARED(type, name) extern __shared__ __align__(16) type name[]

// DSPARK_LAUNCH_DEPENDENT(grid, block, dynamic shared bytes, stream, kernel)(arguments...): on
// sm_90 and later, a programmatic dependent launch: the kernel's blocks may start while the
// previous kernel on the stream still runs (once each of its blocks has called
// allow_dependent_launch() or exited), which hides the launch latency between the two. The kernel
// must call wait_for_previous_grid() in every thread before it reads what the previous kernel
// writes, and before it exits. On older GPUs, an ordinary launch (the wait is then a no-op).
#define DSPARK_LAUNCH_DEPENDENT(grid, block, shared, stream, ...) \
  ::dspark_ops::kernels::DependentLaunch<decltype(&__VA_ARGS__)>{     \
      &__VA_ARGS__, dim3(grid), dim3(block), static_cast<size_t>(shared), stream}

namespace dspark_ops::kernels {

// Whether the current device supports programmatic dependent launch (compute capability 9.0+),
// asked of the runtime once per device.
inline bool dependent_launch_supported() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static DeviceCache major{};
  return once_per_device(major, device, [device] {
           int value = 0;  // on an error: 0, asked again next time
           (void)cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device);
           return value;
         }) >= 9;
}

template <typename Kernel>
struct DependentLaunch {
  Kernel kernel;
  dim3 grid, block;
  size_t shared;
  cudaStream_t stream;

  // Errors are left for cudaGetLastError, as with <<<...>>>.
  template <typename... Args>
  void operator()(Args&&... args) const {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = dependent_launch_supported() ? 1 : 0;
    (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  }
};

// In a kernel launched by DSPARK_LAUNCH_DEPENDENT: returns once the previous kernel on the stream
// has completed and its memory operations are visible (immediately when launched otherwise).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// In the kernel before a dependent launch: this block no longer needs the next kernel held back.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace dspark_ops::kernels
#endif

namespace dspark_ops::kernels {

// The dynamic shared memory any kernel may take without an opt-in.
constexpr size_t kDefaultDynamicShared = 48 * 1024;

// Lets `kernel` take `shared_bytes` of dynamic shared memory: past kDefaultDynamicShared only
// by this opt-in, which is per device and function, so it is asked before every launch (and
// occupancy query) that takes more. More than the device allows fails here, before the launch.
template <typename Kernel>
cudaError_t allow_dynamic_shared(Kernel* kernel, size_t shared_bytes) {
  if (shared_bytes <= kDefaultDynamicShared) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(shared_bytes));
}

}  // namespace dspark_ops::kernels
