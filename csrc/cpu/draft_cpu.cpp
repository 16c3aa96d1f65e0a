// CPU kernels of the drafting family (docs/semantics.md §3.2, §3.3): markov_draft, rnn_draft,
// draft_confidence.
//
// A block is walked slot by slot; each slot is one pass over the vocabulary, split into chunks
// that at::parallel_for spreads over the threads (one level of parallelism: the micro-kernels
// inside a task are single-threaded). Each slot first runs a fast float32 head: a chunk converts
// eight W2 rows at a time to float32 and takes their dot products with every request's bias
// input, so W2 is read once per slot for the whole batch; z = float32(dot + base) is stored as
// draft_logits and each request keeps its chunk's two best Gumbel-max keys
// z / T - log(-log1p(-u)) (vectorised float32 functions, as the reference's torch ops). Chunks
// merge in vocabulary order (ties to the lower id), so nothing depends on the thread count.
//
// Tokens must be those of the float64 head of dspark_ops/reference.py. The float32 head is off by
// at most a proven bound (certify_gap below); where the winner's key is not ahead of the runner-up
// by more than twice that bound, or a filter decision (top-k, top-p, min-p) lies within it, the
// request's whole row is redone in float64 exactly as the reference (the exact head), which then
// also stores that row's draft_logits bit for bit. Elsewhere draft_logits are the float32 head's,
// within that bound of the reference, and the token is still the Gumbel-max of the stored row.
// With bfloat16 draft_logits both heads sample z rounded to bfloat16; the few elements whose float32
// z lies within the bound of a rounding midpoint are recomputed in float64 (fix_rounding), so the
// stored rows are the exact head's on every row and the tokens need no margin.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "philox_lanes.h"
#include "to_float.h"
#include "../args/draft_args.h"
#include "../common/dispatch.h"
#include "../kernels/draft_math.h"
#include "../kernels/filter_math.h"
#include "../kernels/sampling_math.h"
#include "../ops.h"

namespace dspark_ops {
namespace {

using VecF = at::vec::Vectorized<float>;
using VecD = at::vec::Vectorized<double>;
// Vocabulary rows per parallel task: whole Philox blocks, whole float vectors.
constexpr int64_t kChunk = 2048;
constexpr int kRowsPerGroup = 8;  // W2 rows converted and dotted together

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
double load_double(const T* p, int64_t i) {
  return static_cast<double>(static_cast<float>(p[i]));
}

// out[i] = sum_k a[k] * rows[i][k] for kRows zero-padded float64 rows of `padded` elements: one
// accumulator chain per row, so the fused multiply-adds overlap instead of waiting on each other.
// Every row's sum is taken in the same order (lane-wise, then across lanes).
template <int kRows>
void dot_rows(const double* a, const double* rows, int64_t padded, double* out) {
  VecD acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = VecD(0.0);
  for (int64_t k = 0; k < padded; k += VecD::size()) {
    const VecD x = VecD::loadu(a + k);
    for (int i = 0; i < kRows; ++i) acc[i] = at::vec::fmadd(x, VecD::loadu(rows + i * padded + k), acc[i]);
  }
  for (int i = 0; i < kRows; ++i) {
    double lanes[VecD::size()];
    acc[i].store(lanes);
    double s = 0.0;
    for (int l = 0; l < VecD::size(); ++l) s += lanes[l];
    out[i] = s;
  }
}

// a[0, VecD::size()) widened from float32 to float64 (exact).
VecD widen(const float* a) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  if constexpr (VecD::size() == 4) return VecD(_mm256_cvtps_pd(_mm_loadu_ps(a)));
#endif
  double lanes[VecD::size()];
  for (int i = 0; i < VecD::size(); ++i) lanes[i] = a[i];
  return VecD::loadu(lanes);
}

VecD load_row(const double* a) { return VecD::loadu(a); }
VecD load_row(const float* a) { return widen(a); }

// The four chains of a dot product added in a fixed order, then their lanes.
double sum_chains(const VecD* acc) {
  double lanes[VecD::size()];
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
  double s = 0.0;
  for (int i = 0; i < VecD::size(); ++i) s += lanes[i];
  return s;
}

// sum_k a[k] * b[k] for one long pair of rows (the RNN joint layer, the confidence head): four
// accumulator chains over interleaved vectors, then added in a fixed order. A float32 row is
// widened as it is loaded: the same sum, term for term, as of the row converted first.
template <typename A>
double dot(const A* a, const double* b, int64_t padded) {
  constexpr int64_t kChains = 4;
  VecD acc[kChains] = {VecD(0.0), VecD(0.0), VecD(0.0), VecD(0.0)};
  int64_t k = 0;
  for (; k + kChains * VecD::size() <= padded; k += kChains * VecD::size()) {
    for (int64_t c = 0; c < kChains; ++c) {
      const int64_t at = k + c * VecD::size();
      acc[c] = at::vec::fmadd(load_row(a + at), VecD::loadu(b + at), acc[c]);
    }
  }
  for (; k < padded; k += VecD::size()) {
    acc[0] = at::vec::fmadd(load_row(a + k), VecD::loadu(b + k), acc[0]);
  }
  return sum_chains(acc);
}

// dot() of two float32 rows against the same b at once: each row keeps its own four chains (the
// same sums in the same order), and the eight independent chains share the loads of b.
void dot_widened2(const float* a0, const float* a1, const double* b, int64_t padded, double* out) {
  constexpr int64_t kChains = 4;
  VecD acc0[kChains] = {VecD(0.0), VecD(0.0), VecD(0.0), VecD(0.0)};
  VecD acc1[kChains] = {VecD(0.0), VecD(0.0), VecD(0.0), VecD(0.0)};
  int64_t k = 0;
  for (; k + kChains * VecD::size() <= padded; k += kChains * VecD::size()) {
    for (int64_t c = 0; c < kChains; ++c) {
      const int64_t at = k + c * VecD::size();
      const VecD y = VecD::loadu(b + at);
      acc0[c] = at::vec::fmadd(widen(a0 + at), y, acc0[c]);
      acc1[c] = at::vec::fmadd(widen(a1 + at), y, acc1[c]);
    }
  }
  for (; k < padded; k += VecD::size()) {
    const VecD y = VecD::loadu(b + k);
    acc0[0] = at::vec::fmadd(widen(a0 + k), y, acc0[0]);
    acc1[0] = at::vec::fmadd(widen(a1 + k), y, acc1[0]);
  }
  out[0] = sum_chains(acc0);
  out[1] = sum_chains(acc1);
}

// Per-request sampling constants of one slot.
struct SlotSampling {
  std::vector<float> inv_temperature;  // 1/T, or 1 for greedy requests
  std::vector<char> greedy;
  std::vector<int64_t> seed, position;  // position of this slot's draw: p0 + 1 + j
  std::vector<FilterSpec> filter;
  bool round_bf16 = false;  // bfloat16 draft_logits: keys are those of z rounded to bfloat16
};

// z rounded to bfloat16 (nearest even, torch's conversion), as a float.
float round_bf16(float z) { return static_cast<float>(c10::BFloat16(z)); }

// The two best Gumbel-max keys of a request over a range: the winner and the largest key of any
// other candidate (-inf when there is none).
struct TopTwo {
  RaceCandidate best = empty_candidate();
  float second = -INFINITY;
};

void offer(TopTwo& t, RaceCandidate c) {
  const RaceCandidate w = better_candidate(t.best, c);
  if (w.index == c.index) {
    if (t.best.index >= 0) t.second = std::max(t.second, t.best.key);
    t.best = c;
  } else {
    t.second = std::max(t.second, c.key);
  }
}

// Union of two disjoint ranges' TopTwo.
TopTwo merge(TopTwo a, const TopTwo& b) {
  if (b.best.index >= 0) offer(a, b.best);
  a.second = std::max(a.second, b.second);
  return a;
}

// Request b's two best Gumbel-max candidates over z[x0, x1) (x0 a multiple of 32), 32 keys at a
// time (whole Philox blocks; the tail past x1 is masked).
TopTwo best_key(const float* z, int64_t x0, int64_t x1, const SlotSampling& s, int64_t b) {
  TopTwo best;
  alignas(64) float u[32], key[32], zs[32];
  for (int64_t x = x0; x < x1; x += 32) {
    const int64_t n = std::min<int64_t>(32, x1 - x);
    for (int64_t i = 0; i < 32; ++i) zs[i] = i < n ? z[x + i] : -INFINITY;
    if (s.round_bf16) {
      for (int64_t i = 0; i < n; ++i) zs[i] = round_bf16(zs[i]);
    }
    if (s.greedy[b]) {
      for (int64_t i = 0; i < 32; ++i) key[i] = zs[i];
    } else {
      philox_uniforms32(s.seed[b], s.position[b], kPurposeDraft, static_cast<uint32_t>(x >> 2), u);
      const VecF inv_t(s.inv_temperature[b]);
      for (int64_t i = 0; i < 32; i += VecF::size()) {
        const VecF log_e = (-(-VecF::loadu(u + i)).log1p()).log();
        (VecF::loadu(zs + i) * inv_t - log_e).store(key + i);
      }
    }
    // Non-finite z, and keys that are -inf (z / T overflowing) or NaN, never win: masked to -inf.
    // A block whose best key is not above the current runner-up changes nothing and is skipped.
    VecF block_max(-INFINITY);
    for (int64_t i = 0; i < 32; i += VecF::size()) {
      const VecF k = VecF::loadu(key + i);
      const VecF ok = (VecF::loadu(zs + i).abs() < VecF(INFINITY)) & (k > VecF(-INFINITY));
      const VecF masked = VecF::blendv(VecF(-INFINITY), k, ok);
      masked.store(key + i);
      block_max = at::vec::maximum(block_max, masked);
    }
    const float top = at::vec::vec_reduce_all<float>(
        [](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, block_max);
    if (!(top > best.second)) continue;
    for (int64_t i = 0; i < n; ++i) {
      if (key[i] > -INFINITY) offer(best, RaceCandidate{key[i], static_cast<int32_t>(x + i)});
    }
  }
  return best;
}

// Filters request b's row z[0, vocab) in place (non-finite and dropped tokens -inf, as the filtered
// draft_logits are stored) and returns its token.
int64_t filtered_token(float* z, int64_t vocab, const SlotSampling& s, int64_t b) {
  float row_max = -INFINITY;
  for (int64_t x = 0; x < vocab; ++x) {
    if (!std::isfinite(z[x])) z[x] = -INFINITY;
    row_max = std::max(row_max, z[x]);
  }
  if (row_max == -INFINITY) return 0;
  std::vector<float> weights(vocab);
  std::vector<uint32_t> keys(vocab);
  filter_row(z, vocab, row_max, s.inv_temperature[b], s.filter[b], keys.data(), weights.data());
  const RaceCandidate best = best_key(z, 0, vocab, s, b).best;
  return best.index < 0 ? 0 : best.index;
}

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

double bound_scale() {
  const char* env = std::getenv("DSPARK_OPS_DRAFT_BOUND_SCALE");
  return env ? std::atof(env) : 1.0;
}

double gamma_n(double n) { return n * kU / (1.0 - n * kU); }

// Ddot of step 1 for an input of float64 norm `x_norm`.
double dot_bound(int64_t rank, double x_norm, double w_max) {
  const double n = static_cast<double>((rank + VecF::size() - 1) / VecF::size() + VecF::size());
  return (gamma_n(n + 1) + (rank + 2) * 0x1p-53) * x_norm * w_max * (1.0 + 0x1p-12);
}

// Dz of step 2, or -1 when the row is outside the certificate's range.
double logit_bound(double dot_err, double z_max, double dot_max, double inv_t) {
  if (!(dot_max < 1e30) || !(dot_err < 1e30) || !(z_max * inv_t < 1e30)) return -1.0;
  return dot_err + 0x1p-22 * (z_max + dot_err) + 0x1p-126;
}

// Step 3 and 4: whether the fast winner is certainly the exact one.
bool certify_gap(const TopTwo& t, double dz, double z_max, bool greedy, double inv_t, double scale) {
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
WeightInterval weight_interval(float z, float m, float w, double dz, double inv_t) {
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
int64_t certified_filtered_token(float* z, int64_t vocab, const SlotSampling& s, int64_t b,
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

// ---- bfloat16 draft_logits ---------------------------------------------------------------
//
// Both heads then store and sample r = bf16(z) (round to nearest even, which is monotone): the
// exact head r_e = bf16(z_e), the fast head r_f = bf16(z_f), with |z_f - z_e| <= Dz (step 2).
// Let lo <= hi be float32 values with lo <= z_f - Dz and hi >= z_f + Dz (rounded outwards): z_e
// lies in [lo, hi], so if bf16(lo) == bf16(hi) then r_e = r_f exactly (the element is certain).
// The others (z_f within Dz of a rounding midpoint, a small fraction of a row) are uncertain:
// fix_rounding recomputes their z_e in float64 exactly as the exact head does (same products,
// same order: dot_rows), so afterwards every element of the row holds z_e or a z_f that rounds
// as z_e does, and the stored row is the exact head's, bit for bit, on every row.
// Tokens: keys come from r, u and 1/T by the same code in both heads (best_key), so the fast
// winner w over the r_f row stays the winner unless an element's r changed; then w is compared
// with the changed elements' new keys (their 32-key blocks, ties to the lower id), or, if w's own
// r changed, the row's keys are taken again. Filtered rows are filtered from the fixed row with
// the exact head's code. No margin on the keys is needed.

// Whether every z_e with |z - z_e| <= dz rounds to bf16(z).
bool rounding_certain(float z, double dz) {
  if (!std::isfinite(z) || dz == 0.0) return true;  // non-finite z_f are the exact head's too
  const double lo_d = static_cast<double>(z) - dz, hi_d = static_cast<double>(z) + dz;
  float lo = static_cast<float>(lo_d), hi = static_cast<float>(hi_d);
  if (lo > lo_d) lo = std::nextafter(lo, -INFINITY);
  if (hi < hi_d) hi = std::nextafter(hi, INFINITY);
  return round_bf16(lo) == round_bf16(hi);
}

// A cheap sufficient test of rounding_certain: z = R + m ulp32(z) with R a bfloat16 value and m
// its low 16 bits, so the nearest rounding midpoint is at least min(|m - 2^15|, m + 2^14) float32
// ulps away (2^14: the midpoint below a power of two, in the finer binade under it).
bool far_from_midpoint(float z, double dz) {
  uint32_t bits;
  std::memcpy(&bits, &z, sizeof(bits));
  const uint32_t e = (bits >> 23) & 0xFFu;
  if (e == 0xFFu) return true;
  const int m = static_cast<int>(bits & 0xFFFFu);
  const int steps = std::min(std::abs(m - 0x8000), m + 0x4000);
  const uint64_t ulp_bits = static_cast<uint64_t>((e == 0 ? 1 : static_cast<int>(e)) - 150 + 1023)
                            << 52;
  double ulp;
  std::memcpy(&ulp, &ulp_bits, sizeof(ulp));
  return steps * ulp > dz;
}

// Replaces the uncertain elements of request b's fast row z by their exact z_e and returns the
// ids whose bfloat16 value changed (ascending). The rows are converted and dotted kRowsPerGroup at
// a time as in exact_slot (the same per-row sums). `rows` and `staged` are scratch of
// kRowsPerGroup * padded_rank doubles (zero past the rank) and rank floats.
template <typename W, typename BaseT>
std::vector<int64_t> fix_rounding(float* z, int64_t vocab, double dz, const W* w2,
                                  int64_t w2_stride, int64_t rank, int64_t padded_rank,
                                  const double* input, const BaseT* base_row,
                                  std::vector<double>& rows, std::vector<float>& staged) {
  std::vector<int64_t> uncertain, changed;
  for (int64_t v = 0; v < vocab; ++v) {
    if (!far_from_midpoint(z[v], dz) && !rounding_certain(z[v], dz)) uncertain.push_back(v);
  }
  const int64_t count = static_cast<int64_t>(uncertain.size());
  for (int64_t i0 = 0; i0 < count; i0 += kRowsPerGroup) {
    const int64_t n = std::min<int64_t>(kRowsPerGroup, count - i0);
    for (int64_t i = 0; i < n; ++i) {
      to_float(w2 + uncertain[i0 + i] * w2_stride, rank, staged.data());  // exact
      for (int64_t k = 0; k < rank; ++k) rows[i * padded_rank + k] = staged[k];
    }
    double bias[kRowsPerGroup];
    dot_rows<kRowsPerGroup>(input, rows.data(), padded_rank, bias);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = uncertain[i0 + i];
      const float exact = static_cast<float>(bias[i] + load_double(base_row, v));
      if (round_bf16(exact) != round_bf16(z[v])) changed.push_back(v);
      z[v] = exact;
    }
  }
  return changed;
}

// Request b's token from its fixed row z (unfiltered): `fast` is the fast head's winner over the
// row before fix_rounding changed the bfloat16 values of `changed`.
int64_t rounded_token(const float* z, int64_t vocab, const SlotSampling& s, int64_t b,
                      RaceCandidate fast, const std::vector<int64_t>& changed) {
  if (std::binary_search(changed.begin(), changed.end(), static_cast<int64_t>(fast.index))) {
    fast = best_key(z, 0, vocab, s, b).best;
  } else {
    int64_t done = -1;
    for (const int64_t v : changed) {
      const int64_t x0 = v / 32 * 32;
      if (x0 == done) continue;
      done = x0;
      fast = better_candidate(fast, best_key(z, x0, std::min(x0 + 32, vocab), s, b).best);
    }
  }
  return fast.index < 0 ? 0 : fast.index;
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
// out[i] = the sum of acc[i]'s eight lanes, all eight at once: a tree of depth 3 (within the
// certificate's n), the same for every dot of the fast head.
void lane_sums8(const __m256 (&acc)[8], float* out) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                      _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#endif

// out[i] = sum_k a[k] * rows[i][k] in float32 for kRows zero-padded rows (one accumulator per
// lane and row, then the lanes added in order: the n = padded / L + L of the certificate), and
// the largest |out[i]| (infinity for a NaN) into dot_max.
template <int kRows>
void fast_dot(const float* a, const float* rows, int64_t padded, float* out) {
  VecF acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = VecF(0.f);
  for (int64_t k = 0; k < padded; k += VecF::size()) {
    const VecF x = VecF::loadu(a + k);
    for (int i = 0; i < kRows; ++i) acc[i] = at::vec::fmadd(x, VecF::loadu(rows + i * padded + k), acc[i]);
  }
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  if constexpr (kRows == 8 && VecF::size() == 8) {
    const __m256 lanes[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
    lane_sums8(lanes, out);
    return;
  }
#endif
  for (int i = 0; i < kRows; ++i) {
    float lanes[VecF::size()];
    acc[i].store(lanes);
    float s = lanes[0];
    for (int l = 1; l < VecF::size(); ++l) s += lanes[l];
    out[i] = s;
  }
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
// The eight rows of fast_dot<8> for two requests a0, a1 at once: four rows at a time against both
// (eight accumulators, six loads per eight multiply-adds instead of nine), each dot's chain and
// its lane tree exactly fast_dot<8>'s.
void fast_dot_pair(const float* a0, const float* a1, const float* rows, int64_t padded,
                   float* out0, float* out1) {
  for (int half = 0; half < 2; ++half) {
    const float* r = rows + 4 * half * padded;
    __m256 acc[8];
    for (auto& x : acc) x = _mm256_setzero_ps();
    for (int64_t k = 0; k < padded; k += 8) {
      const __m256 x0 = _mm256_loadu_ps(a0 + k), x1 = _mm256_loadu_ps(a1 + k);
      for (int i = 0; i < 4; ++i) {
        const __m256 w = _mm256_loadu_ps(r + i * padded + k);
        acc[i] = _mm256_fmadd_ps(x0, w, acc[i]);
        acc[4 + i] = _mm256_fmadd_ps(x1, w, acc[4 + i]);
      }
    }
    float lanes[8];
    lane_sums8(acc, lanes);
    for (int i = 0; i < 4; ++i) {
      out0[4 * half + i] = lanes[i];
      out1[4 * half + i] = lanes[4 + i];
    }
  }
}
#endif

// sum_k x[k]^2 over a zero-padded row, in float32.
float squared_norm(const float* x, int64_t padded) {
  VecF acc0(0.f), acc1(0.f);
  int64_t k = 0;
  for (; k + 2 * VecF::size() <= padded; k += 2 * VecF::size()) {
    const VecF a = VecF::loadu(x + k), b = VecF::loadu(x + k + VecF::size());
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  for (; k < padded; k += VecF::size()) {
    const VecF a = VecF::loadu(x + k);
    acc0 = at::vec::fmadd(a, a, acc0);
  }
  return at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return a + b; }, acc0 + acc1);
}

// What a chunk of the fast head learns about request b.
struct ChunkStats {
  TopTwo top;
  float z_max = 0.f;    // largest finite |z_f|
  float dot_max = 0.f;  // largest |d_f|, infinity for a non-finite one
};

// z[i] = float32(dots[i] + base[i]) (the addition in float64) for n <= 8 rows, and their stats.
template <typename BaseT>
void store_logits(const float* dots, const BaseT* base, int64_t n, float* z, ChunkStats& st) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  if (n == 8) {
    float base_f[8];
    to_float(base, 8, base_f);  // exact: every BaseT is a subset of float32
    const __m256 d = _mm256_loadu_ps(dots), b = _mm256_loadu_ps(base_f);
    const __m128 lo = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(d)),
                                                    _mm256_cvtps_pd(_mm256_castps256_ps128(b))));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(d, 1)),
                                                    _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1))));
    const __m256 zv = _mm256_set_m128(hi, lo);
    _mm256_storeu_ps(z, zv);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 abs_d = _mm256_andnot_ps(sign, d), abs_z = _mm256_andnot_ps(sign, zv);
    const __m256 finite = _mm256_cmp_ps(abs_z, _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
    float ad[8], az[8];
    _mm256_storeu_ps(ad, abs_d);
    _mm256_storeu_ps(az, _mm256_and_ps(abs_z, finite));  // 0 for the non-finite
    const bool nan = _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0;
    float dot_max = st.dot_max, z_max = st.z_max;
    for (int i = 0; i < 8; ++i) {
      dot_max = std::max(dot_max, ad[i]);
      z_max = std::max(z_max, az[i]);
    }
    st.dot_max = nan ? INFINITY : dot_max;
    st.z_max = z_max;
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float zi = static_cast<float>(static_cast<double>(dots[i]) + load_double(base, i));
    z[i] = zi;
    const float ad = std::fabs(dots[i]);
    if (!(ad <= st.dot_max)) st.dot_max = std::isnan(ad) ? INFINITY : ad;
    if (std::isfinite(zi)) st.z_max = std::max(st.z_max, std::fabs(zi));
  }
}

// The fast float32 head of one slot: z_f rows into z_out, each unfiltered request's chunk keys
// into stats[c * batch + b] and, when `measure`, each chunk's largest W2 row norm into w_max[c].
template <typename W, typename BaseT>
void fast_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank, const float* input,
               int64_t padded, int64_t batch, const BaseT* base, int64_t base_stride,
               float* z_out, int64_t z_stride, const SlotSampling& s,
               std::vector<ChunkStats>& stats, bool measure, std::vector<float>& w_max) {
  constexpr int kRows = 8;
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kRows * padded, 0.f);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t x0 = c * kChunk, x1 = std::min(x0 + kChunk, vocab);
      float norm2 = 0.f;
      for (int64_t v = x0; v < x1; v += kRows) {
        const int64_t n = std::min<int64_t>(kRows, x1 - v);
        for (int64_t i = 0; i < kRows; ++i) {
          float* dst = rows.data() + i * padded;
          if (i >= n) {
            std::fill(dst, dst + rank, 0.f);
            continue;
          }
          to_float(w2 + (v + i) * w2_stride, rank, dst);
          if (v + kRows + i < x1) {
            // The next group's row i: past this 4 KB page, where the hardware prefetchers stop.
            const char* next = reinterpret_cast<const char*>(w2 + (v + kRows + i) * w2_stride);
            for (int64_t byte = 0; byte < rank * int64_t{sizeof(W)}; byte += 64) {
              __builtin_prefetch(next + byte);
            }
          }
          if (measure) {
            const float sq = squared_norm(dst, padded);
            if (!(sq <= norm2)) norm2 = std::isnan(sq) ? INFINITY : sq;
          }
        }
        int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
        if constexpr (kRows == 8 && VecF::size() == 8) {
          for (; b + 2 <= batch; b += 2) {
            float dots[2][kRows];
            fast_dot_pair(input + b * padded, input + (b + 1) * padded, rows.data(), padded,
                          dots[0], dots[1]);
            for (int64_t j = 0; j < 2; ++j) {
              store_logits(dots[j], base + (b + j) * base_stride + v, n,
                           z_out + (b + j) * z_stride + v, stats[c * batch + b + j]);
            }
          }
        }
#endif
        for (; b < batch; ++b) {
          float dots[kRows];
          fast_dot<kRows>(input + b * padded, rows.data(), padded, dots);
          store_logits(dots, base + b * base_stride + v, n, z_out + b * z_stride + v,
                       stats[c * batch + b]);
        }
      }
      if (measure) w_max[c] = std::sqrt(norm2);
      for (int64_t b = 0; b < batch; ++b) {
        if (!s.filter[b].active()) stats[c * batch + b].top = best_key(z_out + b * z_stride, x0, x1, s, b);
      }
    }
  });
}

// The exact float64 head for the requests in `redo`: z = float32(W2 . input[b] + base[b]) into
// their rows of z_out (the reference's arithmetic, bit for bit) and their tokens.
template <typename W, typename BaseT>
void exact_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank,
                const std::vector<double>& input, const std::vector<int64_t>& redo,
                const BaseT* base, int64_t base_stride, float* z_out, int64_t z_stride,
                const SlotSampling& s, int64_t* token, int64_t token_stride) {
  const int64_t padded_rank = round_up(rank, VecD::size());
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> rows(kRowsPerGroup * padded_rank, 0.0);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t x0 = c * kChunk, x1 = std::min(x0 + kChunk, vocab);
      for (int64_t v = x0; v < x1; v += kRowsPerGroup) {
        const int64_t n = std::min<int64_t>(kRowsPerGroup, x1 - v);
        for (int64_t i = 0; i < n; ++i) {
          const W* src = w2 + (v + i) * w2_stride;
          for (int64_t k = 0; k < rank; ++k) rows[i * padded_rank + k] = load_double(src, k);
        }
        for (const int64_t b : redo) {
          double bias[kRowsPerGroup];
          dot_rows<kRowsPerGroup>(input.data() + b * padded_rank, rows.data(), padded_rank, bias);
          const BaseT* base_row = base + b * base_stride;
          for (int64_t i = 0; i < n; ++i) {
            z_out[b * z_stride + v + i] = static_cast<float>(bias[i] + load_double(base_row, v + i));
          }
        }
      }
    }
  });
  at::parallel_for(0, static_cast<int64_t>(redo.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = redo[i];
      float* zb = z_out + b * z_stride;
      if (s.filter[b].active()) {
        if (s.round_bf16) {
          for (int64_t x = 0; x < vocab; ++x) zb[x] = round_bf16(zb[x]);
        }
        token[b * token_stride] = filtered_token(zb, vocab, s, b);
      } else {
        const RaceCandidate m = best_key(zb, 0, vocab, s, b).best;
        token[b * token_stride] = m.index < 0 ? 0 : m.index;
      }
    }
  });
}

// One slot over the whole vocabulary: the fast head for every request, the exact head for the
// requests it cannot certify. z rows at z_out + b * z_stride, tokens at token[b * token_stride].
template <typename W, typename BaseT>
void draft_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank,
                const std::vector<double>& input, int64_t batch, const BaseT* base,
                int64_t base_stride, float* z_out, int64_t z_stride, const SlotSampling& s,
                int64_t* token, int64_t token_stride, double& w_max) {
  const int64_t padded_rank = round_up(rank, VecD::size());
  const int64_t padded = round_up(rank, VecF::size());
  std::vector<float> input_f(batch * padded, 0.f);
  std::vector<double> x_norm(batch);
  for (int64_t b = 0; b < batch; ++b) {
    double sq = 0.0;
    for (int64_t k = 0; k < rank; ++k) {
      const double x = input[b * padded_rank + k];
      input_f[b * padded + k] = static_cast<float>(x);
      sq += x * x;
    }
    x_norm[b] = std::sqrt(sq) * (1.0 + 0x1p-40);
  }
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<ChunkStats> stats(chunks * batch);
  const bool measure = w_max < 0;  // W2's row norms are measured once per call, in slot 0
  std::vector<float> w_chunk(chunks, 0.f);
  fast_slot<W, BaseT>(w2, w2_stride, vocab, rank, input_f.data(), padded, batch, base, base_stride,
                      z_out, z_stride, s, stats, measure, w_chunk);
  if (measure) {
    w_max = 0.0;
    for (const float w : w_chunk) w_max = std::max(w_max, static_cast<double>(w));
  }
  const double scale = bound_scale();
  std::vector<ChunkStats> row(batch);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t c = 0; c < chunks; ++c) {
      const ChunkStats& st = stats[c * batch + b];
      row[b].top = merge(row[b].top, st.top);
      row[b].z_max = std::max(row[b].z_max, st.z_max);
      row[b].dot_max = std::max(row[b].dot_max, st.dot_max);
    }
  }
  std::vector<char> redo_flag(batch, 0);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> fix_rows(s.round_bf16 ? kRowsPerGroup * padded_rank : 0, 0.0);
    std::vector<float> fix_staged(s.round_bf16 ? rank : 0);
    for (int64_t b = begin; b < end; ++b) {
      const double dot_err = dot_bound(rank, x_norm[b], w_max);
      const double inv_t = s.inv_temperature[b];
      float* zb = z_out + b * z_stride;
      if (s.round_bf16) {
        const double dz = logit_bound(dot_err, row[b].z_max, row[b].dot_max, inv_t);
        if (dz < 0) {
          redo_flag[b] = 1;
          continue;
        }
        const std::vector<int64_t> changed =
            fix_rounding<W, BaseT>(zb, vocab, dz * scale, w2, w2_stride, rank, padded_rank,
                                   input.data() + b * padded_rank, base + b * base_stride,
                                   fix_rows, fix_staged);
        if (s.filter[b].active()) {
          for (int64_t x = 0; x < vocab; ++x) zb[x] = round_bf16(zb[x]);
          token[b * token_stride] = filtered_token(zb, vocab, s, b);
        } else {
          token[b * token_stride] = rounded_token(zb, vocab, s, b, row[b].top.best, changed);
        }
        continue;
      }
      if (s.filter[b].active()) {
        const int64_t t = certified_filtered_token(zb, vocab, s, b, dot_err, row[b].dot_max,
                                                   scale);
        if (t < 0) redo_flag[b] = 1;
        else token[b * token_stride] = t;
        continue;
      }
      const double dz = logit_bound(dot_err, row[b].z_max, row[b].dot_max, inv_t);
      if (!certify_gap(row[b].top, dz, row[b].z_max, s.greedy[b], inv_t, scale)) {
        redo_flag[b] = 1;
        continue;
      }
      token[b * token_stride] = row[b].top.best.index < 0 ? 0 : row[b].top.best.index;
    }
  });
  std::vector<int64_t> redo;
  for (int64_t b = 0; b < batch; ++b) {
    if (redo_flag[b]) redo.push_back(b);
  }
  if (!redo.empty()) {
    exact_slot<W, BaseT>(w2, w2_stride, vocab, rank, input, redo, base, base_stride, z_out,
                         z_stride, s, token, token_stride);
  }
}

SlotSampling slot_sampling(const DraftArgs& a, int64_t j) {
  SlotSampling s;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float t = a.temperature.const_data_ptr<float>()[b];
    s.greedy.push_back(is_greedy(t));
    s.inv_temperature.push_back(is_greedy(t) ? 1.f : 1.f / t);
    s.seed.push_back(a.seed.const_data_ptr<int64_t>()[b]);
    s.position.push_back(offset_position(a.position.const_data_ptr<int64_t>()[b], 1 + j));
    const auto& f = a.filters;
    s.filter.push_back(
        make_filter_spec(f.top_k_data(), f.top_p_data(), f.min_p_data(), b, a.vocab));
  }
  s.round_bf16 = a.logits_bf16;
  return s;
}

int64_t read_id(const at::Tensor& ids, int64_t offset) {
  return ids.scalar_type() == at::kInt ? ids.const_data_ptr<int32_t>()[offset]
                                       : ids.const_data_ptr<int64_t>()[offset];
}

// W1[id] as float64 into dst[0, rank); a zero row for ids outside [0, V).
template <typename W>
void embed(const at::Tensor& w1, int64_t id, double* dst) {
  const int64_t rank = w1.size(1);
  if (id < 0 || id >= w1.size(0)) {
    std::fill(dst, dst + rank, 0.0);
    return;
  }
  const W* row = w1.const_data_ptr<W>() + id * w1.stride(0);
  for (int64_t k = 0; k < rank; ++k) dst[k] = load_double(row, k);
}

// The sequential walk of both heads. `next_input(j, prev, input)` fills the [B, padded r] float64
// bias inputs of slot j from the previous tokens.
template <typename W, typename BaseT, typename NextInput>
void draft_block(const DraftArgs& a, at::Tensor& tokens, at::Tensor& draft_logits,
                 NextInput&& next_input) {
  const int64_t padded_rank = round_up(a.rank, VecD::size());
  std::vector<double> input(a.batch * padded_rank, 0.0);
  std::vector<int64_t> prev(a.batch);
  for (int64_t b = 0; b < a.batch; ++b) prev[b] = read_id(a.anchor, b);
  auto* out_tokens = tokens.data_ptr<int64_t>();
  // bfloat16 logits: each slot's float32 rows (z_f, or z_e where recomputed, rounded in place
  // where filtered) are staged, then rounded into draft_logits.
  std::vector<float> staged(a.logits_bf16 ? a.batch * a.vocab : 0);
  const auto* base = a.base.const_data_ptr<BaseT>();
  double w_max = -1.0;  // the largest W2 row norm, once measured
  for (int64_t j = 0; j < a.block; ++j) {
    next_input(j, prev, input, padded_rank);
    float* z = a.logits_bf16 ? staged.data() : draft_logits.data_ptr<float>() + j * a.vocab;
    const int64_t z_stride = a.logits_bf16 ? a.vocab : a.block * a.vocab;
    draft_slot<W, BaseT>(a.w2.const_data_ptr<W>(), a.w2.stride(0), a.vocab, a.rank, input,
                         a.batch, base + j * a.base.stride(1), a.base.stride(0), z, z_stride,
                         slot_sampling(a, j), out_tokens + j, a.block, w_max);
    if (a.logits_bf16) {
      auto* out = draft_logits.data_ptr<at::BFloat16>() + j * a.vocab;
      at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const float* src = z + b * a.vocab;
          at::BFloat16* dst = out + b * a.block * a.vocab;
          for (int64_t x = 0; x < a.vocab; ++x) dst[x] = c10::BFloat16(src[x]);
        }
      });
    }
    for (int64_t b = 0; b < a.batch; ++b) prev[b] = out_tokens[b * a.block + j];
  }
}

template <typename F>
void dispatch_draft_types(const DraftArgs& a, F&& f) {
  dispatch_logit_type(a.w1.scalar_type(), [&](auto w_tag) {
    dispatch_logit_type(a.base.scalar_type(), [&](auto base_tag) {
      f(decltype(w_tag){}, decltype(base_tag){});
    });
  });
}

}  // namespace

DraftResult markov_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                             const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& temperature, const at::Tensor& seed,
                             const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p,
                             std::optional<at::ScalarType> draft_logits_dtype) {
  const auto a = check_markov_draft_args(base_logits, anchor, w1, w2, temperature, seed, position,
                                         top_k, top_p, min_p, draft_logits_dtype);
  auto [tokens, draft_logits] = allocate_draft_outputs(a);
  dispatch_draft_types(a, [&](auto w_tag, auto base_tag) {
    using W = decltype(w_tag);
    draft_block<W, decltype(base_tag)>(
        a, tokens, draft_logits,
        [&](int64_t, const std::vector<int64_t>& prev, std::vector<double>& input, int64_t padded) {
          for (int64_t b = 0; b < a.batch; ++b) embed<W>(a.w1, prev[b], input.data() + b * padded);
        });
  });
  return {tokens, draft_logits};
}

DraftResult rnn_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                          const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& joint_weight, const at::Tensor& joint_bias,
                          const at::Tensor& temperature, const at::Tensor& seed,
                          const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                          const std::optional<at::Tensor>& top_p,
                          const std::optional<at::Tensor>& min_p,
                          std::optional<at::ScalarType> draft_logits_dtype) {
  const auto a = check_rnn_draft_args(base_logits, anchor, hidden, w1, w2, joint_weight,
                                      joint_bias, temperature, seed, position, top_k, top_p, min_p,
                                      draft_logits_dtype);
  auto [tokens, draft_logits] = allocate_draft_outputs(a);
  const int64_t rank = a.rank, width = 2 * a.rank + a.hidden_size;
  const int64_t padded_width = round_up(width, VecD::size());
  dispatch_draft_types(a, [&](auto w_tag, auto base_tag) {
    using W = decltype(w_tag);
    std::vector<double> state(a.batch * rank, 0.0);
    std::vector<double> u(a.batch * padded_width, 0.0), pre(a.batch * 3 * rank);
    draft_block<W, decltype(base_tag)>(
        a, tokens, draft_logits,
        [&](int64_t j, const std::vector<int64_t>& prev, std::vector<double>& input, int64_t padded) {
          // u = [s_j; W1[x_j]; h_j] per request.
          dispatch_logit_type(a.hidden.scalar_type(), [&](auto h_tag) {
            using H = decltype(h_tag);
            for (int64_t b = 0; b < a.batch; ++b) {
              double* ub = u.data() + b * padded_width;
              std::copy(state.begin() + b * rank, state.begin() + (b + 1) * rank, ub);
              embed<W>(a.w1, prev[b], ub + rank);
              const H* h = a.hidden.const_data_ptr<H>() + b * a.hidden.stride(0) + j * a.hidden.stride(1);
              for (int64_t k = 0; k < a.hidden_size; ++k) ub[2 * rank + k] = load_double(h, k);
            }
          });
          // [g; c; o] = J u + bias: each row of J converted once, dotted with every request.
          at::parallel_for(0, 3 * rank, 16, [&](int64_t begin, int64_t end) {
            std::vector<double> row(padded_width, 0.0);
            std::vector<float> staged(width);
            for (int64_t i = begin; i < end; ++i) {
              const W* src = a.joint_weight.const_data_ptr<W>() + i * a.joint_weight.stride(0);
              to_float(src, width, staged.data());  // exact, with vector loads
              for (int64_t k = 0; k < width; ++k) row[k] = staged[k];
              const double bias = load_double(a.joint_bias.const_data_ptr<W>(), i);
              for (int64_t b = 0; b < a.batch; ++b) {
                pre[b * 3 * rank + i] = dot(u.data() + b * padded_width, row.data(), padded_width) + bias;
              }
            }
          });
          for (int64_t b = 0; b < a.batch; ++b) {
            const double* p = pre.data() + b * 3 * rank;
            for (int64_t k = 0; k < rank; ++k) {
              input[b * padded + k] = std::tanh(p[2 * rank + k]);
              const double gate = rnn_sigmoid(p[k]);
              double& s = state[b * rank + k];
              s = gate * s + (1.0 - gate) * std::tanh(p[rank + k]);
            }
          }
        });
  });
  return {tokens, draft_logits};
}

at::Tensor draft_confidence_cpu(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                const at::Tensor& w1, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& calib_temperature) {
  const auto a = check_confidence_args(hidden, prev_tokens, w1, weight, bias, calib_temperature);
  auto out = at::empty({a.batch, a.block}, a.hidden.options().dtype(at::kFloat));
  const int64_t width = a.hidden_size + a.rank, padded = round_up(width, VecD::size());
  float* confidence = out.data_ptr<float>();
  dispatch_logit_type(a.w1.scalar_type(), [&](auto w_tag) {
    dispatch_logit_type(a.hidden.scalar_type(), [&](auto h_tag) {
      dispatch_logit_type(a.weight.scalar_type(), [&](auto p_tag) {
        using W = decltype(w_tag);
        using H = decltype(h_tag);
        using P = decltype(p_tag);
        std::vector<double> w(padded, 0.0);
        for (int64_t k = 0; k < width; ++k) w[k] = load_double(a.weight.const_data_ptr<P>(), k);
        double b0 = 0.0;
        if (a.bias.defined()) {
          dispatch_logit_type(a.bias.scalar_type(), [&](auto b_tag) {
            b0 = load_double(a.bias.const_data_ptr<decltype(b_tag)>(), 0);
          });
        }
        const auto& ids = a.prev_tokens;
        const H* hidden = a.hidden.const_data_ptr<H>();
        const W* w1 = a.w1.const_data_ptr<W>();
        const float* tau = a.calib_temperature.defined() ? a.calib_temperature.const_data_ptr<float>() : nullptr;
        const int64_t h_stride0 = a.hidden.stride(0), h_stride1 = a.hidden.stride(1);
        const int64_t id_stride0 = ids.stride(0), id_stride1 = ids.stride(1);
        const int64_t w1_stride = a.w1.stride(0), vocab = a.w1.size(0);
        at::parallel_for(0, a.batch * a.block, 16, [&](int64_t begin, int64_t end) {
          // [h_j; W1[x_j]] through float32 (exact for every input dtype) with vector loads,
          // zero-padded to whole float64 vectors; widened to float64 inside the dot product.
          // Two rows at a time (see dot_widened2).
          std::vector<float> staged(2 * padded, 0.f);
          const auto stage = [&](int64_t i, float* dst) {
            const int64_t b = i / a.block, j = i % a.block;
            to_float(hidden + b * h_stride0 + j * h_stride1, a.hidden_size, dst);
            const int64_t id = read_id(ids, b * id_stride0 + j * id_stride1);
            if (id < 0 || id >= vocab) {
              std::fill(dst + a.hidden_size, dst + width, 0.f);
            } else {
              to_float(w1 + id * w1_stride, a.rank, dst + a.hidden_size);
            }
          };
          const auto finish = [&](int64_t i, double dot_value) {
            float logit = static_cast<float>(dot_value + b0);
            if (tau != nullptr) logit = logit / tau[i % a.block];
            confidence[i] = confidence_sigmoid(logit);
          };
          int64_t i = begin;
          for (; i + 2 <= end; i += 2) {
            stage(i, staged.data());
            stage(i + 1, staged.data() + padded);
            double dots[2];
            dot_widened2(staged.data(), staged.data() + padded, w.data(), padded, dots);
            finish(i, dots[0]);
            finish(i + 1, dots[1]);
          }
          if (i < end) {
            stage(i, staged.data());
            finish(i, dot(staged.data(), w.data(), padded));
          }
        });
      });
    });
  });
  return out;
}

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("markov_draft", &markov_draft_cpu);
  m.impl("rnn_draft", &rnn_draft_cpu);
  m.impl("draft_confidence", &draft_confidence_cpu);
}

}  // namespace dspark_ops
