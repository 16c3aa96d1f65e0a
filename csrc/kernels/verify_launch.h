// The launch interface of the verify family: what the ATen glue (cuda/verify_cuda.cpp, g++) calls
// and cuda/verify_launch.cu (nvcc, torch-free) defines; kernels/verify.cuh's kernels read the
// params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

// The workspace's records (kernels/verify.cuh).
struct RowPartial;
struct RowResult;
struct RacePartial;
struct ChunkFloor;

struct VerifyParams {
  const void* target;  // [rows, vocab], unit stride along vocab
  int64_t target_row_stride;
  // 0, or a padded target [B, G+1, V] read through both strides: row i is at
  // (i / group_rows) * group_stride + (i % group_rows) * row_stride
  int64_t target_group_rows, target_group_stride;
  int64_t target_rows;
  const void* draft;  // [B, G, vocab] or null (one-hot drafts)
  int64_t draft_stride_b, draft_stride_j;
  const void* draft_tokens;  // int32 or int64 [B, G]
  int64_t token_stride_b, token_stride_j;
  bool tokens_int32;
  const int32_t* num_draft;
  const float* temperature;
  const float* draft_temperature;  // null: = temperature
  const int64_t* seed;
  const int64_t* position;
  const int32_t* target_start;  // null: b * (G + 1)
  const int32_t* top_k;         // [B] or null (off), as the three filters
  const float* top_p;
  const float* min_p;
  const int32_t* allowed_token_mask;  // [target_rows, mask_words] or null (all allowed)
  int64_t mask_words;
  float* logprobs;              // [B, G + 1] or null (not asked for)
  int64_t* tokens;              // [B, G + 1]
  int32_t* num_accepted;        // [B]
  bool* valid;                  // [B]
  int batch, block;
  int64_t vocab;
  int num_chunks;
  int64_t chunk;
  // Iterations of a chunk whose loads are in flight together through the statistics pass's ring
  // when draft rows are given (kernels/verify.cuh, kMaxVerifyStages), and through the emit
  // kernel's race (kMaxRaceStages; the emit launch's shared memory says it): set by
  // plan_verify_rings.
  int stages;
  int race_stages;
  // Workspace (any initial contents).
  RowPartial* partials;  // [B, G+1, C]
  // [B, G+1, C] when top-k is given, else null: each chunk's floor under the row's k-th largest
  // logit and how many of its tokens are at or above it (verify.cuh, ChunkFloor).
  ChunkFloor* chunk_floors;
  // [B, G+1, C, kChunkCandidates] when top-k is given and keep_candidates, else null: the keys
  // of each chunk's tokens at or above its floor.
  uint32_t* candidates;
  bool keep_candidates;  // set by the caller: whether the workspace holds the candidate lists
  RowResult* results;    // [B, G+1]
  RacePartial* race_partials;  // [B, C]
  // Counters, zero when the call starts; each is back to zero when the call ends (its last user
  // resets it), so one buffer serves every call on a stream (see verify_cuda.cpp).
  int32_t* row_arrivals;  // [B, G+1]
  int32_t* reject_marks;  // [B]: max over rejected rows j of (G + 1 - j): 0 = none yet
  int32_t* race_arrivals;  // [B]: chunks of the final row raced
};

// The vocabulary split: C = min(16, ceil(V / 1024)) chunks, a multiple of 16 elements long (whole
// vector loads, whole Philox blocks). It depends on V alone, never on B or the GPU, so a request's
// partial sums, their merge order and hence its outputs are the same in any batch. How full
// that leaves the GPU at each batch size: docs/performance-model.md, "Why the launch constants
// are what they are".
constexpr int64_t kVerifyMaxChunks = 16;

inline int64_t verify_chunk(int64_t vocab) {
  const int64_t by_size = (vocab + 1023) / 1024;
  const int64_t wanted = by_size < kVerifyMaxChunks ? by_size : kVerifyMaxChunks;
  return ((vocab + wanted - 1) / wanted + 15) / 16 * 16;
}

inline int64_t verify_num_chunks(int64_t vocab) {
  const int64_t chunk = verify_chunk(vocab);
  return (vocab + chunk - 1) / chunk;
}

// Bytes of the candidate lists of a call with these params (p.batch, p.block, p.num_chunks)
// when top-k is given, else 0: the caller sets p.keep_candidates when it can afford them.
int64_t verify_candidate_bytes(const VerifyParams& p);

// Bytes of the workspace a call with these params needs (p.batch, p.block, p.num_chunks,
// whether p.top_k is given and p.keep_candidates), and the pointers into it that bind_verify_workspace sets: any
// initial contents.
int64_t verify_workspace_bytes(const VerifyParams& p);
void bind_verify_workspace(VerifyParams& p, void* workspace);

// Sets p.stages and p.race_stages for `device` (p.draft, p.chunk and the filters set): each the
// iterations a chunk takes, at most kMaxVerifyStages / kMaxRaceStages, fewer while the ring's
// shared memory would cost its kernel resident blocks (host queries, cached per device); the
// statistics ring 1 without draft rows (unused).
void plan_verify_rings(int target_type, int draft_type, VerifyParams& p, int device);

// Launches both kernels on `stream`, the second as a dependent launch; target_type and
// draft_type are the ElementType codes (common/element_type.h) of the target and draft logits.
cudaError_t launch_verify(int target_type, int draft_type, const VerifyParams& p,
                          cudaStream_t stream);

}  // namespace dspark_ops::kernels
