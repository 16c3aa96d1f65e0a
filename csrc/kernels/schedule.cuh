// CUDA kernels of the scheduling family (docs/semantics.md §3.4), torch-free.
//
// Math: kernels/schedule_math.h (shared with the CPU kernels). Each op is one launch of one block
// of 1024 threads, which is all B <= 1024, G <= 32 needs; the cost is launch latency plus a few
// microseconds, and no host sync:
//   1. survivals per request (a thread walks its request's G confidences) -> one 64-bit rank key
//      per pair, stored at j * B + r;
//   2. bitonic sort of the keys, in (dynamic) shared memory up to 16384 pairs (B = 1024, G = 16)
//      where the device's opt-in limit per block allows (8192 on 99 KB GPUs: A10, L4, RTX), else
//      in a global workspace (L2-resident; at most 2^20 pairs are allowed). A full sort is
//      simpler than a selection and affordable at these sizes: 4096 keys (B = 256, G = 16) take
//      78 compare-exchange stages of two pairs per thread, ~30 instructions per warp each, about
//      10 us on an H200 by instruction count (not yet measured);
//   3. schedule/plan: fixed-point prefix sums of the sorted survivals (a block scan over
//      contiguous per-thread segments), Theta for every admission count, then a block reduction:
//      the first admission that does not improve Theta (schedule) or the best Theta (plan);
//      allocate: admit min(budget - B, eligible);
//   4. num_verify[r] = 1 + the largest admitted position of request r (an atomicMax per admitted
//      pair; admitted pairs of a request form a prefix of its positions, as survivals never grow).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "reduce.cuh"
#include "schedule_math.h"
#include "launch.cuh"

namespace dspark_ops::kernels {

constexpr int kScheduleThreads = 1024;
constexpr int kSharedKeys = 16384;  // 128 KB of dynamic shared memory, within sm_80's 164 KB

enum ScheduleMode : int { kModeSchedule = 0, kModePlan = 1, kModeAllocate = 2 };

struct ScheduleParams {
  const float* confidence;  // [B, G], contiguous
  const float* step_rate;   // [M]
  int64_t capacity;         // M
  const int32_t* max_verify;  // [B] or null
  const int32_t* budget;      // [1], allocate only
  int32_t* num_verify;        // [B], schedule and allocate
  int32_t* budget_out;        // [1], plan
  uint64_t* global_keys;      // [sort_size] unless schedule_sorts_in_shared, else null
  int batch, block;
  int sort_size;  // a power of two >= B * G
};

// Best Theta so far and its admission count (ties to the smaller count).
struct PlanCandidate {
  double theta;
  int count;
};

// The opt-in limit per block covers static and dynamic shared memory together: leave room for
// schedule_kernel's __shared__ arrays (900 bytes; keep this sum in step with them).
constexpr int kScheduleStaticSharedMargin = 2048;
static_assert(32 * (sizeof(int64_t) + sizeof(int) + sizeof(PlanCandidate)) + sizeof(int) <=
              kScheduleStaticSharedMargin);

// Whether `sort_size` keys are sorted in shared memory on a device whose opt-in limit per block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin) is `optin_bytes`; else the global workspace.
inline bool schedule_sorts_in_shared(int sort_size, int optin_bytes) {
  return sort_size <= kSharedKeys &&
         int64_t{sort_size} * int64_t{sizeof(uint64_t)} + kScheduleStaticSharedMargin <=
             int64_t{optin_bytes};
}

__device__ __forceinline__ PlanCandidate shfl_down(PlanCandidate c, int offset) {
  return PlanCandidate{__shfl_down_sync(kFullMask, c.theta, offset),
                       __shfl_down_sync(kFullMask, c.count, offset)};
}

__device__ __forceinline__ PlanCandidate better_plan(PlanCandidate a, PlanCandidate b) {
  return b.theta > a.theta || (b.theta == a.theta && b.count < a.count) ? b : a;
}

// SharedSort: the keys live in dynamic shared memory (schedule_sorts_in_shared), else in
// p.global_keys; separate instantiations so the shared path compiles to LDS/STS.
template <int Mode, bool SharedSort>
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const ScheduleParams p) {
  DSPARK_EXTERN_SHARED(uint64_t, dynamic_keys);
  __shared__ int64_t scan_scratch[32];
  __shared__ int int_scratch[32];
  __shared__ PlanCandidate plan_scratch[32];
  __shared__ int eligible;
  uint64_t* keys = SharedSort ? dynamic_keys : p.global_keys;
  const float* __restrict__ confidence = p.confidence;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int pairs = p.batch * p.block;

  // 1. Rank keys; positions past a cap or after a zero survival are ineligible.
  for (int i = pairs + tid; i < p.sort_size; i += threads) keys[i] = kIneligible;
  for (int r = tid; r < p.batch; r += threads) {
    const int cap = p.max_verify ? min(max(p.max_verify[r], 0), p.block) : p.block;
    float a = 1.f;
    for (int j = 0; j < p.block; ++j) {
      a *= clamp_confidence(confidence[int64_t{r} * p.block + j]);
      keys[j * p.batch + r] = j < cap ? pair_key(a, static_cast<uint32_t>(j * p.batch + r))
                                      : kIneligible;
    }
  }
  if (tid == 0) eligible = 0;
  __syncthreads();

  // 2. Bitonic sort, ascending.
  const int half = p.sort_size / 2;
  for (int k = 2; k <= p.sort_size; k <<= 1) {
    for (int s = k >> 1; s > 0; s >>= 1) {
      for (int i = tid; i < half; i += threads) {
        const int lo = 2 * i - (i & (s - 1)), hi = lo + s;  // (i / s) * 2s + i % s, s = 2^m
        const uint64_t x = keys[lo], y = keys[hi];
        if ((x > y) == ((lo & k) == 0)) {
          keys[lo] = y;
          keys[hi] = x;
        }
      }
      __syncthreads();
    }
  }
  for (int i = tid; i < p.sort_size; i += threads) {
    if (keys[i] != kIneligible && (i + 1 == p.sort_size || keys[i + 1] == kIneligible)) {
      eligible = i + 1;
    }
  }
  __syncthreads();

  // 3. How many ranked pairs to admit.
  int admitted;
  if (Mode == kModeAllocate) {
    const int64_t want = int64_t{p.budget[0]} - p.batch;  // int64: no overflow on any budget
    admitted = static_cast<int>(want < 0 ? 0 : (want < eligible ? want : eligible));
  } else {
    const int64_t room = p.capacity - 1 - p.batch;  // admissions that keep the batch below M
    const int limit = static_cast<int>(eligible < room ? eligible : room);
    const int per_thread = (limit + threads - 1) / threads;
    const int begin = min(tid * per_thread, limit), end = min(begin + per_thread, limit);
    int64_t segment = 0;
    for (int k = begin; k < end; ++k) segment += fixed_survival(key_survival(keys[k]));
    int64_t total;
    int64_t tau = int64_t{p.batch} * static_cast<int64_t>(kSurvivalScale) +
                  block_exclusive_scan(segment, scan_scratch, total);
    // Theta after k admissions is theta(tau_k, batch + k); this thread covers k in [begin, end].
    double previous = theta(tau, p.step_rate, p.batch + begin);
    if (Mode == kModeSchedule) {
      int first_stop = limit;
      for (int k = begin; k < end; ++k) {
        tau += fixed_survival(key_survival(keys[k]));
        const double value = theta(tau, p.step_rate, p.batch + k + 1);
        if (!(value > previous)) {
          first_stop = k;
          break;
        }
        previous = value;
      }
      admitted = block_reduce(first_stop, [](int a, int b) { return min(a, b); }, limit,
                              int_scratch);
    } else {
      PlanCandidate best{tid == 0 ? previous : -INFINITY, 0};
      for (int k = begin; k < end; ++k) {
        tau += fixed_survival(key_survival(keys[k]));
        best = better_plan(best, PlanCandidate{theta(tau, p.step_rate, p.batch + k + 1), k + 1});
      }
      best = block_reduce(best, better_plan, PlanCandidate{-INFINITY, 0}, plan_scratch);
      if (tid == 0) p.budget_out[0] = p.batch + best.count;
      return;
    }
  }

  // 4. Lengths from the admitted prefix of the ranking.
  for (int r = tid; r < p.batch; r += threads) p.num_verify[r] = 0;
  __syncthreads();
  for (int k = tid; k < admitted; k += threads) {
    const uint32_t index = key_index(keys[k]);
    atomicMax(p.num_verify + index % p.batch, static_cast<int>(index / p.batch) + 1);
  }
}

template <int Mode, bool SharedSort>
cudaError_t launch_schedule_mode(const ScheduleParams& p, cudaStream_t stream) {
  const size_t shared_bytes = SharedSort ? size_t(p.sort_size) * sizeof(uint64_t) : 0;
  if (SharedSort) {  // beyond the default 48 KB; the opt-in is per device, so set every time,
                     // to what this sort needs (more than the device allows fails)
    const cudaError_t opted_in =
        cudaFuncSetAttribute(schedule_kernel<Mode, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
    if (opted_in != cudaSuccess) return opted_in;
  }
  DSPARK_LAUNCH(1, kScheduleThreads, shared_bytes, stream, schedule_kernel<Mode, SharedSort>)(p);
  return cudaGetLastError();
}

template <int Mode>
cudaError_t launch_schedule_mode(const ScheduleParams& p, cudaStream_t stream) {
  return p.global_keys ? launch_schedule_mode<Mode, false>(p, stream)
                       : launch_schedule_mode<Mode, true>(p, stream);
}

inline cudaError_t launch_schedule(int mode, const ScheduleParams& p, cudaStream_t stream) {
  switch (mode) {
    case kModeSchedule: return launch_schedule_mode<kModeSchedule>(p, stream);
    case kModePlan: return launch_schedule_mode<kModePlan>(p, stream);
    default: return launch_schedule_mode<kModeAllocate>(p, stream);
  }
}

// pack_verify_inputs: one block; a block scan of the lengths gives cu_seqlens, then each thread
// writes its requests' [x0, x_1..x_l] and positions, and the tail is zero padding.
template <typename AnchorT, typename TokenT>
__global__ void __launch_bounds__(kScheduleThreads)
    pack_verify_inputs_kernel(const AnchorT* __restrict__ anchor,
                              const TokenT* __restrict__ draft_tokens, int64_t token_stride_b,
                              int64_t token_stride_j, const int32_t* __restrict__ num_verify,
                              const int64_t* __restrict__ position, int batch, int block,
                              int64_t* __restrict__ input_ids, int64_t* __restrict__ positions,
                              int32_t* __restrict__ cu_seqlens) {
  __shared__ int64_t scan_scratch[32];
  const int tid = threadIdx.x, threads = blockDim.x;
  const int per_thread = (batch + threads - 1) / threads;
  const int begin = min(tid * per_thread, batch), end = min(begin + per_thread, batch);
  int64_t segment = 0;
  for (int b = begin; b < end; ++b) segment += min(max(num_verify[b], 0), block) + 1;
  int64_t total;
  int64_t start = block_exclusive_scan(segment, scan_scratch, total);
  for (int b = begin; b < end; ++b) {
    const int n = min(max(num_verify[b], 0), block);
    const int64_t p0 = position[b];
    cu_seqlens[b] = static_cast<int32_t>(start);
    input_ids[start] = anchor[b];
    positions[start] = p0;
    for (int j = 0; j < n; ++j) {
      input_ids[start + 1 + j] = draft_tokens[b * token_stride_b + j * token_stride_j];
      positions[start + 1 + j] = p0 + 1 + j;
    }
    start += n + 1;
  }
  if (tid == 0) cu_seqlens[batch] = static_cast<int32_t>(total);
  for (int64_t s = total + tid; s < int64_t{batch} * (block + 1); s += threads) {
    input_ids[s] = 0;
    positions[s] = 0;
  }
}

}  // namespace dspark_ops::kernels
