// The launch interface of the drafting family: what the ATen glue (cuda/draft_cuda.cpp, g++)
// calls and cuda/draft_launch.cu (nvcc, torch-free) defines: the kernels' arguments (DraftParams
// for markov_draft and rnn_draft, ConfidenceParams for draft_confidence), the geometry the glue
// plans with, and the launchers. Element types are ElementType codes (common/element_type.h);
// `rnn` picks rnn_draft's instantiations.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

constexpr int kDraftThreads = 256;
constexpr int kDraftWarps = kDraftThreads / 32;

constexpr int kTileRows = 16 * kDraftWarps;  // vocabulary rows per block tile: 16 per warp
constexpr int kMaxGroup = 64;                // requests per block: 8 MMA column tiles of 8
// Requests per block of rnn_head_kernel (kernels/draft_rnn_head.cuh).
constexpr int kHeadRequests = 8;
// Stages of the slot kernel's W2 ring (16-bit weights, kernels/draft_slot.cuh): a power of two,
// the most the shared-memory budget leaves beside the group's inputs, at least two.
constexpr int kMaxW2Stages = 8;
constexpr int kMinW2Stages = 2;
// Blocks per SM the slot kernel's registers are capped for (__launch_bounds__): three with 16-bit
// weights (80 registers a thread; a tile's products and epilogue calls then sweep its column
// tiles kSweepTiles at a time, and the group is sized to a third of the SM's shared memory), two
// with float32 weights (the CUDA-core path, whose float32 inputs take twice the shared memory).
constexpr int kSweepTiles = 4;
constexpr int slot_blocks_per_sm(bool weights_16bit) {
  return weights_16bit ? 3 : 2;
}

struct DraftParams {
  const void* w1;  // [V, r] of type W, unit stride along r
  int64_t w1_stride;
  bool w1_aligned;  // rows start 16-byte aligned: vector gathers
  const void* w2;  // [V, r] of type W, unit stride along r
  int64_t w2_stride;
  bool w2_aligned;  // rows start 16-byte aligned: vector fragment loads
  const void* base;  // [B, G, V] of the kernel's Base type, unit stride along V
  int64_t base_stride_b, base_stride_j;
  const void* anchor;  // int32 or int64 [B]
  bool anchor_int32;
  const float* temperature;
  const int64_t* seed;
  const int64_t* position;
  const int32_t* top_k;  // [B] or null (off), as the three filters
  const float* top_p;
  const float* min_p;
  int64_t* tokens;     // [B, G]
  void* draft_logits;  // [B, G, V]: float32, or bfloat16 when logits_bf16
  bool logits_bf16;    // z rounded to bfloat16 before it is stored and sampled
  // rnn_draft only.
  const void* hidden;  // [B, G, d], unit stride along d, ElementType hidden_type
  int hidden_type;
  int64_t hidden_stride_b, hidden_stride_j;
  const void* joint_weight;  // [3r, 2r + d] of type W, unit stride along columns
  int64_t joint_stride;
  const void* joint_bias;  // [3r] of type W
  float* preactivation;    // [B, 3r] workspace
  float* state;            // [B, r] workspace: s_0 = 0 is never read, so it needs no fill
  // Counters: zero when a call starts, and returned to zero by the last block of each group.
  unsigned long long* best;  // [G, B] packed candidates
  int32_t* arrivals;         // [G, groups]
  int batch, block, rank, hidden_size, group_size, num_tiles, slot;
  int stages;  // W2 ring stages of the slot kernel (16-bit weights; 0 for float32)
  int64_t vocab;
};

struct ConfidenceParams {
  const void* hidden;  // [B, G, d], unit stride along d
  int hidden_type;
  int64_t hidden_stride_b, hidden_stride_j;
  const void* prev_tokens;  // int32/int64 [B, G]
  bool ids_int32;
  int64_t id_stride_b, id_stride_j;
  const void* w1;  // [V, r] of type W
  int64_t w1_stride;
  const void* weight;  // [d + r]
  int weight_type;
  const void* bias;  // one element or null
  int bias_type;
  const float* calib_temperature;  // [G] or null
  float* out;                      // [B, G]
  int batch, block, rank, hidden_size;
  int64_t vocab;
};

// Dynamic shared memory of a slot block holding `group_size` requests' bias inputs and, for
// 16-bit weights, a W2 ring of `stages` chunks.
int draft_shared_bytes(int w_type, bool rnn, int group_size, int rank, int stages);

// The W2 ring's stages beside `group_size` requests' inputs: the most (up to kMaxW2Stages) whose
// shared memory fits `budget`, at least kMinW2Stages; 0 for float32 weights (no ring).
int draft_w2_stages(int w_type, bool rnn, int group_size, int rank, int budget);

// Dynamic shared memory a slot block may take for its group's inputs and W2 ring on `device` when
// `blocks` share an SM (host queries, once per device and count): the SM's shared memory split
// `blocks` ways, less kSlotSharedReserve, and no more than one block may opt in to; never below
// the 44 KB of kFallbackInputBytes (on an SM of 100 KB two blocks then fit, not three).
int draft_input_budget(int device, int blocks);

// Lets draft_slot_kernel take `shared_bytes` of dynamic shared memory (past 48 KB only with this
// opt-in; it is per device, so it is asked on every call that takes more).
cudaError_t allow_draft_shared(int w_type, int base_type, bool rnn, int shared_bytes);

// Blocks of draft_slot_kernel resident per SM on `device` (a host query, cached per
// instantiation, device and shared-memory size; the caller has called allow_draft_shared).
int draft_blocks_per_sm(int w_type, int base_type, bool rnn, int device, int shared_bytes);

// The whole block walk on `stream`: G slot launches (plus G head launches for the RNN), with
// `grid_tiles` blocks per group over the p.num_tiles vocabulary tiles.
cudaError_t launch_draft(int w_type, int base_type, bool rnn, const DraftParams& p,
                         int grid_tiles, cudaStream_t stream);

// draft_confidence_kernel stages the weight vector [d + r] whole in shared memory: at most this
// many bytes (cuda/draft_cuda.cpp refuses a larger one; within every sm_80+ device's opt-in limit).
constexpr int kConfidenceMaxWeightBytes = 96 * 1024;

// draft_confidence_kernel, one warp per (request, slot) row, instantiated per W1 type (w_type) and
// weight type (p.weight_type).
cudaError_t launch_draft_confidence(int w_type, const ConfidenceParams& p, cudaStream_t stream);

}  // namespace dspark_ops::kernels
