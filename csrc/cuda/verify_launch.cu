// Launchers of the verify family (nvcc, torch-free): the workspace layout, and the statistics and
// emit kernels of kernels/verify.cuh instantiated per target and draft element type.
#include "../kernels/verify_launch.h"

#include "../kernels/convert.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/verify.cuh"

namespace dspark_ops::kernels {
namespace {

// Bytes of `count` objects of T, rounded up to keep the next region 16-byte aligned.
template <typename T>
int64_t region_bytes(int64_t count) {
  return (count * static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16;
}

struct WorkspaceLayout {
  int64_t partial_bytes, result_bytes, race_bytes, floor_bytes, candidate_bytes;
};

WorkspaceLayout workspace_layout(const VerifyParams& p) {
  const int64_t rows = int64_t{p.batch} * (p.block + 1);
  WorkspaceLayout w{};
  w.partial_bytes = region_bytes<RowPartial>(rows * p.num_chunks);
  w.result_bytes = region_bytes<RowResult>(rows);
  w.race_bytes = region_bytes<RacePartial>(int64_t{p.batch} * p.num_chunks);
  // Top-k's floors and candidates (only when top-k is given; the lists when affordable).
  w.floor_bytes = p.top_k ? region_bytes<ChunkFloor>(rows * p.num_chunks) : 0;
  w.candidate_bytes = p.keep_candidates ? verify_candidate_bytes(p) : 0;
  return w;
}

template <typename TT, typename DT>
cudaError_t launch_verify_typed(const VerifyParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  // One block per (row, chunk) item; x (request and chunk) varies fastest, so blocks start in
  // row-major order: row j of every request before row j + 1 of any, and a request's later rows
  // start once its earlier ones are decided, when a rejection lets them be skipped.
  const dim3 items(p.num_chunks * p.batch, p.block + 1);
  DSPARK_LAUNCH(items, kVerifyThreads, verify_shared_bytes(has_filters(p)), stream,
                verify_row_stats_kernel<TT, DT>)(p);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  // Dependent: its launch overlaps the statistics kernel's last blocks (sm_90 and later).
  DSPARK_LAUNCH_DEPENDENT(dim3(p.num_chunks, p.batch), kVerifyThreads, 0, stream,
                          verify_emit_kernel<TT, DT>)(p);
  return cudaGetLastError();
}

}  // namespace

int64_t verify_candidate_bytes(const VerifyParams& p) {
  const int64_t rows = int64_t{p.batch} * (p.block + 1);
  return p.top_k ? region_bytes<uint32_t>(rows * p.num_chunks * kChunkCandidates) : 0;
}

int64_t verify_workspace_bytes(const VerifyParams& p) {
  const WorkspaceLayout w = workspace_layout(p);
  return w.partial_bytes + w.result_bytes + w.race_bytes + w.floor_bytes + w.candidate_bytes;
}

void bind_verify_workspace(VerifyParams& p, void* workspace) {
  const WorkspaceLayout w = workspace_layout(p);
  auto* base = static_cast<uint8_t*>(workspace);
  p.partials = reinterpret_cast<RowPartial*>(base);
  base += w.partial_bytes;
  p.results = reinterpret_cast<RowResult*>(base);
  base += w.result_bytes;
  p.race_partials = reinterpret_cast<RacePartial*>(base);
  base += w.race_bytes;
  p.chunk_floors = w.floor_bytes ? reinterpret_cast<ChunkFloor*>(base) : nullptr;
  base += w.floor_bytes;
  p.candidates = w.candidate_bytes ? reinterpret_cast<uint32_t*>(base) : nullptr;
}

cudaError_t launch_verify(int target_type, int draft_type, const VerifyParams& p,
                          cudaStream_t stream) {
  return with_element_type(target_type, [&](auto tt) {
    return with_element_type(draft_type, [&](auto dt) {
      return launch_verify_typed<decltype(tt), decltype(dt)>(p, stream);
    });
  });
}

}  // namespace dspark_ops::kernels
