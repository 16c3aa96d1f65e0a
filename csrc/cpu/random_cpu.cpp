// CPU kernel of philox_uniform: the random numbers every sampling op draws (common/philox.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../args/random_args.h"
#include "../common/philox.h"
#include "../ops.h"

namespace dspark_ops {

at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& position, int64_t purpose,
                              int64_t count) {
  check_philox_uniform_args(seed, position, purpose, count);
  const auto seeds = seed.contiguous(), positions = position.contiguous();
  auto out = at::empty({seed.size(0), count}, seed.options().dtype(at::kFloat));
  const int64_t* s = seeds.const_data_ptr<int64_t>();
  const int64_t* p = positions.const_data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / count, element = i % count;
      o[i] = philox_uniform(s[row], p[row], static_cast<uint32_t>(purpose),
                            static_cast<uint32_t>(element));
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) { m.impl("philox_uniform", &philox_uniform_cpu); }

}  // namespace dspark_ops
