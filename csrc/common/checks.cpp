#include "checks.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

namespace dspark_ops {

namespace {
bool debug_env() {
  static const bool enabled = [] {
    const char* v = std::getenv("DSPARK_OPS_DEBUG");
    return v != nullptr && std::strcmp(v, "0") != 0 && std::strcmp(v, "") != 0;
  }();
  return enabled;
}

std::string index_string(const at::Tensor& bad) {
  const auto where = bad.nonzero()[0].cpu();
  std::ostringstream out;
  out << "[";
  for (int64_t i = 0; i < where.numel(); ++i) out << (i ? ", " : "") << where[i].item<int64_t>();
  out << "]";
  return out.str();
}
}  // namespace

bool value_checks_enabled(const at::Tensor& t) {
#if defined(DSPARK_OPS_SIM)
  // The SIMT emulator (csrc/sim/) runs the CUDA entry points on CPU tensors: checked as CUDA
  // tensors are, so the kernels' own handling of out-of-range values is what runs.
  (void)t;
  return debug_env();
#else
  return !t.is_cuda() || debug_env();
#endif
}

void check_values_in_range(const char* op, const char* name, const at::Tensor& values,
                           int64_t low, int64_t high, const at::Tensor& selected) {
  auto bad = (values < low).logical_or_(values > high);
  if (selected.defined()) bad.logical_and_(selected);
  if (!bad.any().item<bool>()) return;
  const auto at_index = index_string(bad);
  const auto value = values.flatten()[bad.flatten().nonzero()[0][0]];
  TORCH_CHECK_VALUE(false, op, "(): '", name, "' values must lie in [", low, ", ", high, "], got ",
                    value.item<int64_t>(), " at index ", at_index);
}

namespace {
// Raises "<op>(): '<name>' must be <expectation>, got <value> at index [...]" for the first element
// where `bad` is true, if any.
void check_float_values(const char* op, const char* name, const at::Tensor& values,
                        const at::Tensor& bad, const char* expectation) {
  if (!bad.any().item<bool>()) return;
  const auto value = values.flatten()[bad.flatten().nonzero()[0][0]];
  TORCH_CHECK_VALUE(false, op, "(): '", name, "' must be ", expectation, ", got ",
                    value.item<double>(), " at index ", index_string(bad));
}
}  // namespace

void check_finite_non_negative(const char* op, const char* name, const at::Tensor& values) {
  check_float_values(op, name, values, values.isfinite().logical_not_().logical_or_(values < 0),
                     "finite and >= 0");
}

void check_finite_positive(const char* op, const char* name, const at::Tensor& values) {
  check_float_values(op, name, values, values.isfinite().logical_not_().logical_or_(values <= 0),
                     "finite and > 0");
}

void check_probabilities(const char* op, const char* name, const at::Tensor& values) {
  check_float_values(op, name, values,
                     (values >= 0).logical_and_(values <= 1).logical_not_(),
                     "probabilities in [0, 1]");
}

void check_positive_probabilities(const char* op, const char* name, const at::Tensor& values) {
  check_float_values(op, name, values, (values > 0).logical_and_(values <= 1).logical_not_(),
                     "in (0, 1]");
}

}  // namespace dspark_ops
