// CUDA kernels of the drafting family (docs/semantics.md §3.2, §3.3), torch-free: this file
// launches a block walk; the kernels live in one file per part, each with its own header:
//   draft_params.cuh      DraftParams (the input contract of markov_draft and rnn_draft) and the
//                         geometry the slot and head kernels share
//   draft_slot.cuh        draft_slot_kernel: one slot's logits and tokens (both ops)
//   draft_filter.cuh      draft_filter_kernel: the sampling filters of a slot (both ops)
//   draft_rnn_head.cuh    rnn_head_kernel, rnn_head_mma_kernel: the RNN head (rnn_draft)
//   draft_confidence.cuh  draft_confidence_kernel and ConfidenceParams (draft_confidence)
//
// Math: kernels/draft_math.h (shared with the CPU kernel). The ATen glue in cuda/draft_cuda.cpp
// checks shapes, dtypes and devices. Ids are not trusted: an id outside [0, V) embeds as a zero
// row and is never used as an address.
//
// A block walk (launch_draft) is G slots, each: for rnn_draft the RNN head, then the slot kernel
// (its bias input is W1[x_j] for markov_draft, tanh(o) for rnn_draft), then, where a request has
// sampling filters, the filter kernel; the next slot reads the tokens the previous one wrote, with
// no host work between.
//
// Float32 accumulation in an order of the hardware's choosing (explicit fmaf: the build's
// --fmad=false only keeps the sampling arithmetic unfused), so draft_logits match the float64
// reference to ~1e-6 of the bias scale (|base| + sum |w2| |input|; ~2^-17 for the RNN head's
// split activation) and tokens match except at float-rounding near-ties. A head sum that is not
// finite or reaches kExactHeadAbove (huge finite weights) is summed again in float64 by the lane
// that stores it (exact_head_logit, exact_preactivation; draft_confidence's rows likewise): a
// branch that ordinary inputs never take.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "draft_params.cuh"
#include "draft_slot.cuh"
#include "draft_filter.cuh"
#include "draft_rnn_head.cuh"
#include "draft_confidence.cuh"
#include "launch.cuh"

namespace dspark_ops::kernels {

// Launches the whole block walk on `stream`: G slot launches (plus G head launches for the RNN),
// every one after the first a programmatic dependent launch.
// `grid_tiles` blocks per group walk the p.num_tiles vocabulary tiles; the caller has called
// allow_draft_shared.
template <typename W, typename Base, bool kRnn>
cudaError_t launch_draft(DraftParams p, int grid_tiles, cudaStream_t stream) {
  const int groups = (p.batch + p.group_size - 1) / p.group_size;
  const int shared_bytes = draft_shared_bytes<W, kRnn>(p.group_size, p.rank, p.stages);
  for (int j = 0; j < p.block; ++j) {
    p.slot = j;
    // Every launch after the walk's first is a programmatic dependent launch: its blocks may start
    // (and the slot kernel's W2 ring fill) while the launch before still runs; each kernel waits
    // for that grid before it reads what the walk writes. The first waits for the stream as usual
    // (whatever ran before may have written the weights).
    if constexpr (kRnn && sizeof(W) == 2) {  // 16-bit weights: tensor cores
      const dim3 head_grid((3 * p.rank + 15) / 16, (p.batch + 7) / 8);
      if (j == 0) {
        DSPARK_LAUNCH(head_grid, kHeadMmaThreads, 0, stream, rnn_head_mma_kernel<W>)(p);
      } else {
        DSPARK_LAUNCH_DEPENDENT(head_grid, kHeadMmaThreads, 0, stream, rnn_head_mma_kernel<W>)(p);
      }
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    } else if constexpr (kRnn) {
      const dim3 head_grid((3 * p.rank + kDraftWarps * kHeadRowsPerWarp - 1) /
                               (kDraftWarps * kHeadRowsPerWarp),
                           (p.batch + kHeadRequests - 1) / kHeadRequests);
      if (j == 0) {
        DSPARK_LAUNCH(head_grid, kDraftThreads, 0, stream, rnn_head_kernel<W>)(p);
      } else {
        DSPARK_LAUNCH_DEPENDENT(head_grid, kDraftThreads, 0, stream, rnn_head_kernel<W>)(p);
      }
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    }
    if (!kRnn && j == 0) {
      DSPARK_LAUNCH(dim3(grid_tiles, groups), kDraftThreads, shared_bytes, stream,
                    draft_slot_kernel<W, Base, kRnn>)(p);
    } else {
      DSPARK_LAUNCH_DEPENDENT(dim3(grid_tiles, groups), kDraftThreads, shared_bytes, stream,
                              draft_slot_kernel<W, Base, kRnn>)(p);
    }
    cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    if (has_filters(p)) {
      error = p.logits_bf16 ? launch_draft_filter<__nv_bfloat16>(p, stream)
                            : launch_draft_filter<float>(p, stream);
      if (error != cudaSuccess) return error;
    }
  }
  return cudaSuccess;
}

}  // namespace dspark_ops::kernels
