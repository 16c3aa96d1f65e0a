// The entries of the scheduling family, shared by the CPU and CUDA kernels of schedule_verify,
// plan_verify_budget, allocate_verify and pack_verify_inputs: argument and value checks, output
// allocation, then the backend's run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

#include "../common/backend.h"
#include "../common/checks.h"

namespace dspark_ops {

// schedule_verify, plan_verify_budget and allocate_verify: each takes confidence and two of the
// rest.
struct ScheduleArgs {
  at::Tensor confidence;  // float32 [B, G], any strides
  at::Tensor step_rate;   // undefined (allocate_verify), or float32 [M > B], any strides
  at::Tensor max_verify;  // undefined (no caps), or int32 [B], contiguous
  at::Tensor budget;      // undefined, or int32 [1] (allocate_verify)
};

struct PackArgs {
  at::Tensor anchor;        // int32/int64 [B], any strides
  at::Tensor draft_tokens;  // int32/int64 [B, G], any strides
  at::Tensor num_verify;    // int32 [B], contiguous
  at::Tensor position;      // int64 [B], contiguous
};

// Checks confidence [B, G] (and step_rate [M > B], max_verify [B] when given); returns max_verify
// made contiguous (undefined when not given). `op` names the calling op in messages.
at::Tensor check_schedule_args(const char* op, const at::Tensor& confidence,
                               const at::Tensor* step_rate,
                               const std::optional<at::Tensor>& max_verify);

namespace ops {

// num_verify int32 [B] on confidence's device.
template <typename Backend>
at::Tensor schedule_verify(const at::Tensor& confidence, const at::Tensor& step_rate,
                           const std::optional<at::Tensor>& max_verify) {
  const auto caps = check_schedule_args("schedule_verify", confidence, &step_rate, max_verify);
  const ScheduleArgs a{confidence, step_rate, caps, at::Tensor()};
  const typename Backend::Guard guard(confidence.device());
  auto num_verify = at::empty({confidence.size(0)}, confidence.options().dtype(at::kInt));
  Backend::run(a, num_verify);
  return num_verify;
}

// budget int32 [1] on confidence's device.
template <typename Backend>
at::Tensor plan_verify_budget(const at::Tensor& confidence, const at::Tensor& step_rate) {
  check_schedule_args("plan_verify_budget", confidence, &step_rate, std::nullopt);
  const ScheduleArgs a{confidence, step_rate, at::Tensor(), at::Tensor()};
  const typename Backend::Guard guard(confidence.device());
  auto budget = at::empty({1}, confidence.options().dtype(at::kInt));
  Backend::run(a, budget);
  return budget;
}

// num_verify int32 [B] on confidence's device.
template <typename Backend>
at::Tensor allocate_verify(const at::Tensor& confidence, const at::Tensor& budget,
                           const std::optional<at::Tensor>& max_verify) {
  constexpr const char* op = "allocate_verify";
  const auto caps = check_schedule_args(op, confidence, nullptr, max_verify);
  check_device(op, "budget", budget, confidence, "confidence");
  check_dtype(op, "budget", budget, {at::kInt});
  check_shape(op, "budget", budget, {1}, "[1]");
  if (value_checks_enabled(confidence)) {
    check_values_in_range(op, "budget", budget, confidence.size(0), INT32_MAX);
  }
  const ScheduleArgs a{confidence, at::Tensor(), caps, budget};
  const typename Backend::Guard guard(confidence.device());
  auto num_verify = at::empty({confidence.size(0)}, confidence.options().dtype(at::kInt));
  Backend::run(a, num_verify);
  return num_verify;
}

// input_ids int64 [B*(G+1)], positions int64 [B*(G+1)] and cu_seqlens int32 [B+1] on the inputs'
// device; entries past cu_seqlens[B] are left to the backend.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_verify_inputs(
    const at::Tensor& anchor, const at::Tensor& draft_tokens, const at::Tensor& num_verify,
    const at::Tensor& position) {
  constexpr const char* op = "pack_verify_inputs";
  check_dim(op, "draft_tokens", draft_tokens, {2}, "2-D [B, G]");
  check_dtype(op, "draft_tokens", draft_tokens, {at::kLong, at::kInt});
  const int64_t batch = draft_tokens.size(0), block = draft_tokens.size(1);
  TORCH_CHECK_VALUE(batch * (block + 1) <= INT32_MAX, op,
                    "(): B*(G+1) must fit int32 cu_seqlens, got B = ", batch, ", G = ", block);
  check_device(op, "anchor", anchor, draft_tokens, "draft_tokens");
  check_dtype(op, "anchor", anchor, {at::kLong, at::kInt});
  check_shape(op, "anchor", anchor, {batch}, "[B]");
  check_device(op, "num_verify", num_verify, draft_tokens, "draft_tokens");
  check_dtype(op, "num_verify", num_verify, {at::kInt});
  check_shape(op, "num_verify", num_verify, {batch}, "[B]");
  check_device(op, "position", position, draft_tokens, "draft_tokens");
  check_dtype(op, "position", position, {at::kLong});
  check_shape(op, "position", position, {batch}, "[B]");
  if (value_checks_enabled(draft_tokens) && batch > 0) {
    check_values_in_range(op, "num_verify", num_verify, 0, block);
    // As verify's: positions p0 .. p0 + G must not overflow.
    check_values_in_range(op, "position", position, 0, int64_t{1} << 62);
  }
  const typename Backend::Guard guard(draft_tokens.device());
  const PackArgs a{anchor, draft_tokens, num_verify.contiguous(), position.contiguous()};
  const auto options = draft_tokens.options().dtype(at::kLong);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs{
      at::empty({batch * (block + 1)}, options), at::empty({batch * (block + 1)}, options),
      at::empty({batch + 1}, options.dtype(at::kInt))};
  Backend::run(a, outputs);
  return outputs;
}

}  // namespace ops
}  // namespace dspark_ops
