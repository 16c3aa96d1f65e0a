// The certificate of the drafting CPU kernels' float32 head (cpu/draft_cpu.cpp): a proven bound
// on its error against the float64 head of the reference, and the tests that decide from it
// whether a request's token (and its filter decisions) is certainly the exact head's.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "draft_keys.h"
#include "../kernels/filter_math.h"

namespace dspark_ops::draft_cpu {

// ---- The certificate of the float32 head ----------------------------------------------------
//
// Notation: u = 2^-24 (float32 unit roundoff), gamma(n) = n u / (1 - n u). For request b the
// exact head computes d_e(v) = W2[v] . x_b in float64 and z_e(v) = fl32(d_e(v) + base(v)); the
// fast head computes d_f(v) with float32 fused multiply-adds and z_f(v) = fl32(d_f(v) + base(v))
// (the addition in float64).
//
// 1. Dot product. fast_dot keeps one accumulator per vector lane (L lanes, each a chain of
//    ceil(r / L) FMAs over the zero-padded row) and then adds the L lanes in sequence: every
//    product meets at most n = ceil(r / L) + L roundings, so (Higham, Accuracy and Stability of
//    Numerical Algorithms, §3.1) |d_f - W2[v] . x_f| <= gamma(n) sum_k |W2[v,k] x_f,k|. The RNN
//    head's input x_f = fl32(x) adds one relative u per product, hence gamma(n + 1) against the
//    float64 input x. By Cauchy-Schwarz sum_k |W2[v,k] x_k| <= ||x||_2 ||W2[v]||_2 <= ||x||_2 Wmax,
//    Wmax the largest row norm of W2 (measured by the chunks in float32 and inflated by 2^-12,
//    far above the rounding of that measurement for r <= 1024). The float64 dot product has its
//    own error, below (r + 2) 2^-53 of the same sum. So
//        |d_f - d_e| <= Ddot = (gamma(n + 1) + (r + 2) 2^-53) ||x||_2 Wmax (1 + 2^-12).
// 2. Rounding to float32 is monotone: |fl32(a) - fl32(c)| <= |a - c| + ulp(max(|a|, |c|)), and
//    ulp(y) <= 2^-23 |y| for a normal y (2^-149 below), so with Zmax the largest finite |z_f| of
//    the row, |z_f - z_e| <= Dz = Ddot + 2^-22 (Zmax + Ddot) + 2^-126 (2^-22 leaves room for the
//    float64 addition's own rounding).
// 3. Keys. key = fl(fl(z inv_t) - log E): the same monotone argument gives for every candidate
//    |key_f - key_e| <= eps = Dz inv_t (1 + 2^-20) + 2^-22 (Zmax + Dz) inv_t + 2^-22 (2M + 1),
//    M = max(|K1|, |K2|), K1 > K2 the two best fast keys (a candidate with |key_f| > 2M + 1 is
//    below -M and stays below K2 after its own rounding). Greedy keys are z: eps = Dz.
// 4. If K1 - K2 > 2 eps, the fast winner's exact key exceeds every other exact key, so the exact
//    head draws the same token. Rows whose z_f or dot products are huge or not finite (where the
//    bounds above would not hold) are never certified.
// The same Dz bounds the filters' decisions (certified_filtered_token). DSPARK_OPS_DRAFT_BOUND_SCALE
// scales the bound for the tests, which show that scale 0 draws wrong tokens.

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

inline double bound_scale() {
  const char* env = std::getenv("DSPARK_OPS_DRAFT_BOUND_SCALE");
  return env ? std::atof(env) : 1.0;
}

inline double gamma_n(double n) { return n * kU / (1.0 - n * kU); }

// Ddot of step 1 for an input of float64 norm `x_norm`.
inline double dot_bound(int64_t rank, double x_norm, double w_max) {
  const double n = static_cast<double>((rank + VecF::size() - 1) / VecF::size() + VecF::size());
  return (gamma_n(n + 1) + (rank + 2) * 0x1p-53) * x_norm * w_max * (1.0 + 0x1p-12);
}

// Dz of step 2, or -1 when the row is outside the certificate's range.
inline double logit_bound(double dot_err, double z_max, double dot_max, double inv_t) {
  if (!(dot_max < 1e30) || !(dot_err < 1e30) || !(z_max * inv_t < 1e30)) return -1.0;
  return dot_err + 0x1p-22 * (z_max + dot_err) + 0x1p-126;
}

// Step 3 and 4: whether the fast winner is certainly the exact one.
inline bool certify_gap(const TopTwo& t, double dz, double z_max, bool greedy, double inv_t,
                        double scale) {
  if (dz < 0) return false;
  if (t.best.index < 0 || t.second == -INFINITY) return true;  // one candidate or none
  const double k1 = t.best.key, k2 = t.second;
  double eps = dz;
  if (!greedy) {
    const double m = std::max(std::fabs(k1), std::fabs(k2));
    eps = dz * inv_t * (1.0 + 0x1p-20) + 0x1p-22 * (z_max + dz) * inv_t + 0x1p-22 * (2.0 * m + 1.0);
  }
  return k1 - k2 > 2.0 * eps * scale;
}

// Interval [lo, hi] around the exact head's filter weight of a token whose fast logit is z (row
// max m, fast weight w): the exact exponent differs by at most 2 Dz inv_t plus the roundings of
// the subtraction and the product (2^-22 relative each, generous), expf by two ulps.
struct WeightInterval {
  double lo, hi;
};
inline WeightInterval weight_interval(float z, float m, float w, double dz, double inv_t) {
  const double a = std::fabs((static_cast<double>(z) - m) * inv_t);
  const double delta = (2.0 * dz + 0x1p-22 * std::fabs(static_cast<double>(z) - m)) * inv_t *
                           (1.0 + 0x1p-20) + 0x1p-22 * a + 0x1p-20;
  const double up = delta <= 0x1p-10 ? 1.0 + 1.01 * delta : std::exp(delta);
  return {std::max(0.0, w * (1.0 - delta) - 0x1p-126), w * up + 0x1p-126};
}

// The filtered token of request b from the fast row z (filtered in place as filtered_token does),
// or -1 when a filter decision or the final draw is within the bound `dz` (then z is left for the
// exact head to overwrite). The kept set of every filter is {z >= threshold}; it is the exact
// head's kept set when no token lies within 2 Dz of the boundary and the aggregate decisions have
// margins against the weight intervals:
//   top-k: exactly k tokens kept (no boundary tie) and a gap > 2 Dz to the next logit;
//   top-p on the top-k kept set S with kept part P: a gap > 2 Dz between P and S \ P, every token
//     of P has (weight of the rest of P) < top_p W(S), and W(P) >= top_p W(S), on the intervals;
//   min-p: every remaining token's weight interval lies on one side of min_p.
inline int64_t certified_filtered_token(float* z, int64_t vocab, const SlotSampling& s, int64_t b,
                                 double dot_err, double dot_max, double scale) {
  float row_max = -INFINITY, z_max = 0.f;
  for (int64_t x = 0; x < vocab; ++x) {
    if (!std::isfinite(z[x])) z[x] = -INFINITY;
    row_max = std::max(row_max, z[x]);
    if (z[x] != -INFINITY) z_max = std::max(z_max, std::fabs(z[x]));
  }
  const double inv_t = s.inv_temperature[b];
  const double dz = logit_bound(dot_err, z_max, dot_max, inv_t);
  // Before the empty-row shortcut: a row whose fast dot products all overflowed is empty here
  // but not in the exact head, and its bound (not finite) sends it there.
  if (dz < 0) return -1;
  if (row_max == -INFINITY) return 0;
  const double margin = 2.0 * dz * scale;
  const FilterSpec& spec = s.filter[b];
  std::vector<float> weights(vocab);
  std::vector<uint32_t> keys(vocab);
  for (int64_t x = 0; x < vocab; ++x) {
    keys[x] = z[x] == -INFINITY ? kNoCandidate : logit_key(z[x]);
    weights[x] = z[x] == -INFINITY ? 0.f : softmax_weight(z[x], row_max, s.inv_temperature[b]);
  }
  const auto interval = [&](int64_t x) {
    WeightInterval i = weight_interval(z[x], row_max, weights[x], dz * scale, inv_t);
    return i;
  };
  // Smallest kept and largest dropped finite logit for a threshold key.
  const auto boundary = [&](uint32_t lower, uint32_t t, int64_t& kept, float& low_kept,
                            float& high_dropped) {
    kept = 0;
    low_kept = INFINITY;
    high_dropped = -INFINITY;
    for (int64_t x = 0; x < vocab; ++x) {
      if (keys[x] == kNoCandidate || keys[x] < lower) continue;
      if (keys[x] >= t) {
        ++kept;
        low_kept = std::min(low_kept, z[x]);
      } else {
        high_dropped = std::max(high_dropped, z[x]);
      }
    }
  };
  uint32_t threshold = logit_key(-INFINITY);
  if (spec.top_k > 0) {
    const uint32_t t = select_threshold(keys.data(), weights.data(), vocab, threshold, false,
                                        spec.top_k, nullptr);
    int64_t kept;
    float low, high;
    boundary(threshold, t, kept, low, high);
    if (high != -INFINITY && (kept != spec.top_k || !(low - static_cast<double>(high) > margin))) {
      return -1;
    }
    threshold = t;
  }
  if (spec.top_p < 1.f) {
    double total = 0.0;
    const uint32_t t = select_threshold(keys.data(), weights.data(), vocab, threshold, true,
                                        spec.top_p, &total);
    int64_t kept;
    float low, high;
    boundary(threshold, t, kept, low, high);
    if (high != -INFINITY && !(low - static_cast<double>(high) > margin)) return -1;
    double s_lo = 0.0, s_hi = 0.0, p_lo = 0.0, p_hi = 0.0, p_min_hi = INFINITY;
    for (int64_t x = 0; x < vocab; ++x) {
      if (keys[x] == kNoCandidate || keys[x] < threshold) continue;
      const WeightInterval i = interval(x);
      s_lo += i.lo;
      s_hi += i.hi;
      if (keys[x] >= t) {
        p_lo += i.lo;
        p_hi += i.hi;
        p_min_hi = std::min(p_min_hi, i.hi);
      }
    }
    const double p = spec.top_p;
    if (!(p_hi - p_min_hi < p * s_lo * (1.0 - 1e-12))) return -1;  // every kept token stays kept
    if (high != -INFINITY && !(p_lo >= p * s_hi * (1.0 + 1e-12))) return -1;  // dropped stay dropped
    threshold = t;
  }
  if (spec.min_p > 0.f) {
    for (int64_t x = 0; x < vocab; ++x) {
      if (keys[x] == kNoCandidate || keys[x] < threshold) continue;
      const WeightInterval i = interval(x);
      if (!(i.lo >= spec.min_p || i.hi < spec.min_p)) return -1;
    }
  }
  const FilterResult f{key_logit(threshold), spec.min_p, 0.f};
  for (int64_t x = 0; x < vocab; ++x) {
    if (!filter_keeps(f, z[x], weights[x])) z[x] = -INFINITY;
  }
  const TopTwo t = best_key(z, 0, vocab, s, b);
  if (!certify_gap(t, dz, z_max, s.greedy[b], inv_t, scale)) return -1;
  return t.best.index < 0 ? 0 : t.best.index;
}

}  // namespace dspark_ops::draft_cpu
