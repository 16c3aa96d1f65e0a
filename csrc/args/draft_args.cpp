#include "draft_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../common/checks.h"

namespace dspark_ops {

namespace {

const auto kFloatTypes = {at::kFloat, at::kBFloat16, at::kHalf};

// Kernels index the last dimension with unit stride; other strides are honoured.
at::Tensor unit_stride_last(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The dtype of `t` must be that of `reference` (named in the message).
void check_dtype_like(const char* op, const char* name, const at::Tensor& t,
                      const at::Tensor& reference, const char* reference_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == reference.scalar_type(), op, "(): '", name,
                   "' must have dtype ", reference.scalar_type(), " like '", reference_name,
                   "', got ", t.scalar_type());
}

at::Tensor check_per_request(const char* op, const char* name, const at::Tensor& t,
                             std::initializer_list<at::ScalarType> dtypes,
                             const at::Tensor& reference, int64_t batch) {
  check_device(op, name, t, reference, "base_logits");
  check_dtype(op, name, t, dtypes);
  check_shape(op, name, t, {batch}, "[B]");
  return t.contiguous();
}

// w1 and w2: [V, r] in one floating dtype; returns r.
int64_t check_markov_weights(const char* op, const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& reference, const char* reference_name,
                             int64_t vocab) {
  check_device(op, "w1", w1, reference, reference_name);
  check_dtype(op, "w1", w1, kFloatTypes);
  check_dim(op, "w1", w1, {2}, "2-D [V, r]");
  const int64_t rank = w1.size(1);
  TORCH_CHECK_VALUE(rank >= 1 && rank <= kMaxDraftRank, op, "(): 'w1' must have a rank r in [1, ",
                    kMaxDraftRank, "], got ", w1.sizes());
  check_shape(op, "w1", w1, {vocab, rank}, "[V, r]");
  if (w2.defined()) {
    check_device(op, "w2", w2, reference, reference_name);
    check_dtype_like(op, "w2", w2, w1, "w1");
    check_shape(op, "w2", w2, {vocab, rank}, "[V, r] like 'w1'");
  }
  return rank;
}

DraftArgs check_common(const char* op, const at::Tensor& base_logits, const at::Tensor& anchor,
                       const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& temperature,
                       const at::Tensor& seed, const at::Tensor& position,
                       const std::optional<at::Tensor>& top_k,
                       const std::optional<at::Tensor>& top_p,
                       const std::optional<at::Tensor>& min_p,
                       std::optional<at::ScalarType> draft_logits_dtype) {
  DraftArgs a;
  const at::ScalarType logits_dtype = draft_logits_dtype.value_or(at::kFloat);
  TORCH_CHECK_VALUE(logits_dtype == at::kFloat || logits_dtype == at::kBFloat16, op,
                    "(): 'draft_logits_dtype' must be torch.float32 or torch.bfloat16, got ",
                    logits_dtype);
  a.logits_bf16 = logits_dtype == at::kBFloat16;
  check_dim(op, "base_logits", base_logits, {3}, "3-D [B, G, V]");
  check_dtype(op, "base_logits", base_logits, kFloatTypes);
  a.batch = base_logits.size(0);
  a.block = base_logits.size(1);
  a.vocab = base_logits.size(2);
  TORCH_CHECK_VALUE(a.vocab >= 1 && a.vocab < INT32_MAX, op,
                    "(): 'base_logits' must have a vocabulary size in [1, 2^31 - 1), got ",
                    a.vocab);
  a.base = unit_stride_last(base_logits);
  a.anchor = check_per_request(op, "anchor", anchor, {at::kLong, at::kInt}, base_logits, a.batch);
  check_defined(op, "w2", w2);  // optional inside check_markov_weights, required here
  a.rank = check_markov_weights(op, w1, w2, base_logits, "base_logits", a.vocab);
  a.w1 = unit_stride_last(w1);
  a.w2 = unit_stride_last(w2);
  a.temperature = check_per_request(op, "temperature", temperature, {at::kFloat}, base_logits,
                                    a.batch);
  a.seed = check_per_request(op, "seed", seed, {at::kLong}, base_logits, a.batch);
  a.position = check_per_request(op, "position", position, {at::kLong}, base_logits, a.batch);
  a.filters = check_filter_args(op, top_k, top_p, min_p, a.batch, base_logits, "base_logits");
  if (value_checks_enabled(base_logits) && a.batch > 0) {
    check_values_in_range(op, "anchor", a.anchor, 0, a.vocab - 1);
    // Slot j draws from position + 1 + j, which must not overflow.
    check_values_in_range(op, "position", a.position, 0, int64_t{1} << 62);
    check_finite_non_negative(op, "temperature", a.temperature);
  }
  return a;
}

}  // namespace

DraftArgs check_markov_draft_args(const at::Tensor& base_logits, const at::Tensor& anchor,
                                  const at::Tensor& w1, const at::Tensor& w2,
                                  const at::Tensor& temperature, const at::Tensor& seed,
                                  const at::Tensor& position,
                                  const std::optional<at::Tensor>& top_k,
                                  const std::optional<at::Tensor>& top_p,
                                  const std::optional<at::Tensor>& min_p,
                                  std::optional<at::ScalarType> draft_logits_dtype) {
  return check_common("markov_draft", base_logits, anchor, w1, w2, temperature, seed, position,
                      top_k, top_p, min_p, draft_logits_dtype);
}

DraftArgs check_rnn_draft_args(const at::Tensor& base_logits, const at::Tensor& anchor,
                               const at::Tensor& hidden, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& joint_weight,
                               const at::Tensor& joint_bias, const at::Tensor& temperature,
                               const at::Tensor& seed, const at::Tensor& position,
                               const std::optional<at::Tensor>& top_k,
                               const std::optional<at::Tensor>& top_p,
                               const std::optional<at::Tensor>& min_p,
                               std::optional<at::ScalarType> draft_logits_dtype) {
  constexpr const char* kOp = "rnn_draft";
  auto a = check_common(kOp, base_logits, anchor, w1, w2, temperature, seed, position, top_k,
                        top_p, min_p, draft_logits_dtype);
  check_device(kOp, "hidden", hidden, base_logits, "base_logits");
  check_dtype(kOp, "hidden", hidden, kFloatTypes);
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
  return a;
}

std::tuple<at::Tensor, at::Tensor> allocate_draft_outputs(const DraftArgs& a) {
  const auto options = a.base.options();
  return {at::empty({a.batch, a.block}, options.dtype(at::kLong)),
          at::empty({a.batch, a.block, a.vocab},
                    options.dtype(a.logits_bf16 ? at::kBFloat16 : at::kFloat))};
}

ConfidenceArgs check_confidence_args(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                     const at::Tensor& w1, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& calib_temperature) {
  constexpr const char* kOp = "draft_confidence";
  ConfidenceArgs a;
  check_dim(kOp, "hidden", hidden, {3}, "3-D [B, G, d]");
  check_dtype(kOp, "hidden", hidden, kFloatTypes);
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
  check_dtype(kOp, "weight", weight, kFloatTypes);
  check_shape(kOp, "weight", weight, {a.hidden_size + a.rank}, "[d + r]");
  a.weight = weight.contiguous();
  if (bias.has_value()) {
    check_device(kOp, "bias", *bias, hidden, "hidden");
    check_dtype(kOp, "bias", *bias, kFloatTypes);
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
  return a;
}

}  // namespace dspark_ops
