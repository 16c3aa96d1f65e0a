// bfloat16 draft_logits on the drafting CPU kernels (cpu/draft_cpu.cpp): the few elements whose
// float32 z lies within the certificate's bound of a bfloat16 rounding midpoint are recomputed in
// float64, so the stored rows are the exact head's bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "convert.h"
#include "draft_dots.h"
#include "draft_keys.h"

namespace dspark_ops::draft_cpu {

// ---- bfloat16 draft_logits ---------------------------------------------------------------
//
// Both heads then store and sample r = bf16(z) (round to nearest even, which is monotone): the
// exact head r_e = bf16(z_e), the fast head r_f = bf16(z_f), with |z_f - z_e| <= Dz (step 2 of
// draft_certificate.h).
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
inline bool rounding_certain(float z, double dz) {
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
inline bool far_from_midpoint(float z, double dz) {
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
inline int64_t rounded_token(const float* z, int64_t vocab, const SlotSampling& s, int64_t b,
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

}  // namespace dspark_ops::draft_cpu
