// Dtype dispatch limited to the logit types the ops accept (float32, bfloat16, float16), so no
// kernel is instantiated for a type that argument checks already rule out.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

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

}  // namespace dspark_ops
