// The element types of the CUDA kernels' tensors (float32, bfloat16, float16) and their
// conversions to and from float32, one set for every kernel family (torch-free).
//
// Widening (to_float, load_float) is exact. Narrowing (from_float) rounds to nearest, ties to
// even: cvt.rn, which __float2bfloat16 / __float2half also compile to, so every kernel stores
// 16-bit values rounded as torch's .to(dtype) does. The CPU kernels' twin is cpu/convert.h (row
// conversions with at::vec, which this torch-free folder cannot include).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/element_type.h"

namespace dspark_ops::kernels {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

// Element i of a tensor whose type is the runtime code `type` (an ElementType), as float32.
__device__ __forceinline__ float load_float(const void* p, int type, int64_t i) {
  switch (type) {
    case kElementBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kElementHalf: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Calls f(T{}) with T the CUDA type of an ElementType code: the launchers' type dispatch.
template <typename F>
auto with_element_type(int type, F&& f) {
  switch (type) {
    case kElementBFloat16: return f(__nv_bfloat16{});
    case kElementHalf: return f(__half{});
    default: return f(float{});
  }
}

}  // namespace dspark_ops::kernels
