// CUDA kernels of the scheduling family (docs/semantics.md §3.4), torch-free.
//
// Math: kernels/schedule_math.h (shared with the CPU kernels). Each op is one launch of one block
// of 1024 threads, which is all B <= 1024, G <= 32 needs; the cost is launch latency plus a few
// microseconds, and no host sync:
//   1. survivals per request (a thread walks its request's G confidences) -> the pair's 64-bit
//      key (pair_key: survival descending, then j, then r, the CPU kernel's ranking), stored at
//      r * G + j; the request's lengths are zeroed. Survivals never grow along j and j breaks
//      ties, so each request's G keys are already a sorted run. The thread also loads the step
//      rates of its admission counts in phase 3, so that wait overlaps this one;
//   2. merge sort of the B runs: ceil(log2 B) rounds, each merging pairs of adjacent runs. A thread
//      produces 8 consecutive outputs (merge path: one binary search for its start, then a serial
//      merge). In dynamic shared memory up to 16384 keys (B = 1024, G = 16: 128 KB) where the
//      device's opt-in limit per block allows: a thread keeps its up to 2 x 8 outputs in
//      registers until every thread has read its inputs, then writes them back in place; else a
//      global workspace of two buffers (at most 2^20 pairs are allowed). Eligible keys are
//      distinct, so the sorted keys are the CPU kernel's ranking itself;
//   3. schedule/plan: fixed-point prefix sums of the sorted survivals (a block scan over
//      contiguous per-thread segments), Theta for every admission count, then a block reduction:
//      the first admission that does not improve Theta (schedule) or the best Theta (plan);
//      allocate: admit min(budget - B, eligible);
//   4. num_verify: every admitted pair raises its request's length to j + 1 (a shared-nothing
//      atomic max in global memory, nothing waits for it): the ranked order needs no tie search.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/philox.h"
#include "reduce.cuh"
#include "schedule_math.h"
#include "launch.cuh"
#include "schedule_launch.h"

namespace dspark_ops::kernels {

// Best Theta so far and its admission count (ties to the smaller count).
struct PlanCandidate {
  double theta;
  int count;
};

// The shared-memory margin (schedule_launch.h) covers schedule_kernel's static arrays.
static_assert(32 * (sizeof(int64_t) + sizeof(int) + sizeof(PlanCandidate)) <=
              kScheduleStaticSharedMargin);

__device__ __forceinline__ PlanCandidate shfl_down(PlanCandidate c, int offset) {
  return PlanCandidate{__shfl_down_sync(kFullMask, c.theta, offset),
                       __shfl_down_sync(kFullMask, c.count, offset)};
}

__device__ __forceinline__ PlanCandidate better_plan(PlanCandidate a, PlanCandidate b) {
  return b.theta > a.theta || (b.theta == a.theta && b.count < a.count) ? b : a;
}

// Outputs [p, p + kMergeItems) (those below n) of the merge round whose sorted runs are `width`
// long: runs 2i and 2i + 1 merge into [2i * width, (2i + 2) * width). Only ineligible keys are
// equal, and they are indistinguishable, so the tie rule only has to agree between the search and
// the merge.
// Crossing: 2 * width is not a multiple of kMergeItems, so a segment may run into the next pair of
// runs (small odd G, first rounds); else that check is left out of the steps.
template <bool Crossing>
__device__ __forceinline__ void merge_segment(const uint64_t* keys, int n, int width, int p,
                                              uint64_t (&out)[kMergeItems]) {
  const int group = p - p % (2 * width);
  int a = group, a_end = min(group + width, n), b_end = min(group + 2 * width, n);
  const int diagonal = p - group;
  int lo = max(0, diagonal - (b_end - a_end)), hi = min(diagonal, a_end - a);
  while (lo < hi) {  // how many of the first `diagonal` outputs come from run A
    const int mid = (lo + hi) >> 1;
    if (keys[a + mid] <= keys[a_end + diagonal - 1 - mid]) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  int b = a_end + diagonal - lo;
  a += lo;
  uint64_t a_key = a < a_end ? keys[a] : 0u, b_key = b < b_end ? keys[b] : 0u;
#pragma unroll
  for (int i = 0; i < kMergeItems; ++i) {
    if (Crossing) {
      const int at = p + i;
      if (at == b_end && at < n) {  // the next pair of runs starts here
        a = at;
        a_end = min(at + width, n);
        b = a_end;
        b_end = min(at + 2 * width, n);
        a_key = keys[a];
        b_key = b < b_end ? keys[b] : 0u;
      }
    }
    // Branch-free step: one predicated load of the successor of the key taken.
    const bool take_a = b >= b_end || (a < a_end && a_key <= b_key);
    out[i] = take_a ? a_key : b_key;
    a += take_a;
    b += !take_a;
    const int next = take_a ? a : b;
    const uint64_t loaded = next < (take_a ? a_end : b_end) ? keys[next] : 0u;
    a_key = take_a ? loaded : a_key;
    b_key = take_a ? b_key : loaded;
  }
}

__device__ __forceinline__ uint4 pack_keys(uint64_t first, uint64_t second) {
  return make_uint4(static_cast<uint32_t>(first), static_cast<uint32_t>(first >> 32),
                    static_cast<uint32_t>(second), static_cast<uint32_t>(second >> 32));
}

__device__ __forceinline__ void store_segment(uint64_t* keys, int n, int p,
                                              const uint64_t (&out)[kMergeItems]) {
  if (p + kMergeItems <= n) {  // p is a multiple of 8: 64-byte aligned
    uint4* to = reinterpret_cast<uint4*>(keys + p);
#pragma unroll
    for (int i = 0; i < kMergeItems / 2; ++i) to[i] = pack_keys(out[2 * i], out[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < kMergeItems; ++i) {
      if (p + i < n) keys[p + i] = out[i];
    }
  }
}

// The pair keys of request r, ineligible past its cap, walked in order.
template <typename Visit>
__device__ __forceinline__ void walk_request(const ScheduleParams& p, int r, Visit visit) {
  const float* __restrict__ confidence = p.confidence + int64_t{r} * p.block;
  const int cap = p.max_verify ? min(max(p.max_verify[r], 0), p.block) : p.block;
  float a = 1.f;
  for (int j = 0; j < p.block; ++j) {
    a *= clamp_confidence(confidence[j]);
    visit(j, j < cap ? pair_key(a, static_cast<uint32_t>(j * p.batch + r)) : kIneligible);
  }
}

// SharedSort: the keys live in dynamic shared memory (schedule_sorts_in_shared), else in
// p.global_keys; separate instantiations so the shared path compiles to LDS/STS.
template <int Mode, bool SharedSort>
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const ScheduleParams p) {
  DSPARK_EXTERN_SHARED(uint64_t, dynamic_keys);
  __shared__ int64_t scan_scratch[32];
  __shared__ int int_scratch[32];
  __shared__ PlanCandidate plan_scratch[32];
  uint64_t* keys = SharedSort ? dynamic_keys : p.global_keys;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int pairs = p.batch * p.block;
  wait_for_previous_grid();  // a dependent launch: the confidences may be the stream's last writes

  // Phase 3's contiguous segments of admission counts are sized by the most admissions there can
  // be, not yet by the eligible count, so a thread reads the step rates of its segment's first
  // two counts now, beside the confidences: only its later counts (B * G > 1024) read theirs then.
  const int64_t room = p.capacity - 1 - p.batch;  // admissions that keep the batch below M
  const int most = static_cast<int>(room < pairs ? (room < 0 ? 0 : room) : pairs);
  const int per_thread = (most + threads - 1) / threads;
  float first_rate = 0.f, second_rate = 0.f;  // step_rate[batch + begin], [batch + begin + 1]
  if (Mode != kModeAllocate) {
    const int64_t first = int64_t{p.batch} + min(tid * per_thread, most);  // <= M - 1
    first_rate = p.step_rate[first];
    if (first + 1 < p.capacity) second_rate = p.step_rate[first + 1];
  }

  // 1. Pair keys, one sorted run per request; positions past a cap or after a zero survival are
  // ineligible (and sort last). Lengths start at zero (phase 4 raises them).
  int my_eligible = 0;
  for (int r = tid; r < p.batch; r += threads) {
    walk_request(p, r, [&](int j, uint64_t key) {
      keys[r * p.block + j] = key;
      my_eligible += key != kIneligible;
    });
    if (Mode != kModePlan) p.num_verify[r] = 0;
  }
  const int eligible = block_reduce(my_eligible, [](int a, int b) { return a + b; }, 0,
                                    int_scratch);  // its barriers publish the keys and zeros

  // 2. Merge rounds: runs of G, 2G, 4G, ... keys.
  uint64_t* spare = SharedSort ? nullptr : p.global_keys + (pairs + 7) / 8 * 8;
  for (int width = p.block; width < pairs; width *= 2) {
    uint64_t out[kMergeChunks][kMergeItems];
    const bool crossing = (2 * width) % kMergeItems != 0;  // block-uniform
    const auto merge = [&](int at, uint64_t(&to)[kMergeItems]) {
      if (crossing) {
        merge_segment<true>(keys, pairs, width, at, to);
      } else {
        merge_segment<false>(keys, pairs, width, at, to);
      }
    };
    if constexpr (SharedSort) {
#pragma unroll
      for (int c = 0; c < kMergeChunks; ++c) {
        const int at = (tid + c * threads) * kMergeItems;
        if (at < pairs) merge(at, out[c]);
      }
    } else {
      for (int at = tid * kMergeItems; at < pairs; at += threads * kMergeItems) {
        merge(at, out[0]);
        store_segment(spare, pairs, at, out[0]);
      }
    }
    __syncthreads();  // shared: every input read before any is overwritten; global: round done
    if constexpr (SharedSort) {
#pragma unroll
      for (int c = 0; c < kMergeChunks; ++c) {
        const int at = (tid + c * threads) * kMergeItems;
        if (at < pairs) store_segment(keys, pairs, at, out[c]);
      }
      __syncthreads();
    } else {
      uint64_t* const sorted = spare;
      spare = keys;
      keys = sorted;
    }
  }

  // 3. How many ranked pairs to admit.
  int admitted;
  if (Mode == kModeAllocate) {
    const int64_t want = int64_t{p.budget[0]} - p.batch;  // int64: no overflow on any budget
    admitted = static_cast<int>(want < 0 ? 0 : (want < eligible ? want : eligible));
  } else {
    const int limit = min(eligible, most);
    const int begin = min(tid * per_thread, limit), end = min(begin + per_thread, limit);
    int64_t segment = 0;
    for (int k = begin; k < end; ++k) segment += fixed_survival(key_survival(keys[k]));
    int64_t total;
    int64_t tau = int64_t{p.batch} * static_cast<int64_t>(kSurvivalScale) +
                  block_exclusive_scan(segment, scan_scratch, total);
    // Theta after k admissions is theta(tau_k, batch + k); this thread covers k in [begin, end].
    // A thread with some k (and thread 0, whose begin is 0) has begin = tid * per_thread: the
    // prefetched rates are its first two.
    const auto theta_after = [&](int64_t tau_k, int k) {  // theta(tau_k, batch + k + 1)
      return theta(tau_k, k == begin ? second_rate : p.step_rate[p.batch + k + 1]);
    };
    double previous = theta(tau, first_rate);
    if (Mode == kModeSchedule) {
      int first_stop = limit;
      for (int k = begin; k < end; ++k) {
        tau += fixed_survival(key_survival(keys[k]));
        const double value = theta_after(tau, k);
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
        best = better_plan(best, PlanCandidate{theta_after(tau, k), k + 1});
      }
      best = block_reduce(best, better_plan, PlanCandidate{-INFINITY, 0}, plan_scratch);
      if (tid == 0) p.budget_out[0] = p.batch + best.count;
      return;
    }
  }

  // 4. Lengths: the admitted pairs are the first `admitted` keys; a request's are a prefix of its
  // positions (j breaks ties), so its length is its largest admitted j + 1.
  for (int k = tid; k < admitted; k += threads) {
    const uint32_t index = key_index(keys[k]);
    atomicMax(p.num_verify + index % p.batch, static_cast<int>(index / p.batch) + 1);
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
      positions[start + 1 + j] = offset_position(p0, 1 + j);
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
