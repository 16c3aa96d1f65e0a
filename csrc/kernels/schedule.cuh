// CUDA kernels of the scheduling family (docs/semantics.md §3.4), torch-free.
//
// Math: kernels/schedule_math.h (shared with the CPU kernels). Each op is one launch of one block
// of 1024 threads, which is all B <= 1024, G <= 32 needs; the cost is launch latency plus a few
// microseconds, and no host sync:
//   1. survivals per request (a thread walks its request's G confidences) -> one 32-bit survival
//      key per pair (survival_key: ascending = survival descending), stored at r * G + j. Survivals
//      never grow along j, so each request's G keys are already a sorted run;
//   2. merge sort of the B runs: ceil(log2 B) rounds, each merging pairs of adjacent runs. A thread
//      produces 8 consecutive outputs (merge path: one binary search for its start, then a serial
//      merge). In dynamic shared memory up to 32768 keys (B = 1024, G = 32: 128 KB) where the
//      device's opt-in limit per block allows: a thread keeps its up to 4 x 8 outputs in
//      registers until every thread has read its inputs, then writes them back in place; else a
//      global workspace of two buffers (at most 2^20 pairs are allowed). B = 256, G = 16 is 8
//      rounds of one search (at most 12 steps) and 8 merge steps in 512 threads, where a bitonic
//      sort of the 4096 keys took 78 stages;
//   3. schedule/plan: fixed-point prefix sums of the sorted survivals (a block scan over
//      contiguous per-thread segments), Theta for every admission count, then a block reduction:
//      the first admission that does not improve Theta (schedule) or the best Theta (plan);
//      allocate: admit min(budget - B, eligible). Equal survivals add equally, so the sums need
//      no tie order;
//   4. num_verify: the admitted pairs are those ranked before the last admitted survival s*, and
//      the first m of the pairs equal to s* in (j, r) order. A request's pairs equal to s* are a
//      run of positions; when not all of them are admitted, a binary search over j finds the
//      position j* where the m-th falls, and a block scan over requests ranks those tied at j*.
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
// long: runs 2i and 2i + 1 merge into [2i * width, (2i + 2) * width). Equal keys are
// indistinguishable, so the tie rule only has to agree between the search and the merge.
// Crossing: 2 * width is not a multiple of kMergeItems, so a segment may run into the next pair of
// runs (small odd G, first rounds); else that check is left out of the steps.
template <bool Crossing>
__device__ __forceinline__ void merge_segment(const uint32_t* keys, int n, int width, int p,
                                              uint32_t (&out)[kMergeItems]) {
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
  uint32_t a_key = a < a_end ? keys[a] : 0u, b_key = b < b_end ? keys[b] : 0u;
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
    const uint32_t loaded = next < (take_a ? a_end : b_end) ? keys[next] : 0u;
    a_key = take_a ? loaded : a_key;
    b_key = take_a ? b_key : loaded;
  }
}

__device__ __forceinline__ void store_segment(uint32_t* keys, int n, int p,
                                              const uint32_t (&out)[kMergeItems]) {
  if (p + kMergeItems <= n) {  // p is a multiple of 8: 16-byte aligned
    uint4* to = reinterpret_cast<uint4*>(keys + p);
    to[0] = make_uint4(out[0], out[1], out[2], out[3]);
    to[1] = make_uint4(out[4], out[5], out[6], out[7]);
  } else {
#pragma unroll
    for (int i = 0; i < kMergeItems; ++i) {
      if (p + i < n) keys[p + i] = out[i];
    }
  }
}

// The survival keys of request r below its cap, walked in order.
template <typename Visit>
__device__ __forceinline__ void walk_request(const ScheduleParams& p, int r, Visit visit) {
  const float* __restrict__ confidence = p.confidence + int64_t{r} * p.block;
  const int cap = p.max_verify ? min(max(p.max_verify[r], 0), p.block) : p.block;
  float a = 1.f;
  for (int j = 0; j < p.block; ++j) {
    a *= clamp_confidence(confidence[j]);
    visit(j, j < cap ? survival_key(a) : kIneligibleSurvival);
  }
}

// SharedSort: the keys live in dynamic shared memory (schedule_sorts_in_shared), else in
// p.global_keys; separate instantiations so the shared path compiles to LDS/STS.
template <int Mode, bool SharedSort>
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const ScheduleParams p) {
  DSPARK_EXTERN_SHARED(uint32_t, dynamic_keys);
  __shared__ int64_t scan_scratch[32];
  __shared__ int int_scratch[32];
  __shared__ PlanCandidate plan_scratch[32];
  uint32_t* keys = SharedSort ? dynamic_keys : p.global_keys;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int pairs = p.batch * p.block;

  // 1. Survival keys, one sorted run per request; positions past a cap or after a zero survival
  // are ineligible (and sort last).
  int my_eligible = 0;
  for (int r = tid; r < p.batch; r += threads) {
    walk_request(p, r, [&](int j, uint32_t key) {
      keys[r * p.block + j] = key;
      my_eligible += key != kIneligibleSurvival;
    });
  }
  const int eligible = block_reduce(my_eligible, [](int a, int b) { return a + b; }, 0,
                                    int_scratch);  // its barriers publish the keys

  // 2. Merge rounds: runs of G, 2G, 4G, ... keys.
  uint32_t* spare = SharedSort ? nullptr : p.global_keys + (pairs + 7) / 8 * 8;
  for (int width = p.block; width < pairs; width *= 2) {
    uint32_t out[kMergeChunks][kMergeItems];
    const bool crossing = (2 * width) % kMergeItems != 0;  // block-uniform
    const auto merge = [&](int at, uint32_t(&to)[kMergeItems]) {
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
      uint32_t* const sorted = spare;
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
    const int64_t room = p.capacity - 1 - p.batch;  // admissions that keep the batch below M
    const int limit = static_cast<int>(eligible < room ? eligible : room);
    const int per_thread = (limit + threads - 1) / threads;
    const int begin = min(tid * per_thread, limit), end = min(begin + per_thread, limit);
    int64_t segment = 0;
    for (int k = begin; k < end; ++k) segment += fixed_survival(survival_of(keys[k]));
    int64_t total;
    int64_t tau = int64_t{p.batch} * static_cast<int64_t>(kSurvivalScale) +
                  block_exclusive_scan(segment, scan_scratch, total);
    // Theta after k admissions is theta(tau_k, batch + k); this thread covers k in [begin, end].
    double previous = theta(tau, p.step_rate, p.batch + begin);
    if (Mode == kModeSchedule) {
      int first_stop = limit;
      for (int k = begin; k < end; ++k) {
        tau += fixed_survival(survival_of(keys[k]));
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
        tau += fixed_survival(survival_of(keys[k]));
        best = better_plan(best, PlanCandidate{theta(tau, p.step_rate, p.batch + k + 1), k + 1});
      }
      best = block_reduce(best, better_plan, PlanCandidate{-INFINITY, 0}, plan_scratch);
      if (tid == 0) p.budget_out[0] = p.batch + best.count;
      return;
    }
  }

  // 4. Lengths. Pairs ranked before s* = keys[admitted - 1]: those with a smaller key; then m
  // pairs whose key equals it, in (j, r) order.
  if (admitted == 0) {
    for (int r = tid; r < p.batch; r += threads) p.num_verify[r] = 0;
    return;
  }
  const uint32_t last = keys[admitted - 1];
  int lo = 0, hi = admitted - 1;  // the first rank holding `last` (the same search in every thread)
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (keys[mid] < last) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int ties_admitted = admitted - lo;
  // Per request: its pairs below `last` (a prefix of positions) and its run tied with `last`,
  // right after them. Request tid's in registers; those of later chunks (B > 1024, so G < 1024)
  // packed into num_verify until the final lengths replace them.
  int my_before = 0, my_tied = 0, my_ties = 0;
  for (int base = 0; base < p.batch; base += threads) {
    const int r = base + tid;
    if (r >= p.batch) break;
    int before = 0, tied = 0;
    walk_request(p, r, [&](int, uint32_t key) {
      before += key < last;
      tied += key == last;
    });
    if (base == 0) {
      my_before = before;
      my_tied = tied;
    } else {
      p.num_verify[r] = before + 65536 * tied;
    }
    my_ties += tied;
  }
  const auto runs = [&](int base, int& before, int& tied) {
    if (base == 0) {
      before = my_before;
      tied = my_tied;
    } else {
      const int packed = p.num_verify[base + tid];
      before = packed & 0xFFFF;
      tied = packed >> 16;
    }
  };
  const auto sum = [](int a, int b) { return a + b; };
  const int ties = block_reduce(my_ties, sum, 0, int_scratch);
  // Tied pairs rank by (j, r): find the position j* of the ties_admitted-th and how many tied at
  // j* are admitted (a binary search over j, one block reduction a step); all of them when every
  // tied pair is admitted (the usual case: `last` unique).
  int tie_position = p.block, ties_there = 0;
  if (ties > ties_admitted) {
    int low = 0, high = p.block - 1, below = 0;  // below = ties at positions < low
    while (low < high) {
      const int mid = (low + high) >> 1;
      int up_to_mid = 0;  // ties at positions <= mid
      for (int base = 0; base < p.batch && base + tid < p.batch; base += threads) {
        int before, tied;
        runs(base, before, tied);
        up_to_mid += min(max(mid + 1 - before, 0), tied);
      }
      up_to_mid = block_reduce(up_to_mid, sum, 0, int_scratch);
      if (up_to_mid >= ties_admitted) {
        high = mid;
      } else {
        low = mid + 1;
        below = up_to_mid;
      }
    }
    tie_position = low;
    ties_there = ties_admitted - below;
  }
  int64_t ranked = 0;  // requests tied at j* in earlier chunks
  for (int base = 0; base < p.batch; base += threads) {  // uniform trip count: block scans
    const int r = base + tid;
    int before = 0, tied = 0;
    if (r < p.batch) runs(base, before, tied);
    const bool at_j = before <= tie_position && tie_position < before + tied;
    int64_t rank = 0;
    if (ties > ties_admitted) {  // block-uniform
      int64_t chunk_total;
      rank = ranked + block_exclusive_scan(int64_t{at_j}, scan_scratch, chunk_total);
      ranked += chunk_total;
    }
    if (r < p.batch) {
      const int tied_before_j = min(max(tie_position - before, 0), tied);
      p.num_verify[r] = before + tied_before_j + (at_j && rank < ties_there ? 1 : 0);
    }
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
