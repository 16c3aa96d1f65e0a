// The warp-level tensor-core product the kernels share (torch-free): mma.sync m16n8k16 with
// 16-bit inputs (__half or __nv_bfloat16) and float32 accumulators, D = A B + C.
//
// Fragments of lane (g = lane / 4, t = lane % 4), each 32-bit register a pair of 16-bit values
// with the lower index in the low half:
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t+8..), a3 = (g + 8, 2t+8..)
//   B (16 x 8, "col": k contiguous per column): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16 x 8, float32): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g + 8, 2t), (g + 8, 2t+1)
// Needs sm_80 or newer; the host glue checks the device before launching.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace dspark_ops::kernels {

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "16-bit inputs");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#elif defined(DSPARK_OPS_SIM)
  ::dspark_sim::mma_m16n8k16(std::is_same_v<T, __half>, c, a0, a1, a2, a3, b0, b1);  // csrc/sim/
#else
  __trap();
#endif
}

}  // namespace dspark_ops::kernels
