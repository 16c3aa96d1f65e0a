// torch.ops.dspark_ops_sim: the library's schemas (every op's CUDA entry point, on CPU tensors,
// registered by glue/<family>.cpp) and the emulator's controls.
#include "prelude.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "../common/stream_counters.h"
#include "../kernels/attention.cuh"
#include "../kernels/draft.cuh"
#include "../kernels/loss.cuh"
#include "../kernels/random.cuh"
#include "../kernels/schedule.cuh"
#include "../kernels/verify.cuh"
#include "../schemas.h"

namespace dspark_sim {

at::Tensor selftest(const std::string& name, const at::Tensor& x, int64_t n);
at::Tensor mma(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool f16);

namespace {

// Every __launch_bounds__ of the kernel sources (generated from them by build.py).
[[maybe_unused]] const bool g_bounds = [] {
  using namespace dspark_ops::kernels;
#define DSPARK_SIM_BOUNDS(name, bound) register_launch_bounds(name, bound);
#include "launch_bounds.inc"
#undef DSPARK_SIM_BOUNDS
  return true;
}();

void select_device(const std::string& name) {
  TORCH_CHECK_VALUE(set_device(name), "dspark_sim: unknown emulated device '", name,
                    "' (h200, a100, l4)");
}

std::string device_name() { return device().name; }
void seed(int64_t value) { set_seed(static_cast<uint64_t>(value)); }
// A planted fault may leave the kernels' counters set (common/stream_counters.h): the calls after
// a plant changes start from a zeroed buffer, as after a failed launch.
void plant(const std::string& value) {
  set_plant(value);
  dspark_ops::StreamCounters::forget(at::empty({0}), c10::cuda::getCurrentCUDAStream());
}
std::string log() { return launch_log(); }
void clear_log() { clear_launch_log(); }

}  // namespace
}  // namespace dspark_sim

TORCH_LIBRARY(dspark_ops_sim, m) {
  for (const char* schema : dspark_ops::kSchemas) m.def(schema);
  m.def("set_device(str name) -> ()", &dspark_sim::select_device);
  m.def("device_name() -> str", &dspark_sim::device_name);
  m.def("set_seed(int seed) -> ()", &dspark_sim::seed);
  m.def("set_plant(str plant) -> ()", &dspark_sim::plant);
  m.def("launch_log() -> str", &dspark_sim::log);
  m.def("clear_launch_log() -> ()", &dspark_sim::clear_log);
  m.def("selftest(str name, Tensor x, int n) -> Tensor", &dspark_sim::selftest);
  m.def("mma(Tensor a, Tensor b, Tensor c, bool f16) -> Tensor", &dspark_sim::mma);
}
