// CUDA entry point of philox_uniform (g++): checks, device guard, output, launch
// (cuda/random_launch.cu).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../args/random_args.h"
#include "../kernels/random_launch.h"
#include "../ops.h"

namespace dspark_ops {

at::Tensor philox_uniform_cuda(const at::Tensor& seed, const at::Tensor& position,
                               int64_t purpose, int64_t count) {
  check_philox_uniform_args(seed, position, purpose, count);
  const c10::cuda::CUDAGuard guard(seed.device());
  const auto seeds = seed.contiguous(), positions = position.contiguous();
  auto out = at::empty({seed.size(0), count}, seed.options().dtype(at::kFloat));
  C10_CUDA_CHECK(kernels::launch_philox_uniform(
      seeds.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(),
      static_cast<uint32_t>(purpose), count, out.numel(), out.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream()));
  return out;
}

TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) { m.impl("philox_uniform", &philox_uniform_cuda); }

}  // namespace dspark_ops
