// Sampling filters (top-k, top-p, min-p) of verify and the drafting ops, shared by the CPU and
// CUDA kernels (torch-free) and spelled the same way in dspark_ops/reference.py (README
// "Sampling filters").
//
// On one row of logits z (non-finite and disallowed entries already -inf), with row max m and
// weights w(v) = exp((z(v) - m) / T) (T = 1 for greedy rows), a token is kept iff its logit is
// finite and, in this order (transformers' warper order),
//   top-k: fewer than k tokens have a larger logit (ties at the boundary are kept);
//   top-p: the weight of the top-k-kept tokens with a larger logit is < top_p * their total weight;
//   min-p: w(v) >= min_p  (that is p(v) >= min_p * max p, since the max has weight 1).
// Top-k and top-p are both "an aggregate over the tokens ranked strictly above v is below a
// bound", so each keeps {z >= tau} for a threshold logit tau. It is found by a radix descent over
// order-preserving 32-bit keys of z, three digits of 11, 11 and 10 bits: per digit, a histogram
// (count, and for top-p float64 weight) of the candidates that share the digits chosen so far,
// then the lowest non-empty bucket whose aggregate above it is still below the bound. The CPU
// kernels walk a row serially (select_threshold below); the CUDA kernels use a whole thread
// block per row (filter.cuh). Weight sums are float64, so the two agree except at ~1e-16
// near-ties.
#pragma once

#include <math.h>

#include <cstdint>
#include <vector>

#include "../common/float_bits.h"
#include "sampling_math.h"  // softmax_weight

namespace dspark_ops {

constexpr int kFilterDigits = 3;
constexpr int kFilterBuckets = 1 << 11;  // of the widest digit

DSPARK_HOST_DEVICE int filter_digit_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
DSPARK_HOST_DEVICE uint32_t filter_digit_mask(int level) { return level == 2 ? 0x3FFu : 0x7FFu; }
// The key bits the digits above `level` fixed.
DSPARK_HOST_DEVICE uint32_t filter_fixed_bits(int level) {
  return level == 0 ? 0u : ~((uint32_t{1} << (filter_digit_shift(level - 1))) - 1u);
}

// Order-preserving key of a finite logit (-0 keys as +0, so equal logits have equal keys); every
// finite float has a key above kNoCandidate, -inf and non-candidates use it.
constexpr uint32_t kNoCandidate = 0;
DSPARK_HOST_DEVICE uint32_t logit_key(float z) {
  const uint32_t bits = float_bits(z + 0.f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
DSPARK_HOST_DEVICE float key_logit(uint32_t key) {
  return bits_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// Per-request filter settings, made safe for unchecked inputs: a top_k outside [1, V), a top_p
// that is NaN or >= 1 and a min_p that is NaN or <= 0 are off; top_p <= 0 keeps only the most
// probable tokens and min_p > 1 counts as 1.
struct FilterSpec {
  int32_t top_k;  // 0 = off
  float top_p;    // 1 = off
  float min_p;    // 0 = off
  DSPARK_HOST_DEVICE bool active() const { return top_k > 0 || top_p < 1.f || min_p > 0.f; }
};

// Request b's settings from the per-request arrays (null: that filter is off for every request).
DSPARK_HOST_DEVICE FilterSpec make_filter_spec(const int32_t* top_k_of, const float* top_p_of,
                                               const float* min_p_of, int64_t b, int64_t vocab) {
  const int32_t top_k = top_k_of ? top_k_of[b] : 0;
  const float top_p = top_p_of ? top_p_of[b] : 1.f, min_p = min_p_of ? min_p_of[b] : 0.f;
  FilterSpec f;
  f.top_k = top_k > 0 && top_k < vocab ? top_k : 0;
  f.top_p = top_p < 1.f ? fmaxf(top_p, 1e-30f) : 1.f;
  f.min_p = min_p > 0.f ? fminf(min_p, 1.f) : 0.f;
  return f;
}

// What a filtered row keeps: z >= tau and w >= min_weight (z finite); kept_sum = sum of the kept
// weights, the new normaliser.
struct FilterResult {
  float tau;
  float min_weight;
  float kept_sum;
};

DSPARK_HOST_DEVICE bool filter_keeps(const FilterResult& f, float z, float w) {
  return z != -INFINITY && z >= f.tau && w >= f.min_weight;
}

// The bucket the descent continues in, given the histogram of one digit: the lowest non-empty
// bucket whose aggregate above (`above` plus the buckets over it) is below `bound`; `above`
// becomes the aggregate over that bucket. The highest non-empty bucket always qualifies when
// `above` < `bound`, which the descent maintains.
inline uint32_t choose_bucket(const uint32_t* count, const double* aggregate, uint32_t buckets,
                              double bound, double& above) {
  uint32_t chosen = 0;
  double at_chosen = above, running = above;
  for (uint32_t d = buckets; d-- > 0;) {
    if (count[d] == 0) continue;
    if (!(running < bound)) break;
    chosen = d;
    at_chosen = running;
    running += aggregate[d];
  }
  above = at_chosen;
  return chosen;
}

// Serial radix descent over a row of keys (kNoCandidate = not a candidate) and weights. The
// candidates are the keys >= lower; a candidate is kept iff the aggregate over the candidates with
// a larger key is below the bound; returns t such that exactly the candidates with key >= t are
// kept. The aggregate is the count (bound = limit) or, by_weight, the sum of weights (bound =
// limit x the candidates' total weight, which `total` receives). After the first digit (or from
// the start, when `lower` already cuts the row down) the remaining candidates are listed, so the
// later digits visit only them, in the same index order.
inline uint32_t select_threshold(const uint32_t* keys, const float* weights, int64_t n,
                                 uint32_t lower, bool by_weight, double limit, double* total) {
  double bound = limit;
  std::vector<uint32_t> count(kFilterBuckets);
  std::vector<double> aggregate(kFilterBuckets);
  std::vector<int64_t> listed;
  bool use_list = lower > logit_key(-INFINITY);
  if (use_list) {
    for (int64_t x = 0; x < n; ++x) {
      if (keys[x] >= lower) listed.push_back(x);  // kNoCandidate is below every lower
    }
  }
  uint32_t prefix = 0;
  double above = 0.0;
  for (int level = 0; level < kFilterDigits; ++level) {
    const int shift = filter_digit_shift(level);
    const uint32_t mask = filter_digit_mask(level);
    const uint32_t high = filter_fixed_bits(level);
    std::fill(count.begin(), count.end(), 0u);
    std::fill(aggregate.begin(), aggregate.end(), 0.0);
    const auto add = [&](int64_t x) {
      const uint32_t key = keys[x];
      if (key == kNoCandidate || key < lower || (key & high) != prefix) return;
      const uint32_t d = (key >> shift) & mask;
      ++count[d];
      aggregate[d] += by_weight ? static_cast<double>(weights[x]) : 1.0;
    };
    if (use_list) {
      for (const int64_t x : listed) add(x);
    } else {
      for (int64_t x = 0; x < n; ++x) add(x);
    }
    if (level == 0 && by_weight) {
      double sum = 0.0;
      for (uint32_t d = 0; d <= mask; ++d) sum += aggregate[d];
      *total = sum;
      bound = limit * sum;
    }
    prefix |= choose_bucket(count.data(), aggregate.data(), mask + 1, bound, above) << shift;
    if (level + 1 == kFilterDigits) break;
    // Keep listed only the candidates that share the digits chosen so far.
    const uint32_t fixed = filter_fixed_bits(level + 1);
    const auto shares = [&](int64_t x) {
      const uint32_t key = keys[x];
      return key != kNoCandidate && key >= lower && (key & fixed) == prefix;
    };
    if (use_list) {
      int64_t kept = 0;
      for (const int64_t x : listed) {
        if (shares(x)) listed[kept++] = x;
      }
      listed.resize(kept);
    } else {
      for (int64_t x = 0; x < n; ++x) {
        if (shares(x)) listed.push_back(x);
      }
      use_list = true;
    }
  }
  return prefix;
}

// The filters of one row of logits z[0, n) (non-finite entries -inf) whose keys (logit_key, or
// kNoCandidate for -inf) and weights (softmax_weight, 0 for -inf) are given: the tokens they drop
// are set to -inf in z.
inline FilterResult filter_prepared_row(float* z, int64_t n, const FilterSpec& spec,
                                        const uint32_t* keys, const float* weights) {
  uint32_t threshold = logit_key(-INFINITY);  // every finite logit is above it
  if (spec.top_k > 0) threshold = select_threshold(keys, weights, n, threshold, false, spec.top_k, nullptr);
  if (spec.top_p < 1.f) {
    double total = 0.0;
    threshold = select_threshold(keys, weights, n, threshold, true, spec.top_p, &total);
  }
  FilterResult f{key_logit(threshold), spec.min_p, 0.f};
  double kept = 0.0;
  for (int64_t x = 0; x < n; ++x) {
    if (filter_keeps(f, z[x], weights[x])) {
      kept += weights[x];
    } else {
      z[x] = -INFINITY;
    }
  }
  f.kept_sum = static_cast<float>(kept);
  return f;
}

// The same with the keys and weights computed here into the scratch rows keys and weights.
inline FilterResult filter_row(float* z, int64_t n, float row_max, float inv_temperature,
                               const FilterSpec& spec, uint32_t* keys, float* weights) {
  for (int64_t x = 0; x < n; ++x) {
    keys[x] = z[x] == -INFINITY ? kNoCandidate : logit_key(z[x]);
    weights[x] = z[x] == -INFINITY ? 0.f : softmax_weight(z[x], row_max, inv_temperature);
  }
  return filter_prepared_row(z, n, spec, keys, weights);
}

}  // namespace dspark_ops
