// Launchers of the verify family (nvcc, torch-free): the workspace layout, and the statistics and
// emit kernels of kernels/verify.cuh instantiated per target and draft element type.
#include "../kernels/verify_launch.h"

#include <algorithm>

#include "../common/device_cache.h"
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

// The most stages in [1, most] whose dynamic shared memory (`shared_bytes(stages)`) still lets
// `kernel` keep `designed` blocks per SM resident on the current device (as many as one stage
// allows, when that is fewer).
template <typename Kernel, typename Bytes>
int deepest_ring(Kernel kernel, int most, int designed, Bytes shared_bytes) {
  const auto resident = [kernel](int bytes) {
    int blocks = 0;
    if (allow_dynamic_shared(kernel, bytes) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kVerifyThreads, bytes) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // the query's own error: that depth is not taken
      return 0;
    }
    return blocks;
  };
  const int one = resident(shared_bytes(1));
  if (one == 0) return 1;  // the queries failed: no deeper ring than the launch needs
  const int wanted = one < designed ? one : designed;
  for (int stages = most; stages > 1; --stages) {
    if (resident(shared_bytes(stages)) >= wanted) return stages;
  }
  return 1;
}

// The statistics ring's deepest on `device`, beside the filters' shared memory when `filters`:
// once per device.
template <typename TT, typename DT>
int stats_ring_depth(int device, bool filters) {
  static DeviceCache caches[2]{};
  return once_per_device(caches[filters ? 1 : 0], device, [device, filters] {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return 1;
    }
    return deepest_ring(verify_row_stats_kernel<TT, DT>, kMaxVerifyStages,
                        stats_blocks_per_sm<TT, DT>(major), [filters](int stages) {
                          return verify_shared_bytes<TT, DT>(true, filters, stages);
                        });
  });
}

// The race's ring's deepest on `device`: once per device.
template <typename TT, typename DT>
int race_ring_depth(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [] {
    return deepest_ring(verify_emit_kernel<TT, DT>, kMaxRaceStages, kEmitBlocksPerSM,
                        [](int stages) { return verify_race_shared_bytes<TT, DT>(stages); });
  });
}

template <typename TT, typename DT>
cudaError_t launch_verify_typed(const VerifyParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  // One block per (row, chunk) item; x (request and chunk) varies fastest, so blocks start in
  // row-major order: row j of every request before row j + 1 of any, and a request's later rows
  // start once its earlier ones are decided, when a rejection lets them be skipped.
  const dim3 items(p.num_chunks * p.batch, p.block + 1);
  const int stats_shared =
      verify_shared_bytes<TT, DT>(p.draft != nullptr, has_filters(p), p.stages);
  cudaError_t error = allow_dynamic_shared(verify_row_stats_kernel<TT, DT>, stats_shared);
  if (error != cudaSuccess) return error;
  DSPARK_LAUNCH(items, kVerifyThreads, stats_shared, stream, verify_row_stats_kernel<TT, DT>)(p);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  // Dependent: its launch overlaps the statistics kernel's last blocks (sm_90 and later).
  const int race_shared = verify_race_shared_bytes<TT, DT>(p.race_stages);
  error = allow_dynamic_shared(verify_emit_kernel<TT, DT>, race_shared);
  if (error != cudaSuccess) return error;
  DSPARK_LAUNCH_DEPENDENT(dim3(p.num_chunks, p.batch), kVerifyThreads, race_shared, stream,
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

void plan_verify_rings(int target_type, int draft_type, VerifyParams& p, int device) {
  with_element_type(target_type, [&](auto tt) {
    return with_element_type(draft_type, [&](auto dt) {
      using TT = decltype(tt);
      using DT = decltype(dt);
      const auto depth = [](int64_t needed, int most) {
        return static_cast<int>(std::clamp<int64_t>(needed, 1, most));
      };
      p.stages = p.draft ? depth(ring_iterations<TT, DT>(p.chunk),
                                 stats_ring_depth<TT, DT>(device, has_filters(p)))
                         : 1;
      p.race_stages = depth(race_iterations(p.chunk), race_ring_depth<TT, DT>(device));
      return 0;
    });
  });
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
