#include "schedule_args.h"

#include <ATen/core/Tensor.h>

#include "../common/checks.h"

namespace dspark_ops {

at::Tensor check_schedule_args(const char* op, const at::Tensor& confidence,
                               const at::Tensor* step_rate,
                               const std::optional<at::Tensor>& max_verify) {
  check_dim(op, "confidence", confidence, {2}, "2-D [B, G]");
  check_dtype(op, "confidence", confidence, {at::kFloat});
  const int64_t batch = confidence.size(0), block = confidence.size(1);
  // Fixed-point sums of the survivals stay exact in float64 up to 2^20 pairs.
  TORCH_CHECK_VALUE(batch <= (int64_t{1} << 20) && batch * block <= (int64_t{1} << 20), op,
                    "(): at most 2^20 requests and 2^20 (request, position) pairs, got B = ",
                    batch, ", G = ", block);
  const bool values = value_checks_enabled(confidence);
  if (values && confidence.numel() > 0) check_probabilities(op, "confidence", confidence);
  if (step_rate != nullptr) {
    check_device(op, "step_rate", *step_rate, confidence, "confidence");
    check_dim(op, "step_rate", *step_rate, {1}, "1-D [M]");
    check_dtype(op, "step_rate", *step_rate, {at::kFloat});
    TORCH_CHECK_VALUE(step_rate->size(0) > batch, op,
                      "(): 'step_rate' must have more than B = ", batch,
                      " entries (step_rate[n] is the rate of an n-token verify batch and every "
                      "request needs its anchor), got ", step_rate->size(0));
    if (values) check_finite_positive(op, "step_rate", *step_rate);
  }
  if (!max_verify.has_value()) return at::Tensor();
  check_device(op, "max_verify", *max_verify, confidence, "confidence");
  check_dtype(op, "max_verify", *max_verify, {at::kInt});
  check_shape(op, "max_verify", *max_verify, {batch}, "[B]");
  if (values && batch > 0) check_values_in_range(op, "max_verify", *max_verify, 0, block);
  return max_verify->contiguous();
}

}  // namespace dspark_ops
