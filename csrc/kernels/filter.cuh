// Sampling filters (top-k, top-p, min-p) over one row by a whole thread block, torch-free.
//
// The rule and the radix descent are those of kernels/filter_math.h (the CPU kernels' serial
// version): per digit of the logits' order-preserving keys, the block builds a histogram in shared
// memory (count with 32-bit atomics, weight with float64 atomics), then picks the lowest non-empty
// bucket whose aggregate above is below the bound: thread t owns the buckets
// [B - (t + 1) * B / blockDim, B - t * B / blockDim), an exclusive scan over the threads gives
// each the aggregate above its buckets, and a min-reduction the chosen bucket. A row costs at most
// seven passes (three digits for top-k, three for top-p, one for the kept weight), each reading
// the row through L2: the caller's streaming pass has just read it.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "filter_math.h"
#include "reduce.cuh"

namespace dspark_ops::kernels {

constexpr int kFilterValues = 8;  // elements per load8 call

// Shared memory of one block's filter work (dynamic shared memory of the caller).
struct FilterShared {
  uint32_t count[kFilterBuckets];
  double weight[kFilterBuckets];
  double sum_scratch[32];
  int bucket_scratch[32];
  double above;
};

// One digit's histogram and chosen bucket; see select_threshold in filter_math.h. Every thread
// of the block calls it with the same arguments; load8(x, v) yields elements [x, x + 8) of the
// row, dropped ones (non-finite, disallowed, past the end) as -inf.
template <typename Load8>
__device__ uint32_t block_select_threshold(const Load8& load8, int64_t n, float row_max,
                                           float inv_t, uint32_t lower, bool by_weight,
                                           double limit, FilterShared& sh) {
  uint32_t prefix = 0;
  double above = 0.0, bound = limit;
  const int per_thread = kFilterBuckets / blockDim.x;
  for (int level = 0; level < kFilterDigits; ++level) {
    const int shift = filter_digit_shift(level);
    const uint32_t mask = filter_digit_mask(level), high = filter_fixed_bits(level);
    for (int d = threadIdx.x; d < kFilterBuckets; d += blockDim.x) {
      sh.count[d] = 0;
      sh.weight[d] = 0.0;
    }
    __syncthreads();
    for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < n;
         x += int64_t{blockDim.x} * kFilterValues) {
      float v[kFilterValues];
      load8(x, v);
#pragma unroll
      for (int k = 0; k < kFilterValues; ++k) {
        if (v[k] == -INFINITY) continue;
        const uint32_t key = logit_key(v[k]);
        if (key < lower || (key & high) != prefix) continue;
        const uint32_t d = (key >> shift) & mask;
        atomicAdd(&sh.count[d], 1u);
        if (by_weight) {
          atomicAdd(&sh.weight[d], static_cast<double>(softmax_weight(v[k], row_max, inv_t)));
        }
      }
    }
    __syncthreads();

    const int top = kFilterBuckets - 1 - static_cast<int>(threadIdx.x) * per_thread;
    double mine = 0.0;
    for (int i = 0; i < per_thread; ++i) {
      mine += by_weight ? sh.weight[top - i] : static_cast<double>(sh.count[top - i]);
    }
    double level_total = 0.0;
    double running = above + block_exclusive_scan(mine, sh.sum_scratch, level_total);
    if (level == 0 && by_weight) bound = limit * level_total;
    int chosen = INT_MAX;
    double at_chosen = 0.0;
    for (int i = 0; i < per_thread; ++i) {
      const int d = top - i;
      if (sh.count[d] == 0) continue;
      if (!(running < bound)) break;
      chosen = d;
      at_chosen = running;
      running += by_weight ? sh.weight[d] : static_cast<double>(sh.count[d]);
    }
    const auto lowest = [](int a, int b) { return a < b ? a : b; };
    const int bucket = block_reduce(chosen, lowest, INT_MAX, sh.bucket_scratch);
    if (chosen == bucket) sh.above = at_chosen;  // one owner
    __syncthreads();
    above = sh.above;
    prefix |= static_cast<uint32_t>(bucket) << shift;
    __syncthreads();  // the next digit clears the histogram
  }
  return prefix;
}

// The filters of one row (row_max its max; spec.active()) by the whole block; every thread gets
// the result.
template <typename Load8>
__device__ FilterResult block_filter_row(const Load8& load8, int64_t n, float row_max,
                                         float inv_t, const FilterSpec& spec, FilterShared& sh) {
  uint32_t threshold = logit_key(-INFINITY);  // every finite logit is above it
  if (spec.top_k > 0) {
    threshold = block_select_threshold(load8, n, row_max, inv_t, threshold, false, spec.top_k, sh);
  }
  if (spec.top_p < 1.f) {
    threshold = block_select_threshold(load8, n, row_max, inv_t, threshold, true, spec.top_p, sh);
  }
  FilterResult f{key_logit(threshold), spec.min_p, 0.f};
  double kept = 0.0;
  for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < n;
       x += int64_t{blockDim.x} * kFilterValues) {
    float v[kFilterValues];
    load8(x, v);
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) {
      const float w = v[k] == -INFINITY ? 0.f : softmax_weight(v[k], row_max, inv_t);
      if (filter_keeps(f, v[k], w)) kept += w;
    }
  }
  const auto add = [](double a, double b) { return a + b; };
  f.kept_sum = static_cast<float>(block_reduce(kept, add, 0.0, sh.sum_scratch));
  return f;
}

}  // namespace dspark_ops::kernels
