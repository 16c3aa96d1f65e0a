// CUDA entry point of dspark_loss (g++): the row-chunk loop of args/loss_args.cpp (its products
// through ATen, so cuBLAS, on the current stream) with the vocabulary pass of kernels/loss.cuh,
// launched by cuda/loss_launch.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/loss_args.h"
#include "../common/cuda_utils.h"
#include "../kernels/loss_launch.h"
#include "../kernels/loss_math.h"
#include "../ops.h"

namespace dspark_ops {
namespace {

void loss_rows_cuda(const LossChunk& c) {
  const int code = element_type(c.z.scalar_type());
  kernels::LossRowParams params{c.z.size(1),
                                static_cast<float>(c.softcap),
                                c.softcap > 0 ? soft_cap_inverse<float>(c.softcap) : 0.f,
                                c.labels.const_data_ptr<int64_t>(),
                                c.weights.const_data_ptr<float>(),
                                c.term_scale.const_data_ptr<float>(),
                                c.ce.data_ptr<float>(),
                                c.t.defined() ? c.l1.data_ptr<float>() : nullptr,
                                c.grad,
                                c.t_grad};
  C10_CUDA_CHECK(kernels::launch_dspark_loss(code, c.z.data_ptr(),
                                             c.bias.defined() ? c.bias.data_ptr() : nullptr,
                                             c.t.defined() ? c.t.data_ptr() : nullptr,
                                             c.z.size(0), params,
                                             c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

LossResult dspark_loss_cuda(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                            const at::Tensor& labels, const at::Tensor& weights,
                            const at::Tensor& term_scale,
                            const std::optional<at::Tensor>& target_hidden,
                            const std::optional<at::Tensor>& markov_latent,
                            const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                            bool lm_head_grad, int64_t chunk_rows,
                            std::optional<double> logit_softcap) {
  TORCH_CHECK_TYPE(hidden.scalar_type() != at::kDouble,
                   "dspark_loss(): float64 'hidden' runs on CPU only; on CUDA use float32, "
                   "bfloat16 or float16");
  const auto args = check_dspark_loss_args(hidden, lm_head_weight, labels, weights, term_scale,
                                           target_hidden, markov_latent, markov_w2, compute_grad,
                                           lm_head_grad, chunk_rows, logit_softcap,
                                           kLossScratchBytesCuda);
  const c10::cuda::CUDAGuard guard(hidden.device());
  return run_dspark_loss(args, &loss_rows_cuda);
}

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) { m.impl("dspark_loss", &dspark_loss_cuda); }

}  // namespace dspark_ops
