// The device-independent front end of verify: argument checks and normalised views that the CPU
// and CUDA implementations share.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "filter_args.h"

namespace dspark_ops {

struct VerifyArgs {
  at::Tensor target;        // [R, V], unit stride along V; or, when the caller keeps padded
                            // targets and the input [B, G+1, V] is no [R, V] view, that 3-D tensor
  at::Tensor draft_tokens;  // int32/int64 [B, G], any strides
  at::Tensor num_draft;     // int32 [B], contiguous
  at::Tensor temperature;   // float32 [B], contiguous
  at::Tensor seed;          // int64 [B], contiguous
  at::Tensor position;      // int64 [B], contiguous
  at::Tensor draft_logits;  // undefined, or [B, G, V] with unit stride along V
  at::Tensor target_start;  // undefined (rows b*(G+1)), or int32 [B], contiguous
  at::Tensor draft_temperature;  // undefined (= temperature), or float32 [B], contiguous
  FilterArgs filters;            // top_k / top_p / min_p of the target distribution
  at::Tensor allowed_token_mask;  // undefined (all allowed), or int32 [R, ceil(V/32)], contiguous
  bool return_logprobs = false;
  int64_t batch = 0, block = 0, vocab = 0, rows = 0;
};

VerifyArgs check_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                             const at::Tensor& num_draft, const at::Tensor& temperature,
                             const at::Tensor& seed, const at::Tensor& position,
                             const std::optional<at::Tensor>& draft_logits,
                             const std::optional<at::Tensor>& target_start,
                             const std::optional<at::Tensor>& draft_temperature,
                             const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p,
                             const std::optional<at::Tensor>& allowed_token_mask,
                             bool return_logprobs, bool keep_padded_target = false);

// tokens int64 [B, G+1], num_accepted int32 [B], valid bool [B] and logprobs float32 [B, G+1]
// (or [B, 0] when not asked for) on the inputs' device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_verify_outputs(
    const VerifyArgs& args);

}  // namespace dspark_ops
