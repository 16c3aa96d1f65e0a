// Small kernels with known defects, one per check the emulator makes, so the tests can show that
// each check fires (and stays quiet on the correct twin). Run through torch.ops.dspark_ops_sim.
// selftest(name, x, n); the launches go through the same seam (DSPARK_LAUNCH) as the library's.
#include "prelude.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <string>

#include "../kernels/async_copy.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/mma.cuh"

namespace dspark_sim_selftest {

constexpr int kThreads = 64;

// The correct kernel: out[0] = sum of x[0..n), n <= 64, by a tree in shared memory.
__global__ void __launch_bounds__(64) sum_kernel(const float* x, int n, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  partial[t] = t < n ? x[t] : 0.f;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) partial[t] += partial[t + half];
    __syncthreads();
  }
  if (t == 0) out[0] = partial[0];
}

// Defect: the barrier inside the tree is gone (a shared-memory race).
__global__ void __launch_bounds__(64) sum_no_barrier_kernel(const float* x, int n, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  partial[t] = t < n ? x[t] : 0.f;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) partial[t] += partial[t + half];
  }
  if (t == 0) out[0] = partial[0];
}

// Defect: the tail bound is off by one (reads x[n], one past the end).
__global__ void __launch_bounds__(64) sum_tail_kernel(const float* x, int n, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  partial[t] = t <= n ? x[t] : 0.f;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) partial[t] += partial[t + half];
    __syncthreads();
  }
  if (t == 0) out[0] = partial[0];
}

// Defect: writes one element past a static __shared__ array.
__global__ void __launch_bounds__(64) shared_overflow_kernel(const float* x, int n, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  partial[t + 1 < kThreads + 1 ? t + 1 : 0] = t < n ? x[t] : 0.f;
  __syncthreads();
  if (t == 0) out[0] = partial[1];
}

// Defect: reads shared memory that only half the block wrote.
__global__ void __launch_bounds__(64) uninitialised_kernel(const float* x, int n, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  if (t < kThreads / 2) partial[t] = t < n ? x[t] : 0.f;
  __syncthreads();
  out[t] = partial[kThreads - 1 - t];
}

// Defect: a barrier only half the block reaches.
__global__ void __launch_bounds__(64) divergent_barrier_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  if (t < kThreads / 2) __syncthreads();
  out[t] = t < n ? x[t] : 0.f;
}

// Defect: the two halves of the block wait at two different barriers.
__global__ void __launch_bounds__(64) different_barriers_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  if (t < kThreads / 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[t] = t < n ? x[t] : 0.f;
}

// Defect: half the block returns, the other half waits at a barrier.
__global__ void __launch_bounds__(64) exit_before_barrier_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  if (t >= kThreads / 2) return;
  __syncthreads();
  out[t] = t < n ? x[t] : 0.f;
}

// Correct: a full-warp butterfly sum in each warp; out[w] = warp w's sum.
__global__ void __launch_bounds__(64) warp_sum_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  float v = t < n ? x[t] : 0.f;
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  if (t % 32 == 0) out[t / 32] = v;
}

// Correct: out[t] = __any_sync over t's warp of (x[lane] > 0), lanes at or past n voting false.
__global__ void __launch_bounds__(64) warp_any_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  out[t] = __any_sync(0xffffffffu, t < n && x[t] > 0.f) ? 1.f : 0.f;
}

// Defect: half the lanes of each warp skip the vote their full mask names.
__global__ void __launch_bounds__(64) vote_missing_lanes_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  float v = 0.f;
  if (t % 32 < 16) v = __any_sync(0xffffffffu, t < n && x[t] > 0.f) ? 1.f : 0.f;
  out[t] = v;
}

// Defect: half the lanes named by a full mask never reach the shuffle.
__global__ void __launch_bounds__(64) shuffle_missing_lanes_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  float v = t < n ? x[t] : 0.f;
  if (t % 32 < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[t] = v;
}

// Defect: lanes 0..15 shuffle among themselves but read lanes 16..31, outside their mask.
__global__ void __launch_bounds__(64) shuffle_outside_mask_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  float v = t < n ? x[t] : 0.f;
  if (t % 32 < 16) v += __shfl_xor_sync(0x0000ffffu, v, 16);
  out[t] = v;
}

// Defect: every thread adds to out[0] without an atomic (a global-memory race inside a block);
// the atomic twin is correct.
__global__ void __launch_bounds__(64) global_race_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  if (t < n) out[0] += x[t];
}
__global__ void __launch_bounds__(64) global_atomic_kernel(const float* x, int n, float* out) {
  const int t = threadIdx.x;
  if (t < n) atomicAdd(out, x[t]);
}

// Dynamic shared memory: out[t] = x[t] through a buffer of `n` floats (n >= blockDim.x).
__global__ void dynamic_copy_kernel(const float* x, int n, float* out) {
  DSPARK_EXTERN_SHARED(float, buffer);
  const int t = threadIdx.x;
  buffer[n - 1 - t] = x[t];
  __syncthreads();
  out[t] = buffer[n - 1 - t];
}

// cp.async through kernels/async_copy.cuh, in 2 KB of dynamic shared memory: thread t copies
// x[4t, 4t + 4) (zero-filled where 4t >= n) as group 0 into chunk t of `own`, and x[4u, 4u + 4),
// u = 63 - t, as group 1 into chunk t of `swapped`.
__device__ void issue_two_groups(const float* x, int n, float* shared, float4*& own,
                                 float4*& swapped) {
  using namespace dspark_ops::kernels;
  const int t = threadIdx.x, u = kThreads - 1 - t;
  own = reinterpret_cast<float4*>(shared);
  swapped = own + kThreads;
  copy_async_16(own + t, x + 4 * (4 * t < n ? t : 0), 4 * t < n);
  copy_async_commit();
  copy_async_16(swapped + t, x + 4 * (4 * u < n ? u : 0), 4 * u < n);
  copy_async_commit();
}
__device__ float chunk_sum(const float4& v) { return v.x + v.y + v.z + v.w; }

// Correct: out[t] = 2 * sum(x[4t, 4t + 4)): its own group-0 chunk once the wait leaves one group
// pending, and thread u's group-1 chunk (the same values) after the last wait and a barrier.
__global__ void __launch_bounds__(64) async_copy_kernel(const float* x, int n, float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  float4 *own, *swapped;
  issue_two_groups(x, n, shared, own, swapped);
  const int t = threadIdx.x;
  dspark_ops::kernels::copy_async_wait<1>();
  float sum = chunk_sum(own[t]);
  dspark_ops::kernels::copy_async_wait<0>();
  __syncthreads();
  out[t] = sum + chunk_sum(swapped[kThreads - 1 - t]);
}

// Defect: reads its group-1 chunk while that group may still be pending (poison: NaN).
__global__ void __launch_bounds__(64) async_copy_early_read_kernel(const float* x, int n,
                                                                   float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  float4 *own, *swapped;
  issue_two_groups(x, n, shared, own, swapped);
  dspark_ops::kernels::copy_async_wait<1>();
  out[threadIdx.x] = chunk_sum(swapped[threadIdx.x]);
  dspark_ops::kernels::copy_async_wait<0>();
}

// Defect: reads another thread's chunk after its own wait but with no barrier (a race).
__global__ void __launch_bounds__(64) async_copy_no_barrier_kernel(const float* x, int n,
                                                                   float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  float4 *own, *swapped;
  issue_two_groups(x, n, shared, own, swapped);
  dspark_ops::kernels::copy_async_wait<0>();
  out[threadIdx.x] = chunk_sum(swapped[kThreads - 1 - threadIdx.x]);
}

// Defect: never waits for its copies.
__global__ void __launch_bounds__(64) async_copy_no_wait_kernel(const float* x, int n, float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  float4 *own, *swapped;
  issue_two_groups(x, n, shared, own, swapped);
  out[threadIdx.x] = 0.f;
}

// Defect: waits without committing its copy (cp.async.wait_group waits for committed groups only).
__global__ void __launch_bounds__(64) async_copy_uncommitted_kernel(const float* x, int n,
                                                                    float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  const int t = threadIdx.x;
  dspark_ops::kernels::copy_async_16(shared + 4 * t, x + 4 * t, 4 * t + 4 <= n);
  dspark_ops::kernels::copy_async_wait<0>();
  out[t] = shared[4 * t];
}

// Defect: a 16-byte copy from an address 4 bytes past a 16-byte boundary.
__global__ void __launch_bounds__(64) async_copy_misaligned_kernel(const float* x, int n,
                                                                   float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  const int t = threadIdx.x;
  dspark_ops::kernels::copy_async_16(shared + 4 * t, x + 4 * t + 1, 4 * t + 5 <= n);
  dspark_ops::kernels::copy_async_commit();
  dspark_ops::kernels::copy_async_wait<0>();
  out[t] = shared[4 * t];
}

// Defect: the fill bound is off by one chunk (copies x[n, n + 4) when x has n elements).
__global__ void __launch_bounds__(64) async_copy_tail_kernel(const float* x, int n, float* out) {
  DSPARK_EXTERN_SHARED(float, shared);
  const int t = threadIdx.x;
  dspark_ops::kernels::copy_async_16(shared + 4 * t, x + 4 * (4 * t <= n ? t : 0), 4 * t <= n);
  dspark_ops::kernels::copy_async_commit();
  dspark_ops::kernels::copy_async_wait<0>();
  out[t] = shared[4 * t];
}

// A kernel for a dependent launch (DSPARK_LAUNCH_DEPENDENT): every thread waits for the kernel
// before it, then out[t] = x[t] + 1.
__global__ void __launch_bounds__(64) dependent_kernel(const float* x, int n, float* out) {
  dspark_ops::kernels::wait_for_previous_grid();
  const int t = threadIdx.x;
  out[t] = t < n ? x[t] + 1.f : 0.f;
}

// Defect: threads past n return before the wait (the grid may then complete before the kernel it
// depends on, letting the stream's next kernel start early).
__global__ void __launch_bounds__(64) dependent_early_exit_kernel(const float* x, int n,
                                                                  float* out) {
  const int t = threadIdx.x;
  if (t >= n) return;
  dspark_ops::kernels::wait_for_previous_grid();
  out[t] = x[t] + 1.f;
}

// One m16n8k16 product through kernels/mma.cuh: lane l's registers are row l of a (4 words),
// b (2 words) and c (4 floats); d is written in c's layout.
template <typename T>
__global__ void mma_kernel(const int32_t* a, const int32_t* b, const float* c, float* d) {
  const int lane = threadIdx.x;
  float acc[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
  const auto word = [](const int32_t* p, int i) { return static_cast<uint32_t>(p[i]); };
  dspark_ops::kernels::mma_m16n8k16<T>(acc, word(a, 4 * lane), word(a, 4 * lane + 1),
                                       word(a, 4 * lane + 2), word(a, 4 * lane + 3),
                                       word(b, 2 * lane), word(b, 2 * lane + 1));
  for (int e = 0; e < 4; ++e) d[4 * lane + e] = acc[e];
}

}  // namespace dspark_sim_selftest

namespace dspark_sim {

at::Tensor selftest(const std::string& name, const at::Tensor& x, int64_t n) {
  using namespace dspark_sim_selftest;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "selftest: float32 contiguous x");
  auto out = at::zeros({kThreads}, x.options());
  const float* in = x.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int count = static_cast<int>(n);
#define DSPARK_SELFTEST(kernel_name, grid, block, shared)                                  \
  if (name == #kernel_name) {                                                              \
    DSPARK_LAUNCH(grid, block, shared, nullptr, kernel_name##_kernel)(in, count, o);        \
    C10_CUDA_CHECK(cudaGetLastError());                                                    \
    return out;                                                                            \
  }
  DSPARK_SELFTEST(sum, 1, kThreads, 0)
  DSPARK_SELFTEST(sum_no_barrier, 1, kThreads, 0)
  DSPARK_SELFTEST(sum_tail, 1, kThreads, 0)
  DSPARK_SELFTEST(shared_overflow, 1, kThreads, 0)
  DSPARK_SELFTEST(uninitialised, 1, kThreads, 0)
  DSPARK_SELFTEST(divergent_barrier, 1, kThreads, 0)
  DSPARK_SELFTEST(exit_before_barrier, 1, kThreads, 0)
  DSPARK_SELFTEST(different_barriers, 1, kThreads, 0)
  DSPARK_SELFTEST(warp_sum, 1, kThreads, 0)
  DSPARK_SELFTEST(shuffle_missing_lanes, 1, kThreads, 0)
  DSPARK_SELFTEST(warp_any, 1, kThreads, 0)
  DSPARK_SELFTEST(vote_missing_lanes, 1, kThreads, 0)
  DSPARK_SELFTEST(shuffle_outside_mask, 1, kThreads, 0)
  DSPARK_SELFTEST(global_race, 1, kThreads, 0)
  DSPARK_SELFTEST(global_atomic, 1, kThreads, 0)
  DSPARK_SELFTEST(async_copy, 1, kThreads, 2 * kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_early_read, 1, kThreads, 2 * kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_no_barrier, 1, kThreads, 2 * kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_no_wait, 1, kThreads, 2 * kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_uncommitted, 1, kThreads, kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_misaligned, 1, kThreads, kThreads * sizeof(float4))
  DSPARK_SELFTEST(async_copy_tail, 1, kThreads, kThreads * sizeof(float4))
  if (name == "dependent" || name == "dependent_early_exit") {  // after sum, as dependent
    DSPARK_LAUNCH(1, kThreads, 0, nullptr, sum_kernel)(in, count, o);
    if (name == "dependent") {
      DSPARK_LAUNCH_DEPENDENT(1, kThreads, 0, nullptr, dependent_kernel)(in, count, o);
    } else {
      DSPARK_LAUNCH_DEPENDENT(1, kThreads, 0, nullptr, dependent_early_exit_kernel)(in, count, o);
    }
    C10_CUDA_CHECK(cudaGetLastError());
    return out;
  }
  // Launch configurations: n is the parameter under test.
  DSPARK_SELFTEST(dynamic_copy, 1, kThreads, size_t(n) * sizeof(float))
  if (name == "threads_over_bounds") {  // n threads for a __launch_bounds__(64) kernel
    DSPARK_LAUNCH(1, count, 0, nullptr, sum_kernel)(in, kThreads, o);
    C10_CUDA_CHECK(cudaGetLastError());
    return out;
  }
  if (name == "grid_y") {  // a grid of (1, n)
    DSPARK_LAUNCH(dim3(1, count), kThreads, 0, nullptr, warp_sum_kernel)(in, 0, o);
    C10_CUDA_CHECK(cudaGetLastError());
    return out;
  }
  if (name == "opt_in") {  // n bytes of dynamic shared memory, opted in first
    C10_CUDA_CHECK(cudaFuncSetAttribute(dynamic_copy_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, count));
    DSPARK_LAUNCH(1, kThreads, size_t(n), nullptr, dynamic_copy_kernel)(in, count / 4, o);
    C10_CUDA_CHECK(cudaGetLastError());
    return out;
  }
  TORCH_CHECK(false, "selftest: unknown kernel '", name, "'");
}

at::Tensor mma(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool f16) {
  using namespace dspark_sim_selftest;
  TORCH_CHECK(a.scalar_type() == at::kInt && a.numel() == 128 && a.is_contiguous(), "mma: a int32 [32, 4]");
  TORCH_CHECK(b.scalar_type() == at::kInt && b.numel() == 64 && b.is_contiguous(), "mma: b int32 [32, 2]");
  TORCH_CHECK(c.scalar_type() == at::kFloat && c.numel() == 128 && c.is_contiguous(), "mma: c float32 [32, 4]");
  auto d = at::empty({32, 4}, c.options());
  if (f16) {
    DSPARK_LAUNCH(1, 32, 0, nullptr, mma_kernel<__half>)(a.const_data_ptr<int32_t>(),
        b.const_data_ptr<int32_t>(), c.const_data_ptr<float>(), d.data_ptr<float>());
  } else {
    DSPARK_LAUNCH(1, 32, 0, nullptr, mma_kernel<__nv_bfloat16>)(a.const_data_ptr<int32_t>(),
        b.const_data_ptr<int32_t>(), c.const_data_ptr<float>(), d.data_ptr<float>());
  }
  C10_CUDA_CHECK(cudaGetLastError());
  return d;
}

}  // namespace dspark_sim
