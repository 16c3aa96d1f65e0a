#pragma once
// Rows of the CPU kernels' inputs as float32, with at::vec's vector loads (exact for 16-bit
// floats); shared by the drafting and attention CPU kernels.

#include <ATen/cpu/vec/vec.h>

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

}  // namespace dspark_ops
