// Scalar sampling math shared by the sampling kernels of every family and their CPU twins
// (torch-free): the greedy rule, the softmax weights (exp2), the acceptance test, the exponential
// race and the records their reductions merge (reduce.cuh). verify uses all of it; the drafting
// ops the greedy rule and the race's candidates; the sampling filters (filter_math.h) the weights.
//
// One function per step of docs/semantics.md §3.1 so both backends (and dspark_ops/reference.py,
// which spells the same formulas in PyTorch) round identically wherever they can:
//   greedy  <=> !(T > 1e-5)               (covers 0, negative and NaN temperatures)
//   w(x)    = exp((logit(x) - max) * (1/T)), non-finite logits count as -inf (as exp2, see below)
//   p(x)    = w(x) * (1/sum w)
//   accept x iff q(x) > 0 and u * q(x) < p(x)          (one-hot drafts: q(x) = 1)
//   sample  = argmax_x r(x) / E(x), r = max(p - q, 0), E(x) = -log1p(-u_x)  (exponential race:
//             the winner is distributed as r / sum r; it decomposes over any split of the vocab)
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "../common/exp2.h"
#include "../common/philox.h"

namespace dspark_ops {

constexpr float kGreedyTemperature = 1e-5f;
// A residual whose mass is at most this (p is normalised, so it is a fraction of the total) falls
// back to sampling from p.
constexpr float kMinResidualMass = 1e-12f;

// Per-row decision codes written by the kernels.
enum RowDecision : int32_t {
  kRowUndecided = 0,
  kRowAccepted = 1,
  kRowRejected = 2,
  kRowInvalid = 4,  // or-ed with kRowRejected: a row the op needed had no finite logit
};

DSPARK_HOST_DEVICE bool is_greedy(float temperature) { return !(temperature > kGreedyTemperature); }

DSPARK_HOST_DEVICE float finite_or_neg_inf(float v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v) ? v : -INFINITY;
#else
  return std::isfinite(v) ? v : -INFINITY;
#endif
}

// w = exp((logit - max) / T), computed as 2^((logit - max) * (log2(e) / T)) (common/exp2.h: one
// MUFU.EX2 on CUDA, where the streaming loops run one per element; expf is a dozen instructions).
// The change of base rounds the exponent twice more (log2(e)/T and the product): a relative error
// below |x| 2^-23 in w, x = (logit - max) / T (2.4e-6 at w = e^-20, where w no longer matters).
// -inf logits give w = 0 (the row max is finite wherever a weight is taken).
DSPARK_HOST_DEVICE float softmax_weight(float logit, float row_max, float inv_temperature) {
  return exp2_ftz((logit - row_max) * (inv_temperature * kLog2e));
}

// p(x) from a raw logit and the row's statistics; 0 for non-finite logits.
DSPARK_HOST_DEVICE float softmax_prob(float logit, float row_max, float inv_sum,
                                      float inv_temperature) {
  const float v = finite_or_neg_inf(logit);
  return v == -INFINITY ? 0.f : softmax_weight(v, row_max, inv_temperature) * inv_sum;
}

DSPARK_HOST_DEVICE bool accept_draft(float u, float p_x, float q_x) {
  return q_x > 0.f && u * q_x < p_x;
}

// Exp(1) noise of the race; small E (which decides low-probability winners) comes from small u,
// where the uniforms are finest.
DSPARK_HOST_DEVICE float exponential_from_uniform(float u) { return -log1pf(-u); }

// Running softmax statistics of one row (or part of one): max, sum of weights relative to max, and
// the lowest index attaining the max.
struct SoftmaxStats {
  float max;
  float sum;
  int32_t argmax;
};

DSPARK_HOST_DEVICE SoftmaxStats empty_stats() { return SoftmaxStats{-INFINITY, 0.f, -1}; }

// Merges two partial statistics; ties of the max go to the lower index.
DSPARK_HOST_DEVICE SoftmaxStats merge_stats(SoftmaxStats a, SoftmaxStats b, float inv_temperature) {
  if (b.max > a.max || (b.max == a.max && b.argmax >= 0 && (a.argmax < 0 || b.argmax < a.argmax))) {
    const SoftmaxStats t = a;
    a = b;
    b = t;
  }
  if (a.max == -INFINITY) return a;
  const float sum = b.max == -INFINITY
                        ? a.sum
                        : a.sum + b.sum * softmax_weight(b.max, a.max, inv_temperature);
  return SoftmaxStats{a.max, sum, a.argmax};
}

// Best candidate of an exponential race: largest key, ties to the lower index.
struct RaceCandidate {
  float key;
  int32_t index;
};

DSPARK_HOST_DEVICE RaceCandidate empty_candidate() { return RaceCandidate{-INFINITY, -1}; }

DSPARK_HOST_DEVICE RaceCandidate better_candidate(RaceCandidate a, RaceCandidate b) {
  if (b.index < 0) return a;
  if (a.index < 0 || b.key > a.key || (b.key == a.key && b.index < a.index)) return b;
  return a;
}

}  // namespace dspark_ops
