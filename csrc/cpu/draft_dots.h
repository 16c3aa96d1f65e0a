// Float64 dot products of the drafting CPU kernels (cpu/draft_cpu.cpp's exact head and RNN joint
// layer, cpu/draft_confidence_cpu.cpp): fixed summation orders, so every row's sum is the same
// whichever kernel takes it (the exact head and the bfloat16 rounding fix rely on that).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace dspark_ops::draft_cpu {

using VecD = at::vec::Vectorized<double>;
constexpr int kRowsPerGroup = 8;  // W2 rows converted and dotted together

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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
inline VecD widen(const float* a) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  if constexpr (VecD::size() == 4) return VecD(_mm256_cvtps_pd(_mm_loadu_ps(a)));
#endif
  double lanes[VecD::size()];
  for (int i = 0; i < VecD::size(); ++i) lanes[i] = a[i];
  return VecD::loadu(lanes);
}

inline VecD load_row(const double* a) { return VecD::loadu(a); }
inline VecD load_row(const float* a) { return widen(a); }

// The four chains of a dot product added in a fixed order, then their lanes.
inline double sum_chains(const VecD* acc) {
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
inline void dot_widened2(const float* a0, const float* a1, const double* b, int64_t padded,
                         double* out) {
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

}  // namespace dspark_ops::draft_cpu
