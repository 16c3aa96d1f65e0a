// CUDA backends of the scheduling family (g++): after the entries' checks, device guard and
// outputs (args/schedule_args.h), the workspace and launch (cuda/schedule_launch.cu; the kernels
// live in kernels/schedule.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/schedule_args.h"
#include "../common/cuda_utils.h"
#include "../kernels/schedule_launch.h"

namespace dspark_ops {
namespace {

// Runs one scheduling kernel; `num_verify`/`budget_out` are whichever outputs the mode writes.
void run_schedule(int mode, const ScheduleArgs& a, const at::Tensor& num_verify,
                  const at::Tensor& budget_out) {
  const auto c = a.confidence.contiguous();
  const auto rates = a.step_rate.defined() ? a.step_rate.contiguous() : at::Tensor();
  kernels::ScheduleParams p{};
  p.confidence = c.const_data_ptr<float>();
  p.step_rate = rates.defined() ? rates.const_data_ptr<float>() : nullptr;
  p.capacity = rates.defined() ? rates.size(0) : 0;
  p.max_verify = a.max_verify.defined() ? a.max_verify.const_data_ptr<int32_t>() : nullptr;
  p.budget = a.budget.defined() ? a.budget.const_data_ptr<int32_t>() : nullptr;
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
  if (!kernels::schedule_sorts_in_shared(pairs, shared_optin)) {  // two buffers of 64-bit keys
    workspace =
        at::empty({2 * kernels::schedule_spare_offset(pairs)}, c.options().dtype(at::kLong));
    p.global_keys = reinterpret_cast<uint64_t*>(workspace.data_ptr<int64_t>());
  }
  const cudaError_t error =
      kernels::launch_schedule(mode, p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(error);
}

struct ScheduleVerifyCuda : CudaBackend {
  static void run(const ScheduleArgs& a, at::Tensor& num_verify) {
    run_schedule(kernels::kModeSchedule, a, num_verify, at::Tensor());
  }
};

struct PlanVerifyBudgetCuda : CudaBackend {
  static void run(const ScheduleArgs& a, at::Tensor& budget) {
    run_schedule(kernels::kModePlan, a, at::Tensor(), budget);
  }
};

struct AllocateVerifyCuda : CudaBackend {
  static void run(const ScheduleArgs& a, at::Tensor& num_verify) {
    run_schedule(kernels::kModeAllocate, a, num_verify, at::Tensor());
  }
};

struct PackVerifyInputsCuda : CudaBackend {
  static void run(const PackArgs& a, std::tuple<at::Tensor, at::Tensor, at::Tensor>& outputs) {
    auto& [input_ids, positions, cu_seqlens] = outputs;
    const at::Tensor& draft_tokens = a.draft_tokens;
    const int64_t batch = draft_tokens.size(0), block = draft_tokens.size(1);
    const auto anchors = a.anchor.contiguous();
    C10_CUDA_CHECK(kernels::launch_pack_verify_inputs(
        anchors.const_data_ptr(), a.anchor.scalar_type() == at::kInt,
        draft_tokens.const_data_ptr(), draft_tokens.scalar_type() == at::kInt,
        draft_tokens.stride(0), draft_tokens.stride(1), a.num_verify.const_data_ptr<int32_t>(),
        a.position.const_data_ptr<int64_t>(), static_cast<int>(batch), static_cast<int>(block),
        input_ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
        cu_seqlens.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("schedule_verify", &ops::schedule_verify<ScheduleVerifyCuda>);
  m.impl("plan_verify_budget", &ops::plan_verify_budget<PlanVerifyBudgetCuda>);
  m.impl("allocate_verify", &ops::allocate_verify<AllocateVerifyCuda>);
  m.impl("pack_verify_inputs", &ops::pack_verify_inputs<PackVerifyInputsCuda>);
}

}  // namespace dspark_ops
