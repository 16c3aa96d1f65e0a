// The sampling filters (top-k / top-p / min-p) of markov_draft and rnn_draft (docs/semantics.md
// §3.2), torch-free: after each slot launch, draft_filter_kernel gives every filtered request one
// block of 1024 threads that computes the filters over its stored row (filter.cuh), writes -inf
// into draft_logits where they drop a token and redraws the token over the kept ones with the
// same keys, before the next slot reads it. Requests without filters return at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "convert.cuh"
#include "draft_math.h"
#include "draft_params.cuh"
#include "filter.cuh"
#include "launch.cuh"
#include "sampling_math.h"

namespace dspark_ops::kernels {

// The sampling filters of slot p.slot (see the file header): block b filters request b's row in
// place and redraws its token. Dynamic shared memory: FilterShared. Logit: the stored rows' type
// (float, or __nv_bfloat16 with p.logits_bf16: the values the slot kernel sampled from).
constexpr int kFilterThreads = 1024;  // one block per request: as many row loads in flight as fit
static_assert(kFilterThreads <= kFilterCandidates, "each thread's maximum has a candidate slot");

template <typename Logit>
__global__ void __launch_bounds__(kFilterThreads) draft_filter_kernel(const DraftParams p) {
  const int b = blockIdx.x;
  const FilterSpec spec = make_filter_spec(p.top_k, p.top_p, p.min_p, b, p.vocab);
  if (!spec.active()) return;
  const float t = p.temperature[b];
  const bool greedy = is_greedy(t);
  const float inv_t = greedy ? 1.f : 1.f / t;
  DSPARK_EXTERN_SHARED(unsigned char, filter_shared_raw);
  FilterShared& sh = *reinterpret_cast<FilterShared*>(filter_shared_raw);
  __shared__ unsigned long long candidate_scratch[32];
  Logit* z = static_cast<Logit*>(p.draft_logits) + (int64_t{b} * p.block + p.slot) * p.vocab;
  // 16-byte loads where the row starts on a 16-byte boundary (x is a multiple of 8); plain loads,
  // as the last pass writes the row.
  const bool vector_row = (reinterpret_cast<uintptr_t>(z) & 15) == 0;
  const auto load8 = [&](int64_t x, float (&v)[kFilterValues]) {
    Logit raw[kFilterValues];
    if (vector_row && x + kFilterValues <= p.vocab) {
      constexpr int kChunks = kFilterValues * sizeof(Logit) / 16;
      uint4 chunk[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) chunk[c] = reinterpret_cast<const uint4*>(z + x)[c];
      memcpy(raw, chunk, sizeof(raw));
    } else {
#pragma unroll
      for (int k = 0; k < kFilterValues; ++k) {
        raw[k] = x + k < p.vocab ? z[x + k] : from_float<Logit>(-INFINITY);
      }
    }
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) {
      const float value = to_float(raw[k]);
      v[k] = isfinite(value) ? value : -INFINITY;
    }
  };

  double row_max = -INFINITY;
  for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < p.vocab;
       x += int64_t{blockDim.x} * kFilterValues) {
    float v[kFilterValues];
    load8(x, v);
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) row_max = fmax(row_max, double{v[k]});
  }
  const auto larger = [](double a, double c) { return fmax(a, c); };
  // Each thread's maximum (its load8 elements'): the parts top-k's floor is taken from.
  sh.candidate_key[threadIdx.x] = logit_key(static_cast<float>(row_max));
  if (threadIdx.x == 0) sh.candidates = blockDim.x;
  const float m = static_cast<float>(block_reduce(row_max, larger, double{-INFINITY}, sh.sum_scratch));
  if (m == -INFINITY) {
    // No finite logit: the slot kernel's token 0 stands; the row is stored as every filtered
    // row is, non-finite values as -inf (as the CPU kernel and the reference store it).
    for (int64_t x = threadIdx.x; x < p.vocab; x += blockDim.x) {
      z[x] = from_float<Logit>(-INFINITY);
    }
    return;
  }
  const FilterResult f = block_filter_row(load8, p.vocab, m, inv_t, spec, sh, blockDim.x);

  const int64_t position = offset_position(p.position[b], 1 + p.slot);
  unsigned long long best = 0;
  for (int64_t x = int64_t{threadIdx.x} * kFilterValues; x < p.vocab;
       x += int64_t{blockDim.x} * kFilterValues) {
    float v[kFilterValues], u[kFilterValues];
    load8(x, v);
#pragma unroll
    for (int g = 0; g < kFilterValues / 4; ++g) {
      const Philox4 block =
          philox_block(p.seed[b], position, kPurposeDraft, static_cast<uint32_t>((x >> 2) + g));
#pragma unroll
      for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
    }
#pragma unroll
    for (int k = 0; k < kFilterValues; ++k) {
      if (x + k >= p.vocab) break;
      if (v[k] == -INFINITY || !filter_keeps(f, v[k], softmax_weight(v[k], m, inv_t))) {
        z[x + k] = from_float<Logit>(-INFINITY);  // dropped (and non-finite values, as stored)
        continue;
      }
      const float key = greedy ? v[k] : v[k] * inv_t - logf(-log1pf(-u[k]));
      if (!(key > -INFINITY)) continue;
      const unsigned long long packed = pack_candidate(key, static_cast<int32_t>(x + k));
      best = packed > best ? packed : best;
    }
  }
  const auto higher = [](unsigned long long a, unsigned long long c) { return a > c ? a : c; };
  best = block_reduce(best, higher, 0ull, candidate_scratch);
  if (threadIdx.x == 0) {
    const int32_t id = candidate_id(best);
    p.tokens[int64_t{b} * p.block + p.slot] = id < 0 ? 0 : id;
  }
}

// One draft_filter_kernel launch over rows of type Logit.
template <typename Logit>
cudaError_t launch_draft_filter(const DraftParams& p, cudaStream_t stream) {
  DSPARK_LAUNCH(dim3(p.batch), kFilterThreads, sizeof(FilterShared), stream,
                draft_filter_kernel<Logit>)(p);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
