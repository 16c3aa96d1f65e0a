#pragma once
// Element conversions of the CPU kernels' inputs: rows as float32 with at::vec's vector loads,
// single elements as float64, float32 rounded to bfloat16, ids as int64. All widenings are exact.
// The CUDA kernels' twin is kernels/convert.cuh (torch-free, so it cannot share at::vec or c10's
// types); both round to bfloat16 to nearest, ties to even.

#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dspark_ops {

// src[0, n) as float32 into dst, a vector at a time.
template <typename T>
inline void to_float(const T* src, int64_t n, float* dst) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      Vec v;
      at::vec::load_to_float<T>(src + i, v);
      v.store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// p[i] as float64 (through float32, exact for every float type the kernels take).
template <typename T>
inline double load_double(const T* p, int64_t i) {
  return static_cast<double>(static_cast<float>(p[i]));
}

// z rounded to bfloat16 (nearest even, torch's conversion), as a float.
inline float round_bf16(float z) { return static_cast<float>(c10::BFloat16(z)); }

// Element `offset` of an int32 or int64 id tensor, as int64.
inline int64_t read_id(const at::Tensor& ids, int64_t offset) {
  return ids.scalar_type() == at::kInt ? ids.const_data_ptr<int32_t>()[offset]
                                       : ids.const_data_ptr<int64_t>()[offset];
}

}  // namespace dspark_ops
