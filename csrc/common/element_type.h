// A CUDA kernel tensor's element type as a runtime code, for arguments whose type is not a template
// parameter of the kernel, and for the launchers' type dispatch: the ATen glue maps at::ScalarType
// to it (common/cuda_utils.h element_type); kernels/convert.cuh reads and writes the types.
#pragma once

namespace dspark_ops::kernels {

enum ElementType : int { kElementFloat = 0, kElementBFloat16 = 1, kElementHalf = 2 };

}  // namespace dspark_ops::kernels
