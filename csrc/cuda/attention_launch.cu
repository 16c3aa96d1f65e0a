// Launchers of the attention family (nvcc, torch-free): the split kernel's occupancy, the split
// and merge launches per element type and head dim, and the append copy.
#include "../kernels/attention_launch.h"

#include <type_traits>

#include "../common/device_cache.h"
#include "../kernels/attention.cuh"
#include "../kernels/convert.cuh"
#include "../kernels/launch.cuh"

namespace dspark_ops::kernels {
namespace {

// Asked once per head dim and device (common/device_cache.h).
template <int D>
int stages_typed(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [device] {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // the query's own error
      return 2;
    }
    return attention_shared_bytes(D, kAttnMaxStages) <= static_cast<size_t>(optin) ? kAttnMaxStages
                                                                                   : 2;
  });
}

// Asked once per instantiation and device.
template <typename T, int D, int kStages>
int blocks_per_sm_staged(int device) {
  const int shared = static_cast<int>(attention_shared_bytes(D, kStages));
  int n = 0;
  if (allow_dynamic_shared(block_attention_split_kernel<T, D, kStages>, shared) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, block_attention_split_kernel<T, D, kStages>,
                                                    kAttnThreads, shared) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error
    n = 1;
  }
  return n > 0 ? n : 1;
}

template <typename T, int D>
int blocks_per_sm_typed(int device) {
  static DeviceCache cache{};
  return once_per_device(cache, device, [device] {
    return stages_typed<D>(device) == kAttnMaxStages
               ? blocks_per_sm_staged<T, D, kAttnMaxStages>(device)
               : blocks_per_sm_staged<T, D, 2>(device);
  });
}

template <typename T, int D, int kStages>
cudaError_t launch_staged(const AttentionParams& p, cudaStream_t stream) {
  const size_t shared = attention_shared_bytes(D, kStages);
  const cudaError_t opted_in =
      allow_dynamic_shared(block_attention_split_kernel<T, D, kStages>, shared);
  if (opted_in != cudaSuccess) return opted_in;
  const int rows = p.block * (p.heads / p.kv_heads);
  const int groups = (rows + kAttnRows - 1) / kAttnRows;
  DSPARK_LAUNCH(dim3(p.splits, p.kv_heads * groups, p.batch), kAttnThreads, shared, stream,
                block_attention_split_kernel<T, D, kStages>)(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_block_attention_typed(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.block == 0 || p.heads == 0) return cudaSuccess;
  // p.stages is attention_stages() of the launch's device (the glue asked).
  cudaError_t error = p.stages == kAttnMaxStages ? launch_staged<T, D, kAttnMaxStages>(p, stream)
                                                 : launch_staged<T, D, 2>(p, stream);
  if (error != cudaSuccess) return error;
  const int64_t out_rows = int64_t{p.batch} * p.block * p.heads;
  const int warps = kAttnThreads / 32;
  DSPARK_LAUNCH(static_cast<unsigned>((out_rows + warps - 1) / warps), kAttnThreads, 0, stream,
                block_attention_merge_kernel<T, D>)(p);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t launch_append_typed(const AppendParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  DSPARK_LAUNCH(p.batch, kAppendThreads, 0, stream, append_context_kv_kernel<Unit>)(p);
  return cudaGetLastError();
}

// Calls f(T{}, std::integral_constant<int, D>{}) for the split kernel's element type and head dim.
template <typename F>
auto with_attention_types(int element_type, int dim, F&& f) {
  const auto with_dim = [&](auto t) {
    switch (dim) {
      case 64: return f(t, std::integral_constant<int, 64>{});
      case 128: return f(t, std::integral_constant<int, 128>{});
      case 256: return f(t, std::integral_constant<int, 256>{});
      default: return f(t, std::integral_constant<int, 512>{});
    }
  };
  return element_type == kElementHalf ? with_dim(__half{}) : with_dim(__nv_bfloat16{});
}

}  // namespace

int attention_blocks_per_sm(int element_type, int dim, int device) {
  return with_attention_types(element_type, dim, [&](auto t, auto d) {
    return blocks_per_sm_typed<decltype(t), decltype(d)::value>(device);
  });
}

int attention_stages(int dim, int device) {
  return with_attention_types(kElementBFloat16, dim, [&](auto, auto d) {
    return stages_typed<decltype(d)::value>(device);
  });
}

cudaError_t launch_block_attention(int element_type, int dim, const AttentionParams& p,
                                   cudaStream_t stream) {
  return with_attention_types(element_type, dim, [&](auto t, auto d) {
    return launch_block_attention_typed<decltype(t), decltype(d)::value>(p, stream);
  });
}

cudaError_t launch_append_context_kv(int element_bytes, const AppendParams& p,
                                     cudaStream_t stream) {
  return element_bytes == 2 ? launch_append_typed<uint16_t>(p, stream)
                            : launch_append_typed<uint32_t>(p, stream);
}

}  // namespace dspark_ops::kernels
