// The entry of philox_uniform, shared by its CPU and CUDA kernels: argument checks, output
// allocation, then the backend's run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../common/backend.h"
#include "../common/checks.h"

namespace dspark_ops {

struct PhiloxUniformArgs {
  at::Tensor seed;      // int64 [N], contiguous
  at::Tensor position;  // int64 [N], contiguous
  int64_t purpose = 0, count = 0;
};

namespace ops {

// out float32 [N, count] on seed's device.
template <typename Backend>
at::Tensor philox_uniform(const at::Tensor& seed, const at::Tensor& position, int64_t purpose,
                          int64_t count) {
  constexpr const char* op = "philox_uniform";
  check_dim(op, "seed", seed, {1}, "1-D [N]");
  check_dtype(op, "seed", seed, {at::kLong});
  check_device(op, "position", position, seed, "seed");
  check_dtype(op, "position", position, {at::kLong});
  check_shape(op, "position", position, {seed.size(0)}, "[N]");
  // The streams the ops draw from; any other purpose is a stream no op uses.
  TORCH_CHECK_VALUE(purpose >= 0 && purpose <= 2, op,
                    "(): 'purpose' must lie in {0, 1, 2} (0 draft proposals, 1 acceptance tests, "
                    "2 resampling), got ", purpose);
  TORCH_CHECK_VALUE(count >= 0 && count <= (int64_t{1} << 32), op,
                    "(): 'count' must lie in [0, 2^32], got ", count);
  const typename Backend::Guard guard(seed.device());
  const PhiloxUniformArgs a{seed.contiguous(), position.contiguous(), purpose, count};
  auto out = at::empty({seed.size(0), count}, seed.options().dtype(at::kFloat));
  Backend::run(a, out);
  return out;
}

}  // namespace ops
}  // namespace dspark_ops
