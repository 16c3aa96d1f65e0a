// The warp-level tensor-core product the kernels share (torch-free): mma.sync m16n8k16 with
// 16-bit inputs (__half or __nv_bfloat16) and float32 accumulators, D = A B + C.
//
// Fragments of lane (g = lane / 4, t = lane % 4), each 32-bit register a pair of 16-bit values
// with the lower index in the low half:
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t+8..), a3 = (g + 8, 2t+8..)
//   B (16 x 8, "col": k contiguous per column): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16 x 8, float32): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g + 8, 2t), (g + 8, 2t+1)
// Needs sm_80 or newer; the host glue checks the device before launching.
//
// ldmatrix_x4 reads four 8 x 8 matrices of 16-bit values from shared memory into such fragments
// in one warp-wide instruction (PTX ISA "ldmatrix"): lane l gives the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes, 16-byte aligned), and register j of lane (g, t) receives
// matrix j's elements (g, 2t..2t+1), or with kTrans its elements (2t, g) and (2t+1, g): a
// row-major A tile's fragment, a B fragment from rows of n (K rows), or with kTrans one from rows
// of k (V rows).
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

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
#elif defined(DSPARK_OPS_SIM)
  // Each lane reads its own row (so the race and bounds checkers see every address), then the
  // rows are dealt out by shuffles as the instruction deals them.
  const auto* words = static_cast<const uint32_t*>(row);
  const uint32_t mine[4] = {words[0], words[1], words[2], words[3]};
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  for (int j = 0; j < 4; ++j) {
    uint32_t first[4], second[4];
    const int source = 8 * j + (kTrans ? 2 * t : g);
    for (int w = 0; w < 4; ++w) {
      first[w] = __shfl_sync(0xffffffffu, mine[w], source);
      second[w] = __shfl_sync(0xffffffffu, mine[w], kTrans ? source + 1 : source);
    }
    if constexpr (kTrans) {  // column g of rows 2t and 2t + 1: half g % 2 of word g / 2
      const int shift = 16 * (g & 1);
      r[j] = ((first[g >> 1] >> shift) & 0xffffu) | (((second[g >> 1] >> shift) & 0xffffu) << 16);
    } else {
      r[j] = first[t];
    }
  }
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0u;
  __trap();
#endif
}

}  // namespace dspark_ops::kernels
