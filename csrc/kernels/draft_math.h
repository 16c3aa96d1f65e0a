// Scalar math of the drafting family shared by the CPU and CUDA kernels (torch-free).
//
//   Gumbel-max key of token v in slot j:  z(v) * (1/T) - log(E(v)),  E = -log1p(-u),  u from the
//   draft stream at position p0 + 1 + j (greedy: z(v)); the largest key wins, ties to the lower id,
//   and non-finite z never wins. One pass over the vocabulary suffices (no max or sum first), so
//   any split of the vocabulary merges exactly.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "../common/philox.h"

namespace dspark_ops {

DSPARK_HOST_DEVICE double rnn_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

DSPARK_HOST_DEVICE float confidence_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// A candidate (key, id) as one unsigned 64-bit word whose unsigned order is the race order: larger
// key first, then lower id. 0 is "no candidate"; keys must not be NaN.
DSPARK_HOST_DEVICE uint64_t pack_candidate(float key, int32_t id) {
  key = key + 0.f;  // -0 -> +0: equal keys must pack equal, so the lower id wins
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(key);
#else
  uint32_t bits;
  std::memcpy(&bits, &key, sizeof(bits));
#endif
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}

DSPARK_HOST_DEVICE int32_t candidate_id(uint64_t packed) {
  return packed == 0 ? -1 : static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(packed));
}

}  // namespace dspark_ops
