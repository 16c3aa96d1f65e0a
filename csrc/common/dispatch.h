// Dtype dispatch limited to the types the ops accept (logits: float32, bfloat16, float16; ids:
// int32, int64), so no kernel is instantiated for a type that argument checks already rule out.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace dspark_ops {

// Calls f(T{}) with T the C++ type of `dtype`.
template <typename F>
void dispatch_logit_type(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float: f(float{}); break;
    case c10::ScalarType::BFloat16: f(c10::BFloat16{}); break;
    case c10::ScalarType::Half: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "dspark_ops: unsupported logit dtype ", dtype);
  }
}

// Calls f(T{}) with T the C++ type of an id tensor's dtype (int32 or int64).
template <typename F>
void dispatch_index_type(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Int: f(int32_t{}); break;
    case c10::ScalarType::Long: f(int64_t{}); break;
    default: TORCH_CHECK(false, "dspark_ops: unsupported id dtype ", dtype);
  }
}

}  // namespace dspark_ops
