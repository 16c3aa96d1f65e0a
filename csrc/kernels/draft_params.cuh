// What the drafting family's slot and RNN head kernels share besides their arguments (DraftParams
// and the launch geometry, kernels/draft_launch.h), torch-free. The kernels: the
// slot kernel in draft_slot.cuh, the sampling filters' kernel in draft_filter.cuh, the RNN head in
// draft_rnn_head.cuh; draft.cuh launches them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "draft_launch.h"

namespace dspark_ops::kernels {

// x_j of request b: the anchor for slot 0, else the token the previous slot's launch wrote.
__device__ __forceinline__ int64_t previous_token(const DraftParams& p, int b) {
  if (p.slot == 0) {
    return p.anchor_int32 ? static_cast<const int32_t*>(p.anchor)[b]
                          : static_cast<const int64_t*>(p.anchor)[b];
  }
  return p.tokens[int64_t{b} * p.block + p.slot - 1];
}

__host__ __device__ inline bool has_filters(const DraftParams& p) {
  return p.top_k || p.top_p || p.min_p;
}

// Float32 head sums at or above this magnitude (or not finite) are summed again in float64: an
// overflow (inf, or inf - inf = NaN) or a sum of terms too large for float32 rounding to be
// trusted, from finite weights near float32's range where the float64 z may be finite. Logits
// never come near it, so for ordinary inputs the slow path is one untaken branch per element.
constexpr float kExactHeadAbove = 1e30f;

}  // namespace dspark_ops::kernels
