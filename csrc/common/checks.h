// Argument checks with messages that name the op, the argument, what was expected and what was
// given. Shape, dtype and device checks run on every device; value checks (which read tensor
// contents and so cost a device sync on CUDA) run on CPU always and on CUDA when DSPARK_OPS_DEBUG=1.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>

namespace dspark_ops {

inline std::string dtype_list(std::initializer_list<at::ScalarType> dtypes) {
  std::ostringstream out;
  bool first = true;
  for (auto dtype : dtypes) {
    out << (first ? "" : " or ") << c10::toString(dtype);
    first = false;
  }
  return out.str();
}

// A required tensor passed as None reaches the entry points undefined; every check below calls
// this first, so the message names the argument rather than the undefined tensor's accessor.
inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), op, "(): '", name, "' must be a tensor, got None");
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> dtypes) {
  check_defined(op, name, t);
  bool ok = false;
  for (auto dtype : dtypes) ok = ok || t.scalar_type() == dtype;
  TORCH_CHECK_TYPE(ok, op, "(): '", name, "' must have dtype ", dtype_list(dtypes), ", got ",
                   t.scalar_type());
}

// `expected` spells the shape symbolically (e.g. "[B, G]") for the message.
inline void check_shape(const char* op, const char* name, const at::Tensor& t,
                        at::IntArrayRef shape, const char* expected) {
  check_defined(op, name, t);
  TORCH_CHECK_VALUE(t.sizes() == shape, op, "(): '", name, "' must have shape ", expected, " = ",
                    shape, ", got ", t.sizes());
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t,
                      std::initializer_list<int64_t> dims, const char* expected) {
  check_defined(op, name, t);
  bool ok = false;
  for (auto dim : dims) ok = ok || t.dim() == dim;
  TORCH_CHECK_VALUE(ok, op, "(): '", name, "' must be ", expected, ", got a ", t.dim(),
                    "-D tensor of shape ", t.sizes());
}

inline void check_device(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& reference, const char* reference_name) {
  check_defined(op, reference_name, reference);
  check_defined(op, name, t);
  TORCH_CHECK_VALUE(t.device() == reference.device(), op, "(): '", name, "' must be on ",
                    reference.device(), " like '", reference_name, "', got ", t.device());
}

// An output written in place: no element may share memory with another (an expanded view such
// as cache[:1].expand(N, ...) would make every request write the same rows, the last one winning).
inline void check_no_internal_overlap(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, "(): '", name,
                    "' is written in place, so its elements must not share memory (it is an "
                    "expanded or self-overlapping view), got shape ", t.sizes(), " and strides ",
                    t.strides());
}

// An output written in place must not share memory with another argument of the call.
inline void check_no_overlap(const char* op, const char* name, const at::Tensor& t,
                             const char* other_name, const at::Tensor& other) {
  const auto status = at::get_overlap_status(t, other);
  TORCH_CHECK_VALUE(status != at::MemOverlapStatus::Full &&
                        status != at::MemOverlapStatus::Partial,
                    op, "(): '", name, "' is written in place and must not share memory with '",
                    other_name, "'");
}

// On CPU the value checks below first loop over the data and return at once when every value is
// valid; the ATen ops that find and word the offender run only when one is not (or on CUDA).

// True where value checks run: always on CPU, on CUDA only with DSPARK_OPS_DEBUG=1 (the SIMT
// emulator's CPU tensors count as CUDA tensors).
bool value_checks_enabled(const at::Tensor& t);

// Raises unless every element of `values` lies in [low, high]; the message names the first
// offender. With `row_length` (int32 [R], each in [0, C], for `values` [R, C]) only the first
// row_length[r] elements of each row r are checked.
void check_values_in_range(const char* op, const char* name, const at::Tensor& values,
                           int64_t low, int64_t high, const at::Tensor& row_length = at::Tensor());

// Raise unless every element is finite and >= 0 / finite and > 0 / in [0, 1] (NaN fails all).
void check_finite_non_negative(const char* op, const char* name, const at::Tensor& values);
void check_finite_positive(const char* op, const char* name, const at::Tensor& values);
void check_probabilities(const char* op, const char* name, const at::Tensor& values);
// Raises unless every element lies in (0, 1] (NaN fails).
void check_positive_probabilities(const char* op, const char* name, const at::Tensor& values);

}  // namespace dspark_ops
