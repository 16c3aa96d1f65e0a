// Host-side answers that depend on the GPU model (occupancy, SM count), computed once per device:
// a process may drive GPUs of different models, so one answer per kernel instantiation would give
// every device the first one's grid plan. Host code only, torch-free: the kernels' launchers
// (csrc/kernels/) and the CUDA glue's helpers (cuda_utils.h) both use it.
#pragma once

#include <array>
#include <atomic>

namespace dspark_ops {

constexpr int kMaxDevices = 64;
using DeviceCache = std::array<std::atomic<int>, kMaxDevices>;  // 0: not known yet

// cache[device], filled by compute() (which must return a positive value) on first use.
template <typename F>
int once_per_device(DeviceCache& cache, int device, F&& compute) {
  if (device < 0 || device >= kMaxDevices) return compute();
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    value = compute();
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

}  // namespace dspark_ops
