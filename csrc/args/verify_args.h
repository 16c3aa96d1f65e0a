// The entry of verify, shared by its CPU and CUDA kernels: argument checks and normalised views,
// output allocation, then the backend's run.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "../common/backend.h"
#include "../common/checks.h"
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

// tokens int64 [B, G+1], num_accepted int32 [B], valid bool [B] and logprobs float32 [B, G+1]
// (or [B, 0] when not asked for) on the inputs' device.
using VerifyResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
VerifyResult allocate_verify_outputs(const VerifyArgs& args);

// Kernels index along the vocabulary with unit stride; other strides are honoured.
inline at::Tensor unit_stride_vocab(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// A per-request tensor: on target_logits' device, of `dtype` and shape [batch]; made contiguous.
at::Tensor check_verify_per_request(const char* name, const at::Tensor& t, at::ScalarType dtype,
                                    const at::Tensor& reference, int64_t batch);

namespace ops {

// Backend::kKeepPaddedTarget: whether its kernels read a padded target [B, G+1, V] whose requests
// are unevenly spaced through both strides (else it is made an [R, V] copy).
template <typename Backend>
VerifyResult verify(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                    const at::Tensor& num_draft, const at::Tensor& temperature,
                    const at::Tensor& seed, const at::Tensor& position,
                    const std::optional<at::Tensor>& draft_logits,
                    const std::optional<at::Tensor>& target_start,
                    const std::optional<at::Tensor>& draft_temperature,
                    const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                    const std::optional<at::Tensor>& min_p,
                    const std::optional<at::Tensor>& allowed_token_mask, bool return_logprobs) {
  constexpr const char* kOp = "verify";
  const auto float_types = {at::kFloat, at::kBFloat16, at::kHalf};
  VerifyArgs a;

  check_dim(kOp, "draft_tokens", draft_tokens, {2}, "2-D [B, G]");
  check_device(kOp, "draft_tokens", draft_tokens, target_logits, "target_logits");
  check_dtype(kOp, "draft_tokens", draft_tokens, {at::kLong, at::kInt});
  a.batch = draft_tokens.size(0);
  a.block = draft_tokens.size(1);
  a.draft_tokens = draft_tokens;

  check_dim(kOp, "target_logits", target_logits, {2, 3}, "2-D [R, V] or 3-D [B, G+1, V]");
  check_dtype(kOp, "target_logits", target_logits, float_types);
  a.vocab = target_logits.size(-1);
  TORCH_CHECK_VALUE(a.vocab >= 1 && a.vocab < INT32_MAX, kOp,
                    "(): 'target_logits' must have a vocabulary size in [1, 2^31 - 1), got ",
                    a.vocab);
  if (target_logits.dim() == 3) {
    // A padded target of the right batch whose row count disagrees with the drafts' width:
    // blame the drafts unless draft_logits (when given) sides with them.
    if (target_logits.size(0) == a.batch && target_logits.size(1) != a.block + 1) {
      const bool drafts_are_odd =
          !draft_logits.has_value() ||
          (draft_logits->dim() == 3 && draft_logits->size(1) + 1 == target_logits.size(1));
      TORCH_CHECK_VALUE(!drafts_are_odd, kOp, "(): 'draft_tokens' must have shape [B, G] = [",
                        a.batch, ", ", target_logits.size(1) - 1,
                        "] to match 'target_logits' [B, G+1, V] = ", target_logits.sizes(),
                        ", got ", draft_tokens.sizes());
    }
    check_shape(kOp, "target_logits", target_logits, {a.batch, a.block + 1, a.vocab},
                "[B, G+1, V]");
  }
  // A padded target whose requests are not evenly spaced (a slice of a wider buffer) is no
  // [R, V] view: reshape would copy it, so a caller that reads through both strides keeps it.
  const bool uneven = target_logits.dim() == 3 && target_logits.size(0) > 1 &&
                      target_logits.size(1) > 1 &&
                      target_logits.stride(0) != target_logits.size(1) * target_logits.stride(1);
  a.target = unit_stride_vocab(Backend::kKeepPaddedTarget && uneven
                                   ? target_logits
                                   : target_logits.reshape({-1, a.vocab}));
  a.rows = target_logits.numel() / a.vocab;

  a.num_draft = check_verify_per_request("num_draft", num_draft, at::kInt, target_logits, a.batch);
  a.temperature = check_verify_per_request("temperature", temperature, at::kFloat, target_logits, a.batch);
  a.seed = check_verify_per_request("seed", seed, at::kLong, target_logits, a.batch);
  a.position = check_verify_per_request("position", position, at::kLong, target_logits, a.batch);

  if (draft_logits.has_value()) {
    const auto& d = *draft_logits;
    check_device(kOp, "draft_logits", d, target_logits, "target_logits");
    check_dtype(kOp, "draft_logits", d, float_types);
    check_shape(kOp, "draft_logits", d, {a.batch, a.block, a.vocab}, "[B, G, V]");
    a.draft_logits = unit_stride_vocab(d);
  }
  if (draft_temperature.has_value()) {
    a.draft_temperature = check_verify_per_request("draft_temperature", *draft_temperature, at::kFloat,
                                            target_logits, a.batch);
  }
  if (target_start.has_value()) {
    a.target_start =
        check_verify_per_request("target_start", *target_start, at::kInt, target_logits, a.batch);
  } else {
    TORCH_CHECK_VALUE(a.rows == a.batch * (a.block + 1), kOp,
                      "(): without 'target_start', 'target_logits' must hold B*(G+1) = ",
                      a.batch * (a.block + 1), " rows (the padded layout; B and G from "
                      "'draft_tokens' of shape ", draft_tokens.sizes(), "), got ", a.rows);
  }

  a.filters = check_filter_args(kOp, top_k, top_p, min_p, a.batch, target_logits, "target_logits");
  if (allowed_token_mask.has_value()) {
    const auto& m = *allowed_token_mask;
    check_device(kOp, "allowed_token_mask", m, target_logits, "target_logits");
    check_dtype(kOp, "allowed_token_mask", m, {at::kInt});
    check_shape(kOp, "allowed_token_mask", m, {a.rows, (a.vocab + 31) / 32},
                "[R, ceil(V/32)] (one row per target_logits row)");
    a.allowed_token_mask = m.contiguous();
  }
  a.return_logprobs = return_logprobs;

  if (value_checks_enabled(target_logits) && a.batch > 0) {
    check_values_in_range(kOp, "num_draft", a.num_draft, 0, a.block);
    check_values_in_range(kOp, "draft_tokens", draft_tokens, 0, a.vocab - 1, a.num_draft);
    // Row j draws from position + 1 + j, which must not overflow.
    check_values_in_range(kOp, "position", a.position, 0, int64_t{1} << 62);
    check_finite_non_negative(kOp, "temperature", a.temperature);
    if (a.draft_temperature.defined()) {
      check_finite_non_negative(kOp, "draft_temperature", a.draft_temperature);
    }
    if (a.target_start.defined()) {
      check_values_in_range(kOp, "target_start", a.target_start, 0, a.rows - 1);
      check_values_in_range(kOp, "target_start + num_draft", a.target_start + a.num_draft, 0,
                            a.rows - 1);
    }
  }
  const typename Backend::Guard guard(target_logits.device());
  auto outputs = allocate_verify_outputs(a);
  Backend::run(a, outputs);
  return outputs;
}

}  // namespace ops
}  // namespace dspark_ops
