// The emulator build's stand-in for C10_CUDA_CHECK: a failed runtime call or launch raises with
// what the emulator reported (a race, a barrier or shuffle misuse, a bad launch configuration).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "../../../runtime.h"

#define C10_CUDA_CHECK(expr)                                                              \
  do {                                                                                    \
    const cudaError_t dspark_sim_error = (expr);                                          \
    TORCH_CHECK(dspark_sim_error == cudaSuccess, "CUDA error (emulated): ",               \
                ::dspark_sim::error_string(dspark_sim_error), " from ", #expr, "\n",       \
                ::dspark_sim::last_error_message());                                      \
  } while (0)
