// The launch interface of the loss family: what the ATen glue (cuda/loss_cuda.cpp, g++) calls
// and cuda/loss_launch.cu (nvcc, torch-free) defines; kernels/loss.cuh's kernel reads the params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

struct LossRowParams {
  int64_t vocab;
  float softcap;             // s, read by the kCap instantiation only
  float inv_softcap;         // 1 / s (soft_cap_inverse), likewise
  const int64_t* labels;     // [rows]
  const float* weights;      // [rows]
  const float* term_scale;   // [2]: ce and l1 coefficients per unit weight
  float* ce;                 // [rows]
  float* l1;                 // [rows], or nullptr without target logits
  bool grad, t_grad;
};

// z, bias and t: contiguous [rows, V] of `dtype`, an ElementType (common/element_type.h; t may be
// nullptr; bias is read with a cap, params.softcap > 0, and may be nullptr).
cudaError_t launch_dspark_loss(int dtype, void* z, void* bias, void* t, int64_t rows,
                               const LossRowParams& params, cudaStream_t stream);

}  // namespace dspark_ops::kernels
