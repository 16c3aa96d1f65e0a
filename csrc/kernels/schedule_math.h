// Scalar math of the scheduling ops (docs/semantics.md §3.4), shared by the CPU and CUDA kernels
// (torch-free) and spelled the same way in dspark_ops/reference.py.
//
// Pairs (r, j) are ranked by one 64-bit key, ascending = survival descending, then position j,
// then request r: key = (bits(1.0f) - bits(a)) << 32 | (j * B + r). Non-negative floats order like
// their bit patterns, so the key order is exact. Ineligible pairs (a <= 0 or NaN, or past the
// request's cap) get kIneligible and sort last.
//
// Expected tokens tau = B + sum of admitted survivals is kept exactly in fixed point (survival
// * 2^32 rounded half to even): sums of up to 2^15 terms <= 2^32 stay below 2^53, so the objective
// Theta = double(tau) * double(step_rate[N]) is the same correctly rounded product everywhere, and
// CPU, CUDA and the reference make identical decisions.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "../common/float_bits.h"

namespace dspark_ops {

constexpr uint64_t kIneligible = ~uint64_t{0};
constexpr uint32_t kOneBits = 0x3F800000u;  // bits of 1.0f
constexpr double kSurvivalScale = 4294967296.0;  // 2^32

// Confidences outside [0, 1] (and NaN) are clamped, so an unchecked input can never reorder keys.
DSPARK_HOST_DEVICE float clamp_confidence(float c) { return fminf(fmaxf(c, 0.f), 1.f); }

DSPARK_HOST_DEVICE uint64_t pair_key(float survival, uint32_t index) {
  return survival > 0.f ? (uint64_t{kOneBits - float_bits(survival)} << 32) | index : kIneligible;
}

DSPARK_HOST_DEVICE float key_survival(uint64_t key) {
  return bits_float(kOneBits - static_cast<uint32_t>(key >> 32));
}

DSPARK_HOST_DEVICE uint32_t key_index(uint64_t key) { return static_cast<uint32_t>(key); }

DSPARK_HOST_DEVICE int64_t fixed_survival(float survival) {
  return static_cast<int64_t>(rint(static_cast<double>(survival) * kSurvivalScale));
}

// Theta of fixed-point expected tokens `tau` at a verify batch's step rate.
DSPARK_HOST_DEVICE double theta(int64_t tau, float rate) {
  return static_cast<double>(tau) * static_cast<double>(rate);
}

// Theta for a verify batch of `tokens` tokens with fixed-point expected tokens `tau`.
DSPARK_HOST_DEVICE double theta(int64_t tau, const float* step_rate, int64_t tokens) {
  return theta(tau, step_rate[tokens]);
}

}  // namespace dspark_ops
