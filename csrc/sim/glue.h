// Included first by each glue/<family>.cpp: the emulator's prelude, then the registration redirect
// that puts the family's CUDA entry points (TORCH_LIBRARY_IMPL(dspark_ops, CUDA, m) in
// cuda/<family>_cuda.cpp) into the test library torch.ops.dspark_ops_sim, for CPU tensors.
#pragma once

#include "prelude.h"

#include <torch/library.h>

#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) _TORCH_LIBRARY_IMPL(dspark_ops_sim, CPU, m, C10_UID)
