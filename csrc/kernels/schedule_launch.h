// The launch interface of the scheduling family: what the ATen glue (cuda/schedule_cuda.cpp, g++)
// calls and cuda/schedule_launch.cu (nvcc, torch-free) defines; kernels/schedule.cuh's kernels
// read the params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

constexpr int kScheduleThreads = 1024;
constexpr int kMergeItems = 8;   // outputs per merge segment (four 16-byte stores)
// Segments a thread holds in registers on the shared path: 2 x 8 64-bit keys, 32 of the 64
// registers a thread of 1024 has.
constexpr int kMergeChunks = 2;
constexpr int kSharedKeys = kScheduleThreads * kMergeItems * kMergeChunks;  // 16384: 128 KB

enum ScheduleMode : int { kModeSchedule = 0, kModePlan = 1, kModeAllocate = 2 };

struct ScheduleParams {
  const float* confidence;  // [B, G], contiguous
  const float* step_rate;   // [M]
  int64_t capacity;         // M
  const int32_t* max_verify;  // [B] or null
  const int32_t* budget;      // [1], allocate only
  int32_t* num_verify;        // [B], schedule and allocate
  int32_t* budget_out;        // [1], plan
  uint64_t* global_keys;      // two buffers of B * G pair keys, schedule_spare_offset apart, unless schedule_sorts_in_shared, else null
  int batch, block;
};

// The opt-in limit per block covers static and dynamic shared memory together: leave room for
// schedule_kernel's __shared__ arrays (keep this sum in step with them).
constexpr int kScheduleStaticSharedMargin = 2048;

// Whether `pairs` keys are sorted in shared memory on a device whose opt-in limit per block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin) is `optin_bytes`; else the global workspace.
inline bool schedule_sorts_in_shared(int64_t pairs, int optin_bytes) {
  return pairs <= kSharedKeys &&
         pairs * int64_t{sizeof(uint64_t)} + kScheduleStaticSharedMargin <= int64_t{optin_bytes};
}

// Where the second buffer of the global workspace starts (in keys; a multiple of 8, so its
// segments stay 64-byte aligned).
inline int64_t schedule_spare_offset(int64_t pairs) { return (pairs + 7) / 8 * 8; }

// One scheduling kernel (`mode`: a ScheduleMode) on one block; p.global_keys null: the sort in
// dynamic shared memory.
cudaError_t launch_schedule(int mode, const ScheduleParams& p, cudaStream_t stream);

// pack_verify_inputs_kernel on one block; anchor and draft_tokens are int32 or int64 ids.
cudaError_t launch_pack_verify_inputs(const void* anchor, bool anchor_int32,
                                      const void* draft_tokens, bool tokens_int32,
                                      int64_t token_stride_b, int64_t token_stride_j,
                                      const int32_t* num_verify, const int64_t* position,
                                      int batch, int block, int64_t* input_ids,
                                      int64_t* positions, int32_t* cu_seqlens,
                                      cudaStream_t stream);

}  // namespace dspark_ops::kernels
