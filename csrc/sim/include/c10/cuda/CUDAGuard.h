// The emulator build's stand-in for c10's CUDA device guard: the emulated device is the only one.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
  explicit CUDAGuard(c10::DeviceIndex) {}
};

}  // namespace c10::cuda
