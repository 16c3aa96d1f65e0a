// Sampling filters (top-k, top-p, min-p) over one row by a whole thread block, torch-free.
//
// The rule and the radix descent are those of kernels/filter_math.h (the CPU kernels' serial
// version): per digit of the logits' order-preserving keys, the block builds a histogram in shared
// memory (count with 32-bit atomics, weight with float64 atomics), then picks the lowest non-empty
// bucket whose aggregate above is below the bound: thread t owns the buckets
// [B - (t + 1) * B / blockDim, B - t * B / blockDim), an exclusive scan over the threads gives
// each the aggregate above its buckets, and a min-reduction the chosen bucket.
//
// Row reads. The first digit of the first threshold (top-k, or top-p without top-k) is taken over
// the row; every token a filter can keep then has a key at or above that digit's bucket, so the
// second pass gathers those candidates (key and weight) into shared memory, and the remaining
// digits, top-p's three digits and the kept weight all run on chip. A typical top-k / top-p row
// is read twice (through L2: the caller's streaming pass has just read it). A caller that knows
// a floor under every token top-k keeps (the k-th largest of its threads' maxima: block_filter_row
// with `parts`; the highest of verify's per-chunk floors) saves top-k the first of those reads,
// and one that has already gathered every token at or above such a floor (verify's per-chunk
// lists) saves both (block_filter_from, FilterStart). When more than kFilterCandidates tokens qualify (top-p alone over a flat
// distribution, or a floor with too many ties), the descent goes on over the row instead: at
// most seven reads. Min-p alone needs one (the kept weight).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "filter_math.h"
#include "reduce.cuh"

namespace dspark_ops::kernels {

constexpr int kFilterValues = 8;         // elements per load8 call
constexpr int kFilterCandidates = 2560;  // on-chip candidates (8 bytes each)

// Shared memory of one block's filter work (dynamic shared memory of the caller, < 48 KB).
struct FilterShared {
  uint32_t count[kFilterBuckets];
  double weight[kFilterBuckets];
  uint32_t candidate_key[kFilterCandidates];
  float candidate_weight[kFilterCandidates];
  double sum_scratch[32];
  int bucket_scratch[32];
  double above;
  uint32_t candidates;  // gathered (may exceed kFilterCandidates: then none are used)
};

// Where a threshold's descent stands: the digits chosen so far and the aggregate above them.
struct Descent {
  uint32_t prefix = 0;
  int level = 0;
  double above = 0.0, bound = 0.0;
};

// One digit of a descent over the candidates `source` visits (source(visit) calls
// visit(key, weight) for this thread's share of them, weight() giving the candidate's softmax
// weight: a row's weights are computed only where a pass uses them): the candidates with
// key >= lower that share d.prefix are histogrammed by count (or, by_weight, by weight), and d
// moves to the chosen bucket. `limit` is the count bound, or the fraction of the level-0 total
// weight. Every thread calls it alike.
template <typename Source>
__device__ void descend_digit(const Source& source, uint32_t lower, bool by_weight, double limit,
                              Descent& d, FilterShared& sh) {
  const int shift = filter_digit_shift(d.level);
  const uint32_t mask = filter_digit_mask(d.level), high = filter_fixed_bits(d.level);
  for (int b = threadIdx.x; b < kFilterBuckets; b += blockDim.x) {
    sh.count[b] = 0;
    sh.weight[b] = 0.0;
  }
  __syncthreads();
  const uint32_t prefix = d.prefix;
  source([&](uint32_t key, const auto& weight) {
    if (key < lower || (key & high) != prefix) return;
    const uint32_t b = (key >> shift) & mask;
    atomicAdd(&sh.count[b], 1u);
    if (by_weight) atomicAdd(&sh.weight[b], static_cast<double>(weight()));
  });
  __syncthreads();

  const int per_thread = kFilterBuckets / blockDim.x;
  const int top = kFilterBuckets - 1 - static_cast<int>(threadIdx.x) * per_thread;
  const auto aggregate = [&](int b) {
    return by_weight ? sh.weight[b] : static_cast<double>(sh.count[b]);
  };
  double mine = 0.0;
  for (int i = 0; i < per_thread; ++i) mine += aggregate(top - i);
  double level_total = 0.0;
  double running = d.above + block_exclusive_scan(mine, sh.sum_scratch, level_total);
  if (d.level == 0) d.bound = by_weight ? limit * level_total : limit;
  int chosen = INT_MAX;
  double at_chosen = 0.0;
  for (int i = 0; i < per_thread; ++i) {
    const int b = top - i;
    if (sh.count[b] == 0) continue;
    if (!(running < d.bound)) break;
    chosen = b;
    at_chosen = running;
    running += aggregate(b);
  }
  const auto lowest = [](int a, int b) { return a < b ? a : b; };
  const int bucket = block_reduce(chosen, lowest, INT_MAX, sh.bucket_scratch);
  if (chosen == bucket) sh.above = at_chosen;  // one owner
  __syncthreads();
  d.above = sh.above;
  d.prefix |= static_cast<uint32_t>(bucket) << shift;
  ++d.level;
  __syncthreads();  // the next digit clears the histogram
}

// Where block_filter_from starts top-k (or top-p without top-k).
enum class FilterStart {
  kRow,     // the first digit over the row
  kFloor,   // one gather of the row's tokens with keys at or above `floor` (a key at or below the
            // k-th largest: every token top-k keeps is gathered)
  kOnChip,  // the caller has put the candidates on chip (sh.candidate_key/_weight[0,
            // sh.candidates), before a barrier): every finite token with a key at or above
            // `floor`, a key at or below the k-th largest; requires top-k
};

// The filters of one row (row_max its max; spec.active()) by the whole block; every thread gets
// the result. load8(x, v) yields elements [x, x + 8) of the row, dropped ones (non-finite,
// disallowed, past the end) as -inf. `start` says what the caller knows (FilterStart): from a
// floor under top-k's threshold, the descent never visits the tokens below it, so the row is read
// once (kFloor) or not at all (kOnChip), unless more than kFilterCandidates tokens qualify.
template <typename Load8>
__device__ FilterResult block_filter_from(const Load8& load8, int64_t n, float row_max,
                                          float inv_t, const FilterSpec& spec, FilterShared& sh,
                                          FilterStart start, uint32_t floor) {
  const auto row = [&](const auto& visit) {
    for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < n;
         x += int64_t{blockDim.x} * kFilterValues) {
      float v[kFilterValues];
      load8(x, v);
#pragma unroll
      for (int k = 0; k < kFilterValues; ++k) {
        if (v[k] != -INFINITY) {
          visit(logit_key(v[k]), [&] { return softmax_weight(v[k], row_max, inv_t); });
        }
      }
    }
  };
  const auto on_chip = [&](const auto& visit) {
    for (uint32_t i = threadIdx.x; i < sh.candidates; i += blockDim.x) {
      visit(sh.candidate_key[i], [&] { return sh.candidate_weight[i]; });
    }
  };
  bool gathered = start == FilterStart::kOnChip;
  const auto digit = [&](uint32_t lower, bool by_weight, double limit, Descent& d) {
    if (gathered) {
      descend_digit(on_chip, lower, by_weight, limit, d, sh);
    } else {
      descend_digit(row, lower, by_weight, limit, d, sh);
    }
  };

  // One pass over the row gathering the tokens with keys at or above `low` into shared memory;
  // whether they all fit.
  const auto gather = [&](uint32_t low) {
    if (threadIdx.x == 0) sh.candidates = 0;
    __syncthreads();
    row([&](uint32_t key, const auto& weight) {
      if (key < low) return;
      const uint32_t i = atomicAdd(&sh.candidates, 1u);
      if (i < kFilterCandidates) {
        sh.candidate_key[i] = key;
        sh.candidate_weight[i] = weight();
      }
    });
    __syncthreads();
    return sh.candidates <= kFilterCandidates;
  };

  uint32_t threshold = logit_key(-INFINITY);  // every finite logit is above it
  if (spec.top_k > 0 || spec.top_p < 1.f) {
    const bool top_k = spec.top_k > 0;
    const double limit = top_k ? static_cast<double>(spec.top_k) : static_cast<double>(spec.top_p);
    if (top_k && start == FilterStart::kFloor) gathered = gather(floor);
    Descent first;
    if (!gathered) {  // the first digit over the row, then the candidates at or above its bucket
      digit(threshold, !top_k, limit, first);
      gathered = gather(first.prefix);
    }
    while (first.level < kFilterDigits) digit(threshold, !top_k, limit, first);
    threshold = first.prefix;
    if (top_k && spec.top_p < 1.f) {
      Descent second;
      while (second.level < kFilterDigits) digit(threshold, true, spec.top_p, second);
      threshold = second.prefix;
    }
  }
  FilterResult f{key_logit(threshold), spec.min_p, 0.f};
  double kept = 0.0;
  const auto add_kept = [&](uint32_t key, const auto& weight) {
    if (key < threshold) return;
    const float w = weight();
    if (w >= f.min_weight) kept += w;
  };
  if (gathered) {
    on_chip(add_kept);
  } else {
    row(add_kept);
  }
  const auto add = [](double a, double b) { return a + b; };
  f.kept_sum = static_cast<float>(block_reduce(kept, add, 0.0, sh.sum_scratch));
  return f;
}

// block_filter_from, with a floor from the maxima of disjoint parts of the row: with `parts` > 0
// the caller has put in sh.candidate_key[0, parts) (and sh.candidates = parts, before a barrier)
// the keys of the largest elements of `parts` disjoint parts of the row (logit_key(-inf) for a
// part with none): for top-k with k <= parts, the k-th largest of them has k tokens at or above
// it, so every token top-k keeps is too, and one gather of the tokens at or above it replaces the
// first digit's pass over the row.
template <typename Load8>
__device__ FilterResult block_filter_row(const Load8& load8, int64_t n, float row_max,
                                         float inv_t, const FilterSpec& spec, FilterShared& sh,
                                         int parts = 0) {
  if (spec.top_k <= 0 || spec.top_k > parts) {
    return block_filter_from(load8, n, row_max, inv_t, spec, sh, FilterStart::kRow, 0u);
  }
  // The floor: the k-th largest of the parts' maxima, by a count descent on chip.
  const auto maxima = [&](const auto& visit) {
    for (uint32_t i = threadIdx.x; i < sh.candidates; i += blockDim.x) {
      visit(sh.candidate_key[i], [&] { return 0.f; });
    }
  };
  Descent d;
  while (d.level < kFilterDigits) {
    descend_digit(maxima, logit_key(-INFINITY), false, static_cast<double>(spec.top_k), d, sh);
  }
  return block_filter_from(load8, n, row_max, inv_t, spec, sh, FilterStart::kFloor, d.prefix);
}

}  // namespace dspark_ops::kernels
