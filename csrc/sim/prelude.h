// Force-included (g++ -include) into every translation unit of the SIMT emulator build: it lets
// g++ compile csrc/kernels/*.cuh and csrc/cuda/*_launch.cu, unchanged, as host C++ whose kernels
// run through runtime.h. The CUDA headers are the toolkit's own, compiled in host mode; this file
// supplies what only nvcc provides: the execution-space keywords, the built-in variables, the
// device functions the kernels use, and the source seams of kernels/launch.cuh (DSPARK_LAUNCH for
// <<<>>>, DSPARK_LAUNCH_DEPENDENT and its griddepcontrol functions, DSPARK_EXTERN_SHARED for
// extern __shared__).
//
// __CUDA_ARCH__ stays undefined (the CUDA headers would change what they compile), so the
// `#if defined(__CUDA_ARCH__)` branches of kernels/*_math.h and common/philox.h run their host
// branches here; each pair is written to compute the same value.
#pragma once

#define DSPARK_OPS_SIM 1

// Before the CUDA headers: host_defines.h keeps definitions it finds.
#define __global__ inline  // a kernel defined in a header may be included by several units
#define __device__
#define __host__
// Static shared memory: one copy per kernel instantiation, which is right because blocks run one at
// a time. It is not zeroed between blocks (the previous block's values stay, as on hardware); the
// race flavour reports any read of shared memory not written earlier by the same block.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda/atomic>
#include <string>
#include <tuple>
#include <type_traits>

#include "runtime.h"

#define DSPARK_SIM_SITE (::dspark_sim::Site{__FILE__, __LINE__})

// ---- built-in variables
#define threadIdx (::dspark_sim::current().thread_idx)
#define blockIdx (::dspark_sim::current().block_idx)
#define blockDim (::dspark_sim::current().block_dim)
#define gridDim (::dspark_sim::current().grid_dim)
#define warpSize 32

// ---- synchronisation
#define __syncthreads() ::dspark_sim::syncthreads(DSPARK_SIM_SITE)
#define __threadfence() ::dspark_sim::yield(DSPARK_SIM_SITE)
#define __trap() ::dspark_sim::trap(DSPARK_SIM_SITE)

namespace dspark_sim {

template <typename T>
T shfl(Site site, ShuffleKind kind, unsigned mask, T value, int operand, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                "warp shuffles move 4- or 8-byte values");
  shuffle(site, kind, mask, &value, sizeof(T), operand, width);
  return value;
}

// Atomics: a scheduling point, then the read-modify-write through the compiler's atomic built-ins
// (which the race flavour's instrumentation sees as atomic accesses).
template <typename T, typename F>
T atomic_update(T* address, F next) {
  yield(Site{"atomic", 0});
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(address, &old, next(old), false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}

template <typename T>
using atomic_int_t = std::enable_if_t<std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), T>;

}  // namespace dspark_sim

#define __shfl_sync(...) ::dspark_sim::shfl(DSPARK_SIM_SITE, ::dspark_sim::ShuffleKind::kIndex, __VA_ARGS__)
#define __shfl_up_sync(...) ::dspark_sim::shfl(DSPARK_SIM_SITE, ::dspark_sim::ShuffleKind::kUp, __VA_ARGS__)
#define __shfl_down_sync(...) ::dspark_sim::shfl(DSPARK_SIM_SITE, ::dspark_sim::ShuffleKind::kDown, __VA_ARGS__)
#define __shfl_xor_sync(...) ::dspark_sim::shfl(DSPARK_SIM_SITE, ::dspark_sim::ShuffleKind::kXor, __VA_ARGS__)

// __any_sync over a full warp (the kernels vote with all 32 lanes only): an OR butterfly of xor
// shuffles, so every lane must arrive, as at a hardware vote. A partial mask traps.
namespace dspark_sim {
inline int vote_any(Site site, unsigned mask, int predicate) {
  if (mask != 0xffffffffu) trap(site);
  int any = predicate != 0;
  for (int offset = 16; offset > 0; offset >>= 1) {
    any |= shfl(site, ShuffleKind::kXor, mask, any, offset);
  }
  return any;
}
}  // namespace dspark_sim
#define __any_sync(...) ::dspark_sim::vote_any(DSPARK_SIM_SITE, __VA_ARGS__)

template <typename T>
inline dspark_sim::atomic_int_t<T> atomicAdd(T* address, T value) {
  return dspark_sim::atomic_update(address, [&](T old) { return static_cast<T>(old + value); });
}
// Floating-point atomicAdd through the same-width integer (CUDA has float and, from sm_60, double).
template <typename F, typename Bits>
inline F atomic_add_float(F* address, F value) {
  static_assert(sizeof(F) == sizeof(Bits));
  Bits* bits = reinterpret_cast<Bits*>(address);
  const Bits old = dspark_sim::atomic_update(bits, [&](Bits o) {
    F f;
    std::memcpy(&f, &o, sizeof(F));
    f += value;
    std::memcpy(&o, &f, sizeof(F));
    return o;
  });
  F f;
  std::memcpy(&f, &old, sizeof(F));
  return f;
}
inline float atomicAdd(float* address, float value) {
  return atomic_add_float<float, uint32_t>(address, value);
}
inline double atomicAdd(double* address, double value) {
  return atomic_add_float<double, uint64_t>(address, value);
}
template <typename T>
inline dspark_sim::atomic_int_t<T> atomicMax(T* address, T value) {
  return dspark_sim::atomic_update(address, [&](T old) { return old < value ? value : old; });
}
template <typename T>
inline dspark_sim::atomic_int_t<T> atomicMin(T* address, T value) {
  return dspark_sim::atomic_update(address, [&](T old) { return value < old ? value : old; });
}
template <typename T>
inline dspark_sim::atomic_int_t<T> atomicExch(T* address, T value) {
  return dspark_sim::atomic_update(address, [&](T) { return value; });
}
template <typename T>
inline dspark_sim::atomic_int_t<T> atomicCAS(T* address, T compare, T value) {
  return dspark_sim::atomic_update(address, [&](T old) { return old == compare ? value : old; });
}

// ---- loads with cache hints: plain loads here
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }

// ---- a relaxed read of a counter other blocks publish to, which is zero when the launch starts
// and only grows (kernels/verify.cuh: the rejection mark): read here (the checkers see the load),
// and under "polls_see_launch_start" answered with the launch-start value, as a block may see it
// while the blocks that raise it run beside it.
namespace dspark_sim {
inline int32_t poll_counter(Site, const int32_t* counter) {
  const int32_t value = *counter;
  return polls_see_launch_start() ? 0 : value;
}
}  // namespace dspark_sim

// ---- cp.async (kernels/async_copy.cuh): the destination is poisoned at issue (a write of the
// issuing thread: the hardware's may land any time after it) and the copy is made by the issuing
// thread at the wait that completes it, through these instrumented loads and stores, so the race
// checker sees the writes and the bounds checker the source reads.
namespace dspark_sim {
inline void copy_async(Site site, void* dst, const void* src, int bytes, int src_bytes) {
  if (!async_copy_issue(site, AsyncCopy{dst, src, bytes, src_bytes})) return;
  auto* words = static_cast<uint32_t*>(dst);
  for (int i = 0; i < bytes / 4; ++i) words[i] = 0xFFFFFFFFu;  // NaN as any float type
}
inline void copy_async_commit() { async_copy_commit(); }
inline void copy_async_wait(int pending) {
  AsyncCopy done[32];
  for (int n; (n = async_copy_take(pending, done, 32)) > 0;) {
    for (int k = 0; k < n; ++k) {
      auto* dst = static_cast<unsigned char*>(done[k].dst);
      const auto* src = static_cast<const unsigned char*>(done[k].src);
      for (int i = 0; i < done[k].bytes; i += 4) {
        uint32_t word = 0;  // bytes past src_bytes are zero-filled
        if (i + 4 <= done[k].src_bytes) {
          word = *reinterpret_cast<const uint32_t*>(src + i);
        } else {
          for (int j = i; j < done[k].src_bytes; ++j) word |= uint32_t{src[j]} << (8 * (j - i));
        }
        *reinterpret_cast<uint32_t*>(dst + i) = word;
      }
    }
  }
}
}  // namespace dspark_sim

// ---- bit casts and integer helpers nvcc provides as device functions
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}

// Device min/max accept mixed integer widths (the wider type wins) and floats.
template <typename A, typename B,
          typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B,
          typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// ---- the runtime calls, redirected to the emulated device
namespace dspark_sim {
template <typename F>
cudaError_t set_attribute_of(F* func, cudaFuncAttribute attribute, int value) {
  return func_set_attribute(reinterpret_cast<const void*>(func), attribute, value);
}
template <typename F>
cudaError_t occupancy_of(int* blocks, F* func, int threads, size_t shared) {
  return occupancy(blocks, reinterpret_cast<const void*>(func), threads, shared);
}
}  // namespace dspark_sim
// Variadic: a kernel argument may be a template-id with commas.
#define cudaFuncSetAttribute(...) ::dspark_sim::set_attribute_of(__VA_ARGS__)
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor(...) ::dspark_sim::occupancy_of(__VA_ARGS__)
#define cudaDeviceGetAttribute(value, attribute, device) \
  ::dspark_sim::device_attribute(value, attribute, device)
#define cudaGetLastError() ::dspark_sim::get_last_error()
// Launches run synchronously on the one emulated stream, which is never being captured.
#define cudaStreamIsCapturing(stream, status) \
  ((void)(stream), *(status) = cudaStreamCaptureStatusNone, cudaSuccess)
#define cudaPeekAtLastError() ::dspark_sim::peek_last_error()
#define cudaGetErrorString(error) ::dspark_sim::error_string(error)

// ---- the seams in the kernel sources
namespace dspark_sim {

template <auto Kernel>
const char* kernel_name() {
  return __PRETTY_FUNCTION__;  // "... [with auto Kernel = ns::name<args>]": the instantiation
}

// The fields of a kernel's parameter struct that say how its launcher divided the work (a plan
// reads them beside grid, block and shared memory): those of `p` among group_size, num_tiles,
// num_chunks, chunk, splits, split_length, tile_keys and stages, as "name=value" pairs separated by spaces.
template <typename P>
std::string plan_fields(const P& p) {
  std::string out;
  const auto add = [&out](const char* name, long long value) {
    out += (out.empty() ? "" : " ") + std::string(name) + "=" + std::to_string(value);
  };
  if constexpr (requires { p.group_size; }) add("group_size", p.group_size);
  if constexpr (requires { p.num_tiles; }) add("num_tiles", p.num_tiles);
  if constexpr (requires { p.num_chunks; }) add("num_chunks", p.num_chunks);
  if constexpr (requires { p.chunk; }) add("chunk", p.chunk);
  if constexpr (requires { p.splits; }) add("splits", p.splits);
  if constexpr (requires { p.split_length; }) add("split_length", p.split_length);
  if constexpr (requires { p.tile_keys; }) add("tile_keys", p.tile_keys);
  if constexpr (requires { p.stages; }) add("stages", p.stages);
  return out;
}

template <auto Kernel>
struct Launcher {
  // Every launched kernel's address and instantiation, registered when the library loads: the
  // occupancy query takes the address alone, and the resources of record are per instantiation.
  static inline const bool registered =
      (register_kernel(kernel_name<Kernel>(), reinterpret_cast<const void*>(Kernel)), true);

  dim3 grid, block;
  size_t shared;
  bool dependent = false;

  template <typename... Params, typename... Args>
  void run(void (*)(Params...), Args&&... args) const {
    (void)registered;
    using Closure = std::tuple<std::decay_t<Params>...>;
    Closure closure(std::forward<Args>(args)...);  // copied once, as the launch copies arguments
    const auto body = [](void* c) { std::apply(Kernel, *static_cast<Closure*>(c)); };
    std::string fields;
    if constexpr (sizeof...(Params) > 0) {
      if constexpr (std::is_class_v<std::tuple_element_t<sizeof...(Params) - 1, Closure>>) {
        fields = plan_fields(std::get<sizeof...(Params) - 1>(closure));
      }
    }
    launch(kernel_name<Kernel>(), reinterpret_cast<const void*>(Kernel), grid, block, shared,
           body, &closure, dependent, fields);
  }

  template <typename... Args>
  void operator()(Args&&... args) const {
    run(Kernel, std::forward<Args>(args)...);
  }
};

}  // namespace dspark_sim

#define DSPARK_LAUNCH(grid, block, shared, stream, ...)                                  \
  ((void)(stream),                                                                       \
   ::dspark_sim::Launcher<&__VA_ARGS__>{dim3(grid), dim3(block), static_cast<size_t>(shared)})
#define DSPARK_LAUNCH_DEPENDENT(grid, block, shared, stream, ...)                        \
  ((void)(stream), ::dspark_sim::Launcher<&__VA_ARGS__>{dim3(grid), dim3(block),          \
                                                        static_cast<size_t>(shared), true})
#define DSPARK_EXTERN_SHARED(type, name) \
  type* const name = static_cast<type*>(::dspark_sim::dynamic_shared())

// launch.cuh's device side of a dependent launch (griddepcontrol).
namespace dspark_ops::kernels {
inline void wait_for_previous_grid() { ::dspark_sim::wait_for_previous_grid(); }
inline void allow_dependent_launch() {}
}  // namespace dspark_ops::kernels
