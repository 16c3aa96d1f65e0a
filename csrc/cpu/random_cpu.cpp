// CPU kernel of philox_uniform: the random numbers every sampling op draws (common/philox.h).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../args/random_args.h"
#include "../common/philox.h"

namespace dspark_ops {
namespace {

struct PhiloxUniformCpu : CpuBackend {
  static void run(const PhiloxUniformArgs& a, at::Tensor& out) {
    const int64_t count = a.count;
    const auto purpose = static_cast<uint32_t>(a.purpose);
    const int64_t* s = a.seed.const_data_ptr<int64_t>();
    const int64_t* p = a.position.const_data_ptr<int64_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, out.numel(), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i / count, element = i % count;
        o[i] = philox_uniform(s[row], p[row], purpose, static_cast<uint32_t>(element));
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("philox_uniform", &ops::philox_uniform<PhiloxUniformCpu>);
}

}  // namespace dspark_ops
