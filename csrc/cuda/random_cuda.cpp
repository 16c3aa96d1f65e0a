// CUDA backend of philox_uniform (g++): the launch (cuda/random_launch.cu) after the entry's
// checks, device guard and output (args/random_args.h).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/random_args.h"
#include "../common/cuda_utils.h"
#include "../kernels/random_launch.h"

namespace dspark_ops {
namespace {

struct PhiloxUniformCuda : CudaBackend {
  static void run(const PhiloxUniformArgs& a, at::Tensor& out) {
    C10_CUDA_CHECK(kernels::launch_philox_uniform(
        a.seed.const_data_ptr<int64_t>(), a.position.const_data_ptr<int64_t>(),
        static_cast<uint32_t>(a.purpose), a.count, out.numel(), out.data_ptr<float>(),
        c10::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) {
  m.impl("philox_uniform", &ops::philox_uniform<PhiloxUniformCuda>);
}

}  // namespace dspark_ops
