// Launcher of the loss family (nvcc, torch-free): kernels/loss.cuh's vocabulary pass, one block
// per row, instantiated per element type and for the soft cap.
#include "../kernels/loss_launch.h"

#include "../kernels/launch.cuh"
#include "../kernels/loss.cuh"

namespace dspark_ops::kernels {
namespace {

template <typename T>
void launch_dspark_loss_typed(void* z, void* bias, void* t, unsigned grid,
                              const LossRowParams& params, cudaStream_t stream) {
  if (params.softcap > 0.f) {
    DSPARK_LAUNCH(grid, kLossThreads, 0, stream, dspark_loss_kernel<T, true>)(
        static_cast<T*>(z), static_cast<T*>(bias), static_cast<T*>(t), params);
  } else {
    DSPARK_LAUNCH(grid, kLossThreads, 0, stream, dspark_loss_kernel<T, false>)(
        static_cast<T*>(z), nullptr, static_cast<T*>(t), params);
  }
}

}  // namespace

cudaError_t launch_dspark_loss(int dtype, void* z, void* bias, void* t, int64_t rows,
                               const LossRowParams& params, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(rows);
  switch (dtype) {
    case kElementBFloat16:
      launch_dspark_loss_typed<__nv_bfloat16>(z, bias, t, grid, params, stream);
      break;
    case kElementHalf:
      launch_dspark_loss_typed<__half>(z, bias, t, grid, params, stream);
      break;
    default:
      launch_dspark_loss_typed<float>(z, bias, t, grid, params, stream);
  }
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
