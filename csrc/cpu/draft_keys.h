// Gumbel-max keys of the drafting CPU kernels over a row of draft logits: a slot's sampling
// constants, the two best keys of a range (the winner and the runner-up, which the certificate
// of the float32 head compares) and the filtered draw.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "philox_lanes.h"
#include "../kernels/draft_math.h"
#include "../kernels/filter_math.h"
#include "../kernels/sampling_math.h"

namespace dspark_ops::draft_cpu {

using VecF = at::vec::Vectorized<float>;

// Per-request sampling constants of one slot.
struct SlotSampling {
  std::vector<float> inv_temperature;  // 1/T, or 1 for greedy requests
  std::vector<char> greedy;
  std::vector<int64_t> seed, position;  // position of this slot's draw: p0 + 1 + j
  std::vector<FilterSpec> filter;
  bool round_bf16 = false;  // bfloat16 draft_logits: keys are those of z rounded to bfloat16
};

// The two best Gumbel-max keys of a request over a range: the winner and the largest key of any
// other candidate (-inf when there is none).
struct TopTwo {
  RaceCandidate best = empty_candidate();
  float second = -INFINITY;
};

inline void offer(TopTwo& t, RaceCandidate c) {
  const RaceCandidate w = better_candidate(t.best, c);
  if (w.index == c.index) {
    if (t.best.index >= 0) t.second = std::max(t.second, t.best.key);
    t.best = c;
  } else {
    t.second = std::max(t.second, c.key);
  }
}

// Union of two disjoint ranges' TopTwo.
inline TopTwo merge(TopTwo a, const TopTwo& b) {
  if (b.best.index >= 0) offer(a, b.best);
  a.second = std::max(a.second, b.second);
  return a;
}

// Request b's two best Gumbel-max candidates over z[x0, x1) (x0 a multiple of 32), 32 keys at a
// time (whole Philox blocks; the tail past x1 is masked).
inline TopTwo best_key(const float* z, int64_t x0, int64_t x1, const SlotSampling& s, int64_t b) {
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
inline int64_t filtered_token(float* z, int64_t vocab, const SlotSampling& s, int64_t b) {
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

}  // namespace dspark_ops::draft_cpu
