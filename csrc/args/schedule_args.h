// The device-independent front end of the scheduling family: argument and value checks shared by
// the CPU and CUDA kernels of schedule_verify, plan_verify_budget, allocate_verify and
// pack_verify_inputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace dspark_ops {

// Checks confidence [B, G] (and step_rate [M > B], max_verify [B] when given); returns max_verify
// made contiguous (undefined when not given). `op` names the calling op in messages.
at::Tensor check_schedule_args(const char* op, const at::Tensor& confidence,
                               const at::Tensor* step_rate,
                               const std::optional<at::Tensor>& max_verify);

void check_budget(const at::Tensor& confidence, const at::Tensor& budget);

void check_pack_verify_args(const at::Tensor& anchor, const at::Tensor& draft_tokens,
                            const at::Tensor& num_verify, const at::Tensor& position);

}  // namespace dspark_ops
