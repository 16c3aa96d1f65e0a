// Launchers of the scheduling family (nvcc, torch-free): one block of kernels/schedule.cuh's
// kernels, the sort's shared memory opted into per launch. schedule_kernel's launch is a
// programmatic dependent launch (kernels/launch.cuh): its launch overlaps the kernel before it on
// the stream (draft_confidence's), and it waits for that kernel before it reads anything.
#include "../kernels/schedule_launch.h"

#include "../kernels/launch.cuh"
#include "../kernels/schedule.cuh"

namespace dspark_ops::kernels {
namespace {

template <int Mode, bool SharedSort>
cudaError_t launch_schedule_mode(const ScheduleParams& p, cudaStream_t stream) {
  const size_t shared_bytes =
      SharedSort ? size_t(p.batch) * size_t(p.block) * sizeof(uint64_t) : 0;
  const cudaError_t opted_in =
      allow_dynamic_shared(schedule_kernel<Mode, SharedSort>, shared_bytes);
  if (opted_in != cudaSuccess) return opted_in;
  DSPARK_LAUNCH_DEPENDENT(1, kScheduleThreads, shared_bytes, stream,
                          schedule_kernel<Mode, SharedSort>)(p);
  return cudaGetLastError();
}

template <int Mode>
cudaError_t launch_schedule_mode(const ScheduleParams& p, cudaStream_t stream) {
  return p.global_keys ? launch_schedule_mode<Mode, false>(p, stream)
                       : launch_schedule_mode<Mode, true>(p, stream);
}

template <typename AnchorT, typename TokenT>
void launch_pack_typed(const void* anchor, const void* draft_tokens, int64_t token_stride_b,
                       int64_t token_stride_j, const int32_t* num_verify,
                       const int64_t* position, int batch, int block, int64_t* input_ids,
                       int64_t* positions, int32_t* cu_seqlens, cudaStream_t stream) {
  DSPARK_LAUNCH(1, kScheduleThreads, 0, stream, pack_verify_inputs_kernel<AnchorT, TokenT>)(
      static_cast<const AnchorT*>(anchor), static_cast<const TokenT*>(draft_tokens),
      token_stride_b, token_stride_j, num_verify, position, batch, block, input_ids, positions,
      cu_seqlens);
}

}  // namespace

cudaError_t launch_schedule(int mode, const ScheduleParams& p, cudaStream_t stream) {
  switch (mode) {
    case kModeSchedule: return launch_schedule_mode<kModeSchedule>(p, stream);
    case kModePlan: return launch_schedule_mode<kModePlan>(p, stream);
    default: return launch_schedule_mode<kModeAllocate>(p, stream);
  }
}

cudaError_t launch_pack_verify_inputs(const void* anchor, bool anchor_int32,
                                      const void* draft_tokens, bool tokens_int32,
                                      int64_t token_stride_b, int64_t token_stride_j,
                                      const int32_t* num_verify, const int64_t* position,
                                      int batch, int block, int64_t* input_ids,
                                      int64_t* positions, int32_t* cu_seqlens,
                                      cudaStream_t stream) {
  const auto launch = anchor_int32 ? (tokens_int32 ? &launch_pack_typed<int32_t, int32_t>
                                                   : &launch_pack_typed<int32_t, int64_t>)
                                   : (tokens_int32 ? &launch_pack_typed<int64_t, int32_t>
                                                   : &launch_pack_typed<int64_t, int64_t>);
  launch(anchor, draft_tokens, token_stride_b, token_stride_j, num_verify, position, batch, block,
         input_ids, positions, cu_seqlens, stream);
  return cudaGetLastError();
}

}  // namespace dspark_ops::kernels
