// CUDA backends of the drafting family (g++): after the entries' checks, device guard and outputs
// (args/draft_args.h), the group plan, workspace and launch (cuda/draft_launch.cu; the kernels
// live in kernels/draft.cuh and the draft_*.cuh files it includes).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../args/draft_args.h"
#include "../common/cuda_utils.h"
#include "../common/stream_counters.h"
#include "../kernels/draft_launch.h"

namespace dspark_ops {
namespace {

bool rows_aligned(const at::Tensor& w) {
  const int64_t per16 = 16 / static_cast<int64_t>(w.element_size());
  return reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 16 == 0 && w.stride(0) % per16 == 0;
}

kernels::DraftParams draft_params(const DraftArgs& a, at::Tensor& tokens, at::Tensor& logits) {
  kernels::DraftParams p{};
  p.w1 = a.w1.const_data_ptr();
  p.w1_stride = a.w1.stride(0);
  p.w1_aligned = rows_aligned(a.w1);
  p.w2 = a.w2.const_data_ptr();
  p.w2_stride = a.w2.stride(0);
  p.w2_aligned = rows_aligned(a.w2);
  p.base = a.base.const_data_ptr();
  p.base_stride_b = a.base.stride(0);
  p.base_stride_j = a.base.stride(1);
  p.anchor = a.anchor.const_data_ptr();
  p.anchor_int32 = a.anchor.scalar_type() == at::kInt;
  p.temperature = a.temperature.const_data_ptr<float>();
  p.seed = a.seed.const_data_ptr<int64_t>();
  p.position = a.position.const_data_ptr<int64_t>();
  const auto& f = a.filters;
  p.top_k = f.top_k_data();
  p.top_p = f.top_p_data();
  p.min_p = f.min_p_data();
  p.tokens = tokens.data_ptr<int64_t>();
  p.logits_bf16 = a.logits_bf16;
  p.draft_logits = logits.data_ptr();
  p.batch = static_cast<int>(a.batch);
  p.block = static_cast<int>(a.block);
  p.rank = static_cast<int>(a.rank);
  p.vocab = a.vocab;
  p.num_tiles = static_cast<int>((a.vocab + kernels::kTileRows - 1) / kernels::kTileRows);
  return p;
}

// Requests per block: up to 64, halved until the bias inputs and the smallest W2 ring (16-bit
// weights) fit the device's shared-memory budget (kernels::draft_input_budget); the ring then
// takes the most stages that still fit (kernels::draft_w2_stages).
int group_size(int w_type, bool rnn, int64_t batch, int64_t rank, int budget) {
  int size = kernels::kMaxGroup;
  while (size > 8 &&
         kernels::draft_shared_bytes(w_type, rnn, size, static_cast<int>(rank),
                                     w_type == kernels::kElementFloat ? 0
                                                                      : kernels::kMinW2Stages) >
             budget) {
    size /= 2;
  }
  // No wider than the batch (rounded up to whole MMA column tiles of 8).
  return static_cast<int>(std::min<int64_t>(size, std::max<int64_t>(8, (batch + 7) / 8 * 8)));
}

void run_draft(bool rnn, const DraftArgs& a, at::Tensor& tokens, at::Tensor& logits,
               kernels::DraftParams p) {
  const int w_type = element_type(a.w1.scalar_type());
  const int base_type = element_type(a.base.scalar_type());
  const char* op = rnn ? "rnn_draft" : "markov_draft";
  const int device = device_index(a.base);
  TORCH_CHECK_VALUE(w_type == kernels::kElementFloat || compute_capability_major(device) >= 8, op,
                    "(): 16-bit 'w1'/'w2' need tensor cores of compute capability 8.0 or newer "
                    "on CUDA; pass float32 weights on this GPU");
  // The shared memory of the blocks per SM the slot kernel is compiled for.
  const int budget = kernels::draft_input_budget(
      device, kernels::slot_blocks_per_sm(w_type != kernels::kElementFloat));
  p.group_size = group_size(w_type, rnn, a.batch, a.rank, budget);
  p.stages = kernels::draft_w2_stages(w_type, rnn, p.group_size, p.rank, budget);
  const int64_t groups = (a.batch + p.group_size - 1) / p.group_size;
  TORCH_CHECK_VALUE(groups <= 65535 && (a.batch + kernels::kHeadRequests - 1) /
                                           kernels::kHeadRequests <= 65535,
                    op, "(): at most ", 65535 * kernels::kHeadRequests,
                    " requests per call on CUDA, got ", a.batch);
  // Counters: packed per-request maxima [G, B] and arrivals [G, groups], zero at the start and
  // the end of every call (common/stream_counters.h): no fill.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t best_bytes = a.block * a.batch * 8;
  const at::Tensor counters =
      StreamCounters::get(a.base, best_bytes + a.block * groups * 4, stream);
  p.best = reinterpret_cast<unsigned long long*>(counters.data_ptr<uint8_t>());
  p.arrivals = reinterpret_cast<int32_t*>(counters.data_ptr<uint8_t>() + best_bytes);
  at::Tensor rnn_workspace;
  if (rnn) {  // no fill: each value is written before it is read (s_0 = 0 is not read)
    rnn_workspace = at::empty({a.batch * 4 * a.rank}, a.base.options().dtype(at::kFloat));
    p.state = rnn_workspace.data_ptr<float>();
    p.preactivation = p.state + a.batch * a.rank;
  }
  // The base logits' dtype is a template parameter of the slot kernel: no per-element type switch
  // in the epilogue.
  const int shared_bytes = kernels::draft_shared_bytes(w_type, rnn, p.group_size, p.rank, p.stages);
  C10_CUDA_CHECK(kernels::allow_draft_shared(w_type, base_type, rnn, shared_bytes));
  const int64_t resident =
      int64_t{kernels::draft_blocks_per_sm(w_type, base_type, rnn, device, shared_bytes)} *
      multiprocessor_count(device);
  const int grid_tiles = static_cast<int>(std::clamp<int64_t>(resident / groups, 1, p.num_tiles));
  const cudaError_t error = kernels::launch_draft(w_type, base_type, rnn, p, grid_tiles, stream);
  if (error != cudaSuccess) StreamCounters::forget(a.base, stream);
  C10_CUDA_CHECK(error);
}

struct MarkovDraftCuda : CudaBackend {
  static void run(const DraftArgs& a, DraftResult& outputs) {
    auto& [tokens, draft_logits] = outputs;
    if (a.batch == 0 || a.block == 0) return;
    run_draft(/*rnn=*/false, a, tokens, draft_logits, draft_params(a, tokens, draft_logits));
  }
};

struct RnnDraftCuda : CudaBackend {
  static void run(const DraftArgs& a, DraftResult& outputs) {
    auto& [tokens, draft_logits] = outputs;
    if (a.batch == 0 || a.block == 0) return;
    auto p = draft_params(a, tokens, draft_logits);
    p.hidden = a.hidden.const_data_ptr();
    p.hidden_type = element_type(a.hidden.scalar_type());
    p.hidden_stride_b = a.hidden.stride(0);
    p.hidden_stride_j = a.hidden.stride(1);
    p.hidden_size = static_cast<int>(a.hidden_size);
    p.joint_weight = a.joint_weight.const_data_ptr();
    p.joint_stride = a.joint_weight.stride(0);
    p.joint_bias = a.joint_bias.const_data_ptr();
    run_draft(/*rnn=*/true, a, tokens, draft_logits, p);
  }
};

struct DraftConfidenceCuda : CudaBackend {
  // The kernel stages the whole weight vector in shared memory.
  static void check(const ConfidenceArgs& a) {
    const int64_t bytes = (a.hidden_size + a.rank) * a.weight.element_size();
    TORCH_CHECK_VALUE(bytes <= kernels::kConfidenceMaxWeightBytes,
                      "draft_confidence(): on CUDA 'weight' [d + r] must hold at most ",
                      kernels::kConfidenceMaxWeightBytes, " bytes, got d + r = ",
                      a.hidden_size + a.rank, " of ", a.weight.scalar_type());
  }
  static void run(const ConfidenceArgs& a, at::Tensor& out);
};

void DraftConfidenceCuda::run(const ConfidenceArgs& a, at::Tensor& out) {
  kernels::ConfidenceParams p{};
  p.hidden = a.hidden.const_data_ptr();
  p.hidden_type = element_type(a.hidden.scalar_type());
  p.hidden_stride_b = a.hidden.stride(0);
  p.hidden_stride_j = a.hidden.stride(1);
  p.prev_tokens = a.prev_tokens.const_data_ptr();
  p.ids_int32 = a.prev_tokens.scalar_type() == at::kInt;
  p.id_stride_b = a.prev_tokens.stride(0);
  p.id_stride_j = a.prev_tokens.stride(1);
  p.w1 = a.w1.const_data_ptr();
  p.w1_stride = a.w1.stride(0);
  p.weight = a.weight.const_data_ptr();
  p.weight_type = element_type(a.weight.scalar_type());
  p.bias = a.bias.defined() ? a.bias.const_data_ptr() : nullptr;
  p.bias_type = a.bias.defined() ? element_type(a.bias.scalar_type()) : kernels::kElementFloat;
  p.calib_temperature =
      a.calib_temperature.defined() ? a.calib_temperature.const_data_ptr<float>() : nullptr;
  p.out = out.data_ptr<float>();
  p.batch = static_cast<int>(a.batch);
  p.block = static_cast<int>(a.block);
  p.rank = static_cast<int>(a.rank);
  p.hidden_size = static_cast<int>(a.hidden_size);
  p.vocab = a.vocab;
  C10_CUDA_CHECK(kernels::launch_draft_confidence(element_type(a.w1.scalar_type()), p,
                                                   c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("markov_draft", &ops::markov_draft<MarkovDraftCuda>);
  m.impl("rnn_draft", &ops::rnn_draft<RnnDraftCuda>);
  m.impl("draft_confidence", &ops::draft_confidence<DraftConfidenceCuda>);
}

}  // namespace dspark_ops
