#include "checks.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>

#include <algorithm>
#include <cmath>
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

namespace {
// The loop over a CPU tensor's data that lets valid arguments skip the ATen ops below (about 20
// per check, which dominate a small call). True when no element of `values` (at most 2-D, any
// strides; with `row_length`, only the first row_length[r] of row r) satisfies `bad`.
template <typename T, typename Bad>
bool all_valid(const at::Tensor& values, const Bad& bad, const at::Tensor& row_length) {
  const T* data = values.const_data_ptr<T>();
  const int64_t dim = values.dim();
  const int64_t rows = dim == 2 ? values.size(0) : 1, cols = dim == 0 ? 1 : values.size(-1);
  const int64_t row_stride = dim == 2 ? values.stride(0) : 0;
  const int64_t col_stride = dim == 0 ? 0 : values.stride(-1);
  const int32_t* lengths = row_length.defined() ? row_length.const_data_ptr<int32_t>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = lengths ? std::clamp<int64_t>(lengths[r * row_length.stride(0)], 0, cols)
                              : cols;
    for (int64_t c = 0; c < n; ++c) {
      if (bad(data[r * row_stride + c * col_stride])) return false;
    }
  }
  return true;
}

// True when the loop shows every value valid; false where it finds an invalid value or does not
// apply (not CPU, another dtype, more than 2-D): the ATen path then decides and words the error.
template <typename Bad>
bool known_valid(const at::Tensor& values, const Bad& bad,
                 const at::Tensor& row_length = at::Tensor()) {
  if (!values.device().is_cpu() || values.dim() > 2) return false;
  if (row_length.defined() &&
      (!row_length.device().is_cpu() || row_length.scalar_type() != at::kInt ||
       values.dim() != 2 || row_length.dim() != 1 || row_length.size(0) != values.size(0))) {
    return false;
  }
  switch (values.scalar_type()) {
    case at::kInt: return all_valid<int32_t>(values, bad, row_length);
    case at::kLong: return all_valid<int64_t>(values, bad, row_length);
    case at::kFloat: return all_valid<float>(values, bad, row_length);
    case at::kDouble: return all_valid<double>(values, bad, row_length);
    default: return false;
  }
}
}  // namespace

void check_values_in_range(const char* op, const char* name, const at::Tensor& values,
                           int64_t low, int64_t high, const at::Tensor& row_length) {
  if (known_valid(values, [&](auto v) { return v < low || v > high; }, row_length)) return;
  auto bad = (values < low).logical_or_(values > high);
  if (row_length.defined()) {
    const auto j = at::arange(values.size(1), values.options().dtype(at::kInt));
    bad.logical_and_(j.unsqueeze(0) < row_length.unsqueeze(1));
  }
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
  if (known_valid(values, [](auto v) { return !std::isfinite(v) || v < 0; })) return;
  check_float_values(op, name, values, values.isfinite().logical_not_().logical_or_(values < 0),
                     "finite and >= 0");
}

void check_finite_positive(const char* op, const char* name, const at::Tensor& values) {
  if (known_valid(values, [](auto v) { return !std::isfinite(v) || v <= 0; })) return;
  check_float_values(op, name, values, values.isfinite().logical_not_().logical_or_(values <= 0),
                     "finite and > 0");
}

void check_probabilities(const char* op, const char* name, const at::Tensor& values) {
  if (known_valid(values, [](auto v) { return !(v >= 0 && v <= 1); })) return;
  check_float_values(op, name, values,
                     (values >= 0).logical_and_(values <= 1).logical_not_(),
                     "probabilities in [0, 1]");
}

void check_positive_probabilities(const char* op, const char* name, const at::Tensor& values) {
  if (known_valid(values, [](auto v) { return !(v > 0 && v <= 1); })) return;
  check_float_values(op, name, values, (values > 0).logical_and_(values <= 1).logical_not_(),
                     "in (0, 1]");
}

}  // namespace dspark_ops
