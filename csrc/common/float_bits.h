// Bit casts between float32 and its 32-bit pattern, on the host and the device.
#pragma once

#include <cstdint>
#include <cstring>

#include "philox.h"  // DSPARK_HOST_DEVICE

namespace dspark_ops {

DSPARK_HOST_DEVICE uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

DSPARK_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

}  // namespace dspark_ops
