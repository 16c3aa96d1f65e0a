// The entries of the drafting family, shared by the CPU and CUDA kernels of markov_draft,
// rnn_draft and draft_confidence: argument and value checks, output allocation, then the
// backend's run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

#include "../common/backend.h"
#include "../common/checks.h"
#include "filter_args.h"

namespace dspark_ops {

struct DraftArgs {
  at::Tensor base;         // [B, G, V], unit stride along V
  at::Tensor anchor;       // int32/int64 [B], contiguous
  at::Tensor w1, w2;       // [V, r] in one dtype, unit stride along r
  at::Tensor temperature;  // float32 [B], contiguous
  at::Tensor seed;         // int64 [B], contiguous
  at::Tensor position;     // int64 [B], contiguous
  FilterArgs filters;      // top_k / top_p / min_p of the proposal
  bool logits_bf16 = false;  // draft_logits in bfloat16: z rounded before it is sampled
  // rnn_draft only (undefined for markov_draft).
  at::Tensor hidden;        // [B, G, d], unit stride along d
  at::Tensor joint_weight;  // [3r, 2r + d] in w1's dtype, unit stride along columns
  at::Tensor joint_bias;    // [3r] in w1's dtype, contiguous
  int64_t batch = 0, block = 0, vocab = 0, rank = 0, hidden_size = 0;
};

// The largest Markov rank the kernels take (the released checkpoints use 256).
constexpr int64_t kMaxDraftRank = 1024;

// tokens int64 [B, G] and draft_logits float32 or bfloat16 (args.logits_bf16) [B, G, V]
// (contiguous) on the inputs' device.
using DraftResult = std::tuple<at::Tensor, at::Tensor>;
DraftResult allocate_draft_outputs(const DraftArgs& args);

// The checks markov_draft and rnn_draft share (all of markov_draft's arguments); `op` names the
// calling op in messages.
DraftArgs check_markov_draft_args(const char* op, const at::Tensor& base_logits,
                                  const at::Tensor& anchor, const at::Tensor& w1,
                                  const at::Tensor& w2, const at::Tensor& temperature,
                                  const at::Tensor& seed, const at::Tensor& position,
                                  const std::optional<at::Tensor>& top_k,
                                  const std::optional<at::Tensor>& top_p,
                                  const std::optional<at::Tensor>& min_p,
                                  std::optional<at::ScalarType> draft_logits_dtype);

// w1 and w2 (when defined): [V, r] in one floating dtype, on the device of `reference`; returns r.
int64_t check_markov_weights(const char* op, const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& reference, const char* reference_name,
                             int64_t vocab);

// The dtype of `t` must be that of `reference` (named in the message).
void check_dtype_like(const char* op, const char* name, const at::Tensor& t,
                      const at::Tensor& reference, const char* reference_name);

// Kernels index the last dimension with unit stride; other strides are honoured.
inline at::Tensor unit_stride_last(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

struct ConfidenceArgs {
  at::Tensor hidden;             // [B, G, d], unit stride along d
  at::Tensor prev_tokens;        // int32/int64 [B, G], any strides
  at::Tensor w1;                 // [V, r], unit stride along r
  at::Tensor weight;             // [d + r], contiguous
  at::Tensor bias;               // undefined, or one element (contiguous)
  at::Tensor calib_temperature;  // undefined, or float32 [G], contiguous
  int64_t batch = 0, block = 0, vocab = 0, rank = 0, hidden_size = 0;
};

namespace ops {

template <typename Backend>
DraftResult markov_draft(const at::Tensor& base_logits, const at::Tensor& anchor,
                         const at::Tensor& w1, const at::Tensor& w2,
                         const at::Tensor& temperature, const at::Tensor& seed,
                         const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                         const std::optional<at::Tensor>& top_p,
                         const std::optional<at::Tensor>& min_p,
                         std::optional<at::ScalarType> draft_logits_dtype) {
  const auto a = check_markov_draft_args("markov_draft", base_logits, anchor, w1, w2, temperature,
                                         seed, position, top_k, top_p, min_p, draft_logits_dtype);
  const typename Backend::Guard guard(base_logits.device());
  auto outputs = allocate_draft_outputs(a);
  Backend::run(a, outputs);
  return outputs;
}

template <typename Backend>
DraftResult rnn_draft(const at::Tensor& base_logits, const at::Tensor& anchor,
                      const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
                      const at::Tensor& joint_weight, const at::Tensor& joint_bias,
                      const at::Tensor& temperature, const at::Tensor& seed,
                      const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                      const std::optional<at::Tensor>& top_p,
                      const std::optional<at::Tensor>& min_p,
                      std::optional<at::ScalarType> draft_logits_dtype) {
  constexpr const char* kOp = "rnn_draft";
  auto a = check_markov_draft_args(kOp, base_logits, anchor, w1, w2, temperature, seed, position,
                                   top_k, top_p, min_p, draft_logits_dtype);
  check_device(kOp, "hidden", hidden, base_logits, "base_logits");
  check_dtype(kOp, "hidden", hidden, {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(kOp, "hidden", hidden, {3}, "3-D [B, G, d]");
  a.hidden_size = hidden.size(2);
  check_shape(kOp, "hidden", hidden, {a.batch, a.block, a.hidden_size}, "[B, G, d]");
  a.hidden = unit_stride_last(hidden);
  check_device(kOp, "joint_weight", joint_weight, base_logits, "base_logits");
  check_dtype_like(kOp, "joint_weight", joint_weight, w1, "w1");
  check_shape(kOp, "joint_weight", joint_weight, {3 * a.rank, 2 * a.rank + a.hidden_size},
              "[3r, 2r + d]");
  a.joint_weight = unit_stride_last(joint_weight);
  check_device(kOp, "joint_bias", joint_bias, base_logits, "base_logits");
  check_dtype_like(kOp, "joint_bias", joint_bias, w1, "w1");
  check_shape(kOp, "joint_bias", joint_bias, {3 * a.rank}, "[3r]");
  a.joint_bias = joint_bias.contiguous();
  const typename Backend::Guard guard(base_logits.device());
  auto outputs = allocate_draft_outputs(a);
  Backend::run(a, outputs);
  return outputs;
}

// out float32 [B, G] on hidden's device.
template <typename Backend>
at::Tensor draft_confidence(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                            const at::Tensor& w1, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& calib_temperature) {
  constexpr const char* kOp = "draft_confidence";
  const auto float_types = {at::kFloat, at::kBFloat16, at::kHalf};
  ConfidenceArgs a;
  check_dim(kOp, "hidden", hidden, {3}, "3-D [B, G, d]");
  check_dtype(kOp, "hidden", hidden, float_types);
  a.batch = hidden.size(0);
  a.block = hidden.size(1);
  a.hidden_size = hidden.size(2);
  a.hidden = unit_stride_last(hidden);
  check_device(kOp, "prev_tokens", prev_tokens, hidden, "hidden");
  check_dtype(kOp, "prev_tokens", prev_tokens, {at::kLong, at::kInt});
  check_shape(kOp, "prev_tokens", prev_tokens, {a.batch, a.block}, "[B, G]");
  a.prev_tokens = prev_tokens;
  check_dim(kOp, "w1", w1, {2}, "2-D [V, r]");
  a.vocab = w1.size(0);
  TORCH_CHECK_VALUE(a.vocab >= 1 && a.vocab < INT32_MAX, kOp,
                    "(): 'w1' must have a vocabulary size in [1, 2^31 - 1), got ", a.vocab);
  a.rank = check_markov_weights(kOp, w1, at::Tensor(), hidden, "hidden", a.vocab);
  a.w1 = unit_stride_last(w1);
  check_device(kOp, "weight", weight, hidden, "hidden");
  check_dtype(kOp, "weight", weight, float_types);
  check_shape(kOp, "weight", weight, {a.hidden_size + a.rank}, "[d + r]");
  a.weight = weight.contiguous();
  if (bias.has_value()) {
    check_device(kOp, "bias", *bias, hidden, "hidden");
    check_dtype(kOp, "bias", *bias, float_types);
    TORCH_CHECK_VALUE(bias->numel() == 1, kOp, "(): 'bias' must have exactly one element, got shape ",
                      bias->sizes());
    a.bias = bias->reshape({1}).contiguous();
  }
  if (calib_temperature.has_value()) {
    check_device(kOp, "calib_temperature", *calib_temperature, hidden, "hidden");
    check_dtype(kOp, "calib_temperature", *calib_temperature, {at::kFloat});
    check_shape(kOp, "calib_temperature", *calib_temperature, {a.block}, "[G]");
    a.calib_temperature = calib_temperature->contiguous();
  }
  if (value_checks_enabled(hidden) && a.batch * a.block > 0) {
    check_values_in_range(kOp, "prev_tokens", prev_tokens, 0, a.vocab - 1);
  }
  if (value_checks_enabled(hidden) && a.calib_temperature.defined()) {
    check_finite_positive(kOp, "calib_temperature", a.calib_temperature);
  }
  Backend::check(a);
  const typename Backend::Guard guard(hidden.device());
  auto out = at::empty({a.batch, a.block}, a.hidden.options().dtype(at::kFloat));
  Backend::run(a, out);
  return out;
}

}  // namespace ops

}  // namespace dspark_ops
