// CUDA kernel of dspark_loss's vocabulary pass (torch-free): one block per row of a chunk whose
// draft logits z (and target logits t) the glue has just produced with cuBLAS
// (args/loss_args.cpp). Math: kernels/loss_math.h.
//
// Three passes over the row, each thread striding over the vocabulary (16 bytes of z and of t per
// iteration where rows are 16-byte multiples):
//   1. online logsumexps of z and t (max and rescaled sum per thread, merged over the block);
//   2. p = exp(z - lse_z), q = exp(t - lse_t): |p - q|, <s,p>, <s,q> summed over the block;
//   3. (training) d loss / d z written over z, and d loss / d t over t when the LM head trains.
// p and q are recomputed in pass 3 by the same expression as in pass 2, so s = sign(p - q) is the
// same in both. With a logit soft cap (the kCap instantiation) z and t hold the LM head's products
// and a third row the Markov bias: every pass caps as it reads (z = s tanh(W h / s) + W2 u,
// t = s tanh(W g / s), a tanh per element and pass, as the exponentials are recomputed) and pass 3
// writes the logits' gradients times the cap's slope over z and t, the logits' own over the bias
// (kernels/loss_math.h). The uncapped instantiation reads no bias and computes no tanh.
// The pass is small beside the chunk's products (the products are O(d) flops per logit, the pass
// O(1); the tanhs make the capped pass issue-bound rather than memory-bound, at about twice the
// uncapped pass's instructions per element); a label outside [0, V) is never used as an index (its
// row's ce is NaN and no logit gets the label term). Reductions run in a fixed order: a row's
// results do not depend on the rest of the chunk.
//
// Launch (cuda/loss_launch.cu): grid = rows of the chunk, kLossThreads threads, static shared
// memory only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "convert.cuh"
#include "loss_launch.h"
#include "loss_math.h"
#include "reduce.cuh"

namespace dspark_ops {

// Block reductions of the two records (kernels/reduce.cuh finds these by argument lookup).
__device__ __forceinline__ LogSumExp shfl_down(LogSumExp s, int offset) {
  return LogSumExp{__shfl_down_sync(kernels::kFullMask, s.max, offset),
                   __shfl_down_sync(kernels::kFullMask, s.sum, offset)};
}

__device__ __forceinline__ L1Sums shfl_down(L1Sums s, int offset) {
  return L1Sums{__shfl_down_sync(kernels::kFullMask, s.l1, offset),
                __shfl_down_sync(kernels::kFullMask, s.sp, offset),
                __shfl_down_sync(kernels::kFullMask, s.sq, offset)};
}

namespace kernels {

constexpr int kLossThreads = 256;


// Calls f(v, z[v], m[v], t[v]) (m[v] = 0 without m or without kBias, t[v] = 0 without t) for the
// elements v of the row this thread owns. Rows whose byte length is a multiple of 16 (so every row
// of the chunk starts 16-byte aligned) are read 16 bytes per tensor and iteration, a thread's
// kLossVec elements at a time: a scalar 16-bit load per element keeps too few bytes in flight for
// the HBM's latency. Other rows are read an element at a time. Without kBias m is never read.
template <bool kBias, typename T, typename F>
__device__ __forceinline__ void for_each_element(const T* z, const T* m, const T* t,
                                                 int64_t vocab, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  const bool has_m = kBias && m != nullptr;
  if ((vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0) {
    for (int64_t base = threadIdx.x * int64_t{kVec}; base < vocab;
         base += int64_t{blockDim.x} * kVec) {
      union Pack {
        uint4 raw;
        T x[kVec];
      } zp, mp, tp;
      zp.raw = *reinterpret_cast<const uint4*>(z + base);  // no __ldg: pass 3 writes z
      if (has_m) mp.raw = *reinterpret_cast<const uint4*>(m + base);
      if (t != nullptr) tp.raw = *reinterpret_cast<const uint4*>(t + base);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        f(base + e, to_float(zp.x[e]), has_m ? to_float(mp.x[e]) : 0.f,
          t != nullptr ? to_float(tp.x[e]) : 0.f);
      }
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      f(v, to_float(z[v]), has_m ? to_float(m[v]) : 0.f, t != nullptr ? to_float(t[v]) : 0.f);
    }
  }
}

// The logits from what the rows hold: without kCap the logits themselves; with it the products,
// capped, and the draft's bias added after the cap.
template <bool kCap>
__device__ __forceinline__ float draft_logit(float zv, float mv, float cap, float inv_cap) {
  if constexpr (kCap) {
    return soft_cap(zv, cap, inv_cap).value + mv;
  } else {
    return zv;
  }
}

template <bool kCap>
__device__ __forceinline__ float target_logit(float tv, float cap, float inv_cap) {
  if constexpr (kCap) {
    return soft_cap(tv, cap, inv_cap).value;
  } else {
    return tv;
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(kLossThreads)
    dspark_loss_kernel(T* __restrict__ z_rows, T* __restrict__ m_rows, T* __restrict__ t_rows,
                       LossRowParams p) {
  __shared__ LogSumExp lse_scratch[32];
  __shared__ L1Sums sum_scratch[32];
  const int64_t row = blockIdx.x, vocab = p.vocab;
  T* z = z_rows + row * vocab;
  T* m = kCap && m_rows != nullptr ? m_rows + row * vocab : nullptr;
  T* t = t_rows != nullptr ? t_rows + row * vocab : nullptr;
  const float cap = kCap ? p.softcap : 0.f, inv_cap = kCap ? p.inv_softcap : 0.f;
  const int64_t y = p.labels[row];
  const bool label_ok = y >= 0 && y < vocab;
  // Read before the block's first barrier, so before pass 3 overwrites the row.
  const float z_y = threadIdx.x == 0 && label_ok
                        ? draft_logit<kCap>(to_float(z[y]), m != nullptr ? to_float(m[y]) : 0.f,
                                            cap, inv_cap)
                        : 0.f;

  LogSumExp sz{-INFINITY, 0.f}, st{-INFINITY, 0.f};
  for_each_element<kCap>(z, m, t, vocab, [&](int64_t, float zv, float mv, float tv) {
    sz = lse_add(sz, draft_logit<kCap>(zv, mv, cap, inv_cap));
    if (t != nullptr) st = lse_add(st, target_logit<kCap>(tv, cap, inv_cap));
  });
  const auto merge_lse = [](LogSumExp a, LogSumExp b) { return lse_merge(a, b); };
  const LogSumExp empty{-INFINITY, 0.f};
  const float lse_z = lse_value(block_reduce(sz, merge_lse, empty, lse_scratch));
  const float lse_t = t != nullptr ? lse_value(block_reduce(st, merge_lse, empty, lse_scratch)) : 0.f;
  if (threadIdx.x == 0) p.ce[row] = label_ok ? lse_z - z_y : NAN;

  L1Sums sums{0.f, 0.f, 0.f};
  if (t != nullptr) {
    for_each_element<kCap>(z, m, t, vocab, [&](int64_t, float zv, float mv, float tv) {
      const float pv = loss_exp(draft_logit<kCap>(zv, mv, cap, inv_cap) - lse_z);
      const float qv = loss_exp(target_logit<kCap>(tv, cap, inv_cap) - lse_t);
      const float s = l1_sign(pv, qv);
      sums = l1_merge(sums, L1Sums{fabsf(pv - qv), s * pv, s * qv});
    });
    const auto merge_sums = [](L1Sums a, L1Sums b) { return l1_merge(a, b); };
    sums = block_reduce(sums, merge_sums, L1Sums{0.f, 0.f, 0.f}, sum_scratch);
    if (threadIdx.x == 0) p.l1[row] = sums.l1;
  }
  if (!p.grad) return;

  // Each thread rewrites only the elements it read itself, after every thread's reads of the
  // passes above (the block reductions' barriers order them).
  const float w = p.weights[row];
  const float a = w * p.term_scale[0], b = t != nullptr ? w * p.term_scale[1] : 0.f;
  for_each_element<kCap>(z, m, t, vocab, [&](int64_t v, float zv, float mv, float tv) {
    if constexpr (kCap) {
      const SoftCapped<float> cz = soft_cap(zv, cap, inv_cap);
      const float pv = loss_exp(cz.value + mv - lse_z);
      float s = 0.f, qv = 0.f;
      SoftCapped<float> ct{0.f, 0.f};
      if (t != nullptr) {
        ct = soft_cap(tv, cap, inv_cap);
        qv = loss_exp(ct.value - lse_t);
        s = l1_sign(pv, qv);
      }
      const float gz = draft_logit_grad(pv, s, v == y, a, b, sums.sp);
      if (m != nullptr) *(m + v) = from_float<T>(gz);
      *(z + v) = from_float<T>(gz * cz.slope);
      if (p.t_grad) *(t + v) = from_float<T>(target_logit_grad(qv, s, b, sums.sq) * ct.slope);
    } else {
      const float pv = loss_exp(zv - lse_z);
      float s = 0.f, qv = 0.f;
      if (t != nullptr) {
        qv = loss_exp(tv - lse_t);
        s = l1_sign(pv, qv);
      }
      *(z + v) = from_float<T>(draft_logit_grad(pv, s, v == y, a, b, sums.sp));
      if (p.t_grad) *(t + v) = from_float<T>(target_logit_grad(qv, s, b, sums.sq));
    }
  });
}

}  // namespace kernels
}  // namespace dspark_ops
