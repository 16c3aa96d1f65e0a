// What an op's entry (args/<family>_args.h: checks, allocation, then Backend::run) asks of a
// backend besides run(): the device guard it holds from allocation to the end of the call, and,
// for some ops, a check of what the backend cannot run. The CPU kernels' backends derive from
// CpuBackend; the CUDA glue's from CudaBackend (common/cuda_utils.h). Traits that concern one op
// are members of that op's backends.
#pragma once

#include <c10/core/Device.h>

namespace dspark_ops {

struct CpuBackend {
  struct Guard {  // CPU tensors need no current device
    explicit Guard(c10::Device) {}
  };
  template <typename Args>
  static void check(const Args&) {}  // the CPU kernels take whatever the entry's checks pass
};

}  // namespace dspark_ops
