#include "draft_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../common/checks.h"

namespace dspark_ops {

namespace {

const auto kFloatTypes = {at::kFloat, at::kBFloat16, at::kHalf};

at::Tensor check_per_request(const char* op, const char* name, const at::Tensor& t,
                             std::initializer_list<at::ScalarType> dtypes,
                             const at::Tensor& reference, int64_t batch) {
  check_device(op, name, t, reference, "base_logits");
  check_dtype(op, name, t, dtypes);
  check_shape(op, name, t, {batch}, "[B]");
  return t.contiguous();
}

}  // namespace

void check_dtype_like(const char* op, const char* name, const at::Tensor& t,
                      const at::Tensor& reference, const char* reference_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == reference.scalar_type(), op, "(): '", name,
                   "' must have dtype ", reference.scalar_type(), " like '", reference_name,
                   "', got ", t.scalar_type());
}

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

DraftArgs check_markov_draft_args(const char* op, const at::Tensor& base_logits,
                                  const at::Tensor& anchor, const at::Tensor& w1,
                                  const at::Tensor& w2, const at::Tensor& temperature,
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

DraftResult allocate_draft_outputs(const DraftArgs& a) {
  const auto options = a.base.options();
  return {at::empty({a.batch, a.block}, options.dtype(at::kLong)),
          at::empty({a.batch, a.block, a.vocab},
                    options.dtype(a.logits_bf16 ? at::kBFloat16 : at::kFloat))};
}

}  // namespace dspark_ops
