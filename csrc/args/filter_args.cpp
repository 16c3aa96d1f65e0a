#include "filter_args.h"

#include <ATen/core/Tensor.h>

#include "../common/checks.h"

namespace dspark_ops {

namespace {
at::Tensor check_one(const char* op, const char* name, const std::optional<at::Tensor>& t,
                     at::ScalarType dtype, int64_t batch, const at::Tensor& reference,
                     const char* reference_name) {
  if (!t.has_value()) return at::Tensor();
  check_device(op, name, *t, reference, reference_name);
  check_dtype(op, name, *t, {dtype});
  check_shape(op, name, *t, {batch}, "[B]");
  return t->contiguous();
}
}  // namespace

FilterArgs check_filter_args(const char* op, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p, int64_t batch,
                             const at::Tensor& reference, const char* reference_name) {
  FilterArgs f;
  f.top_k = check_one(op, "top_k", top_k, at::kInt, batch, reference, reference_name);
  f.top_p = check_one(op, "top_p", top_p, at::kFloat, batch, reference, reference_name);
  f.min_p = check_one(op, "min_p", min_p, at::kFloat, batch, reference, reference_name);
  if (value_checks_enabled(reference) && batch > 0) {
    if (f.top_k.defined()) check_values_in_range(op, "top_k", f.top_k, 0, INT32_MAX);
    if (f.top_p.defined()) check_positive_probabilities(op, "top_p", f.top_p);
    if (f.min_p.defined()) check_probabilities(op, "min_p", f.min_p);
  }
  return f;
}

}  // namespace dspark_ops
