// CUDA entry points of the scheduling family (g++): checks, device guard, workspace, launch
// (cuda/schedule_launch.cu; the kernels live in kernels/schedule.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/schedule_args.h"
#include "../kernels/schedule_launch.h"
#include "../ops.h"

namespace dspark_ops {
namespace {

// Runs one scheduling kernel; `num_verify`/`budget_out` are whichever outputs the mode writes.
void run_schedule(int mode, const at::Tensor& confidence, const at::Tensor* step_rate,
                  const at::Tensor& max_verify, const at::Tensor* budget,
                  const at::Tensor& num_verify, const at::Tensor& budget_out) {
  const c10::cuda::CUDAGuard guard(confidence.device());
  const auto c = confidence.contiguous();
  const auto rates = step_rate ? step_rate->contiguous() : at::Tensor();
  kernels::ScheduleParams p{};
  p.confidence = c.const_data_ptr<float>();
  p.step_rate = rates.defined() ? rates.const_data_ptr<float>() : nullptr;
  p.capacity = rates.defined() ? rates.size(0) : 0;
  p.max_verify = max_verify.defined() ? max_verify.const_data_ptr<int32_t>() : nullptr;
  p.budget = budget ? budget->const_data_ptr<int32_t>() : nullptr;
  p.num_verify = num_verify.defined() ? num_verify.data_ptr<int32_t>() : nullptr;
  p.budget_out = budget_out.defined() ? budget_out.data_ptr<int32_t>() : nullptr;
  p.batch = static_cast<int>(c.size(0));
  p.block = static_cast<int>(c.size(1));
  const int64_t pairs = int64_t{p.batch} * p.block;
  // The opt-in limit differs between GPUs (99 KB on A10, L4, RTX; 163 KB on A100): a cheap host
  // query, made on every call because the current device may change.
  int shared_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        c.device().index()));
  at::Tensor workspace;
  if (!kernels::schedule_sorts_in_shared(pairs, shared_optin)) {  // two buffers of 32-bit keys
    workspace = at::empty({kernels::schedule_spare_offset(pairs)}, c.options().dtype(at::kLong));
    p.global_keys = reinterpret_cast<uint32_t*>(workspace.data_ptr<int64_t>());
  }
  const cudaError_t error =
      kernels::launch_schedule(mode, p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(error);
}

}  // namespace

at::Tensor schedule_verify_cuda(const at::Tensor& confidence, const at::Tensor& step_rate,
                                const std::optional<at::Tensor>& max_verify) {
  const auto caps = check_schedule_args("schedule_verify", confidence, &step_rate, max_verify);
  auto num_verify = at::empty({confidence.size(0)}, confidence.options().dtype(at::kInt));
  run_schedule(kernels::kModeSchedule, confidence, &step_rate, caps, nullptr, num_verify,
               at::Tensor());
  return num_verify;
}

at::Tensor plan_verify_budget_cuda(const at::Tensor& confidence, const at::Tensor& step_rate) {
  check_schedule_args("plan_verify_budget", confidence, &step_rate, std::nullopt);
  auto budget = at::empty({1}, confidence.options().dtype(at::kInt));
  run_schedule(kernels::kModePlan, confidence, &step_rate, at::Tensor(), nullptr, at::Tensor(),
               budget);
  return budget;
}

at::Tensor allocate_verify_cuda(const at::Tensor& confidence, const at::Tensor& budget,
                                const std::optional<at::Tensor>& max_verify) {
  const auto caps = check_schedule_args("allocate_verify", confidence, nullptr, max_verify);
  check_budget(confidence, budget);
  auto num_verify = at::empty({confidence.size(0)}, confidence.options().dtype(at::kInt));
  run_schedule(kernels::kModeAllocate, confidence, nullptr, caps, &budget, num_verify,
               at::Tensor());
  return num_verify;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_verify_inputs_cuda(
    const at::Tensor& anchor, const at::Tensor& draft_tokens, const at::Tensor& num_verify,
    const at::Tensor& position) {
  check_pack_verify_args(anchor, draft_tokens, num_verify, position);
  const c10::cuda::CUDAGuard guard(draft_tokens.device());
  const int64_t batch = draft_tokens.size(0), block = draft_tokens.size(1);
  const auto options = draft_tokens.options().dtype(at::kLong);
  auto input_ids = at::empty({batch * (block + 1)}, options);
  auto positions = at::empty({batch * (block + 1)}, options);
  auto cu_seqlens = at::empty({batch + 1}, options.dtype(at::kInt));
  const auto anchors = anchor.contiguous(), lengths = num_verify.contiguous();
  const auto starts = position.contiguous();
  C10_CUDA_CHECK(kernels::launch_pack_verify_inputs(
      anchors.const_data_ptr(), anchor.scalar_type() == at::kInt, draft_tokens.const_data_ptr(),
      draft_tokens.scalar_type() == at::kInt, draft_tokens.stride(0), draft_tokens.stride(1),
      lengths.const_data_ptr<int32_t>(), starts.const_data_ptr<int64_t>(),
      static_cast<int>(batch), static_cast<int>(block), input_ids.data_ptr<int64_t>(),
      positions.data_ptr<int64_t>(), cu_seqlens.data_ptr<int32_t>(),
      c10::cuda::getCurrentCUDAStream()));
  return {input_ids, positions, cu_seqlens};
}

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("schedule_verify", &schedule_verify_cuda);
  m.impl("plan_verify_budget", &plan_verify_budget_cuda);
  m.impl("allocate_verify", &allocate_verify_cuda);
  m.impl("pack_verify_inputs", &pack_verify_inputs_cuda);
}

}  // namespace dspark_ops
