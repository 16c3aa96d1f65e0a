// The drafting family's shared kernel arguments (DraftParams, filled by cuda/draft_cuda.cu) and
// the launch geometry its slot and RNN head kernels have in common, torch-free. The kernels: the
// slot kernel in draft_slot.cuh, the sampling filters' kernel in draft_filter.cuh, the RNN head in
// draft_rnn_head.cuh; draft.cuh launches them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

constexpr int kDraftThreads = 256;
constexpr int kDraftWarps = kDraftThreads / 32;

struct DraftParams {
  const void* w1;  // [V, r] of type W, unit stride along r
  int64_t w1_stride;
  bool w1_aligned;  // rows start 16-byte aligned: vector gathers
  const void* w2;  // [V, r] of type W, unit stride along r
  int64_t w2_stride;
  bool w2_aligned;  // rows start 16-byte aligned: vector fragment loads
  const void* base;  // [B, G, V] of the kernel's Base type, unit stride along V
  int64_t base_stride_b, base_stride_j;
  const void* anchor;  // int32 or int64 [B]
  bool anchor_int32;
  const float* temperature;
  const int64_t* seed;
  const int64_t* position;
  const int32_t* top_k;  // [B] or null (off), as the three filters
  const float* top_p;
  const float* min_p;
  int64_t* tokens;     // [B, G]
  void* draft_logits;  // [B, G, V]: float32, or bfloat16 when logits_bf16
  bool logits_bf16;    // z rounded to bfloat16 before it is stored and sampled
  // rnn_draft only.
  const void* hidden;  // [B, G, d], unit stride along d, ElementType hidden_type
  int hidden_type;
  int64_t hidden_stride_b, hidden_stride_j;
  const void* joint_weight;  // [3r, 2r + d] of type W, unit stride along columns
  int64_t joint_stride;
  const void* joint_bias;  // [3r] of type W
  float* preactivation;    // [B, 3r] workspace
  float* state;            // [B, r] workspace: s_0 = 0 is never read, so it needs no fill
  // Counters: zero when a call starts, and returned to zero by the last block of each group.
  unsigned long long* best;  // [G, B] packed candidates
  int32_t* arrivals;         // [G, groups]
  int batch, block, rank, hidden_size, group_size, num_tiles, slot;
  int64_t vocab;
};

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
