// 2^x with results below 2^-126 flushed to zero, on the host and the device: the softmax weights
// of verify, the filters and block attention (their exponents are pre-scaled by log2(e)).
//
// On CUDA this is one MUFU.EX2 (ex2.approx.ftz.f32, within 2 ulp: CUDA's exp2f is the same
// instruction plus a rescale for results below 2^-126; expf is a dozen instructions). The host
// branch computes the same value up to that approximation, flush included, so the emulated
// kernels (and the CPU kernels' scalar paths) treat a weight below 2^-126 of the row's largest as
// the GPU does: 0 (it could matter only with probability below 1e-38).
#pragma once

#include <cfloat>
#include <cmath>

#include "philox.h"  // DSPARK_HOST_DEVICE

namespace dspark_ops {

constexpr float kLog2e = 1.44269504088896340736f;

DSPARK_HOST_DEVICE float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.f : y;
#endif
}

}  // namespace dspark_ops
