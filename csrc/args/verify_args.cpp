#include "verify_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../common/checks.h"

namespace dspark_ops {

at::Tensor check_verify_per_request(const char* name, const at::Tensor& t, at::ScalarType dtype,
                                    const at::Tensor& reference, int64_t batch) {
  constexpr const char* kOp = "verify";
  check_device(kOp, name, t, reference, "target_logits");
  check_dtype(kOp, name, t, {dtype});
  check_shape(kOp, name, t, {batch}, "[B]");
  return t.contiguous();
}

VerifyResult allocate_verify_outputs(const VerifyArgs& a) {
  const auto options = a.target.options();
  return {at::empty({a.batch, a.block + 1}, options.dtype(at::kLong)),
          at::empty({a.batch}, options.dtype(at::kInt)),
          at::empty({a.batch}, options.dtype(at::kBool)),
          at::empty({a.batch, a.return_logprobs ? a.block + 1 : 0}, options.dtype(at::kFloat))};
}

}  // namespace dspark_ops
