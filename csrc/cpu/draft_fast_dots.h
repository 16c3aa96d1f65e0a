// The float32 head's micro-kernels of the drafting CPU kernels (cpu/draft_cpu.cpp): dot products
// of eight W2 rows with one or two requests' inputs, row norms, and the logits' store with the
// chunk's statistics, with AVX2 code where at::vec has no equivalent (lane sums of eight
// registers at once, the two-request dot, the float64 addition of the base logits). Their
// summation orders are those the certificate (draft_certificate.h) bounds.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "convert.h"
#include "draft_keys.h"

namespace dspark_ops::draft_cpu {

#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
// out[i] = the sum of acc[i]'s eight lanes, all eight at once: a tree of depth 3 (within the
// certificate's n), the same for every dot of the fast head.
inline void lane_sums8(const __m256 (&acc)[8], float* out) {
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
inline void fast_dot_pair(const float* a0, const float* a1, const float* rows, int64_t padded,
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
inline float squared_norm(const float* x, int64_t padded) {
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

}  // namespace dspark_ops::draft_cpu
