// CUDA backend of verify (g++): after the entry's checks, device guard and outputs
// (args/verify_args.h), the workspace, grid plan and launch (cuda/verify_launch.cu; the kernels
// live in kernels/verify.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../args/verify_args.h"
#include "../common/cuda_utils.h"
#include "../common/stream_counters.h"
#include "../kernels/verify_launch.h"

namespace dspark_ops {

namespace {

struct VerifyCuda : CudaBackend {
  static constexpr bool kKeepPaddedTarget = true;  // padded targets are read in place, no copy
  // The most workspace a call's top-k candidate lists may take (kernels/verify.cuh: 1 KB per
  // chunk of a row; 9.4 MB at B 64, G 8, V 151,936): a larger batch keeps the chunks' floors
  // only, and each decided row gathers its candidates from the row (the same outputs).
  static constexpr int64_t kScratchBytes = int64_t{64} << 20;
  static void run(const VerifyArgs& a, VerifyResult& outputs);
};

void VerifyCuda::run(const VerifyArgs& a, VerifyResult& outputs) {
  auto& [tokens, num_accepted, valid, logprobs] = outputs;
  TORCH_CHECK_VALUE(a.batch <= 65535, "verify(): at most 65535 requests per call on CUDA, got ",
                    a.batch);
  if (a.batch == 0) return;

  kernels::VerifyParams p{};
  p.target = a.target.const_data_ptr();
  if (a.target.dim() == 3) {  // padded, requests unevenly spaced: no copy
    p.target_row_stride = a.target.stride(1);
    p.target_group_rows = a.target.size(1);
    p.target_group_stride = a.target.stride(0);
  } else {
    p.target_row_stride = a.target.stride(0);
  }
  p.target_rows = a.rows;
  if (a.draft_logits.defined()) {
    p.draft = a.draft_logits.const_data_ptr();
    p.draft_stride_b = a.draft_logits.stride(0);
    p.draft_stride_j = a.draft_logits.stride(1);
  }
  p.draft_tokens = a.draft_tokens.const_data_ptr();
  p.token_stride_b = a.draft_tokens.stride(0);
  p.token_stride_j = a.draft_tokens.stride(1);
  p.tokens_int32 = a.draft_tokens.scalar_type() == at::kInt;
  p.num_draft = a.num_draft.const_data_ptr<int32_t>();
  p.temperature = a.temperature.const_data_ptr<float>();
  p.draft_temperature =
      a.draft_temperature.defined() ? a.draft_temperature.const_data_ptr<float>() : nullptr;
  p.seed = a.seed.const_data_ptr<int64_t>();
  p.position = a.position.const_data_ptr<int64_t>();
  p.target_start = a.target_start.defined() ? a.target_start.const_data_ptr<int32_t>() : nullptr;
  const auto& f = a.filters;
  p.top_k = f.top_k_data();
  p.top_p = f.top_p_data();
  p.min_p = f.min_p_data();
  if (a.allowed_token_mask.defined()) {
    p.allowed_token_mask = a.allowed_token_mask.const_data_ptr<int32_t>();
    p.mask_words = a.allowed_token_mask.size(1);
  }
  p.logprobs = a.return_logprobs ? logprobs.data_ptr<float>() : nullptr;
  p.tokens = tokens.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int32_t>();
  p.valid = valid.data_ptr<bool>();
  p.batch = static_cast<int>(a.batch);
  p.block = static_cast<int>(a.block);
  p.vocab = a.vocab;

  const int64_t chunks = kernels::verify_num_chunks(a.vocab);
  p.chunk = kernels::verify_chunk(a.vocab);
  p.num_chunks = static_cast<int>(chunks);

  const int64_t rows = a.batch * (a.block + 1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Zero at the start and the end of every call (common/stream_counters.h): no fill.
  const at::Tensor counters =
      StreamCounters::get(a.target, (rows + 2 * a.batch) * int64_t{sizeof(int32_t)}, stream);
  p.row_arrivals = reinterpret_cast<int32_t*>(counters.data_ptr<uint8_t>());
  p.reject_marks = p.row_arrivals + rows;
  p.race_arrivals = p.reject_marks + a.batch;
  p.keep_candidates = kernels::verify_candidate_bytes(p) <= kScratchBytes;
  auto workspace = at::empty({kernels::verify_workspace_bytes(p)},
                            a.target.options().dtype(at::kByte));
  kernels::bind_verify_workspace(p, workspace.data_ptr());

  const int draft_type = a.draft_logits.defined() ? element_type(a.draft_logits.scalar_type())
                                                  : kernels::kElementFloat;
  const int target_type = element_type(a.target.scalar_type());
  const int device = device_index(a.target);
  TORCH_CHECK_VALUE(compute_capability_major(device) >= 8,
                    "verify(): the CUDA kernels need compute capability 8.0 or newer (they "
                    "stream rows with cp.async)");
  kernels::plan_verify_rings(target_type, draft_type, p, device);
  const cudaError_t error =
      kernels::launch_verify(target_type, draft_type, p, stream);
  if (error != cudaSuccess) StreamCounters::forget(a.target, stream);
  C10_CUDA_CHECK(error);
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) { m.impl("verify", &ops::verify<VerifyCuda>); }

}  // namespace dspark_ops
