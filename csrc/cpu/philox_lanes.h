// 32 consecutive uniforms of one Philox stream at once, for the CPU kernels' vectorised loops.
//
// philox_uniforms32(seed, position, purpose, group, u) fills u[i] = philox_uniform(seed, position,
// purpose, 4 * group + i) for i < 32, i.e. the eight Philox blocks group ... group + 7. With AVX2
// the eight blocks run in the eight lanes of one register (the 32x32 -> 64-bit products two lanes
// at a time), then are transposed to element order and turned into floats; every step is exact
// integer math or the same correctly rounded float32 operation as uniform_from_bits, so the values
// are those of the scalar generator bit for bit (python_tests compare them with the reference).
#pragma once

#include <cstdint>

#include "../common/philox.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dspark_ops {

#if defined(__AVX2__)
namespace philox_lanes_detail {

// (hi, lo) 32-bit halves of the lane-wise products a * b.
inline void mulhilo8(__m256i a, __m256i b, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, b);  // lanes 0, 2, 4, 6 as 64-bit products
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32));
  lo = _mm256_mullo_epi32(a, b);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// float32 uniforms of eight 32-bit words, as uniform_from_bits: the word is split in 16-bit halves
// so that both convert exactly and their sum rounds once, as a direct conversion does.
inline __m256 uniforms8(__m256i bits) {
  const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 16));
  const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF)));
  const __m256 value = _mm256_add_ps(_mm256_mul_ps(high, _mm256_set1_ps(65536.f)), low);
  const __m256 u = _mm256_add_ps(_mm256_mul_ps(value, _mm256_set1_ps(2.3283064365386963e-10f)),
                                 _mm256_set1_ps(1.1641532182693481e-10f));
  return _mm256_min_ps(u, _mm256_set1_ps(0.99999994f));
}

}  // namespace philox_lanes_detail

inline void philox_uniforms32(int64_t seed, int64_t position, uint32_t purpose, uint32_t group,
                              float* u) {
  using namespace philox_lanes_detail;
  const uint64_t s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(group)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(purpose));
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(p)));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(p >> 32)));
  uint32_t key0 = static_cast<uint32_t>(s), key1 = static_cast<uint32_t>(s >> 32);
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(mul0, c0, hi0, lo0);
    mulhilo8(mul1, c2, hi1, lo1);
    const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key0));
    const __m256i k1 = _mm256_set1_epi32(static_cast<int>(key1));
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0);
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1);
    c3 = lo0;
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  // Lane g of c_k is word k of block group + g, i.e. element 4 g + k: transpose to element order.
  const __m256i w01lo = _mm256_unpacklo_epi32(c0, c1), w01hi = _mm256_unpackhi_epi32(c0, c1);
  const __m256i w23lo = _mm256_unpacklo_epi32(c2, c3), w23hi = _mm256_unpackhi_epi32(c2, c3);
  const __m256i b04 = _mm256_unpacklo_epi64(w01lo, w23lo), b15 = _mm256_unpackhi_epi64(w01lo, w23lo);
  const __m256i b26 = _mm256_unpacklo_epi64(w01hi, w23hi), b37 = _mm256_unpackhi_epi64(w01hi, w23hi);
  _mm256_storeu_ps(u, uniforms8(_mm256_permute2x128_si256(b04, b15, 0x20)));
  _mm256_storeu_ps(u + 8, uniforms8(_mm256_permute2x128_si256(b26, b37, 0x20)));
  _mm256_storeu_ps(u + 16, uniforms8(_mm256_permute2x128_si256(b04, b15, 0x31)));
  _mm256_storeu_ps(u + 24, uniforms8(_mm256_permute2x128_si256(b26, b37, 0x31)));
}

#else

inline void philox_uniforms32(int64_t seed, int64_t position, uint32_t purpose, uint32_t group,
                              float* u) {
  for (uint32_t g = 0; g < 8; ++g) {
    const auto block = philox_block(seed, position, purpose, group + g);
    for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
  }
}

#endif

}  // namespace dspark_ops
