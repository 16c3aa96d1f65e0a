// CUDA backend of dspark_loss (g++): the row-chunk loop of args/loss_args.cpp (its products
// through ATen, so cuBLAS, on the current stream) runs the vocabulary pass of kernels/loss.cuh,
// launched by cuda/loss_launch.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/loss_args.h"
#include "../common/cuda_utils.h"
#include "../kernels/loss_launch.h"
#include "../kernels/loss_math.h"

namespace dspark_ops {
namespace {

struct DsparkLossCuda : CudaBackend {
  static constexpr bool kTakesFloat64 = false;
  static constexpr int64_t kScratchBytes = kLossScratchBytesCuda;
  // The vocabulary pass of one chunk of rows.
  static void run(const LossChunk& c) {
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
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("dspark_loss", &ops::dspark_loss<DsparkLossCuda>);
}

}  // namespace dspark_ops
