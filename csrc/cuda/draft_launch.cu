// Launchers of the drafting family (nvcc, torch-free): the slot kernel's shared-memory budget,
// opt-in and occupancy, the block walk and the confidence kernel, instantiated per weight and base
// logit type and for the RNN head.
#include "../kernels/draft_launch.h"

#include <algorithm>
#include <type_traits>

#include "../common/device_cache.h"
#include "../kernels/convert.cuh"
#include "../kernels/draft.cuh"

namespace dspark_ops::kernels {
namespace {

// Calls f(W{}, std::bool_constant<rnn>{}) for the weights' type and the op.
template <typename F>
auto with_weight_type(int w_type, bool rnn, F&& f) {
  return with_element_type(w_type, [&](auto w) {
    return rnn ? f(w, std::true_type{}) : f(w, std::false_type{});
  });
}

// Calls f(W{}, Base{}, std::bool_constant<rnn>{}): the slot kernel's instantiation.
template <typename F>
auto with_slot_types(int w_type, int base_type, bool rnn, F&& f) {
  return with_weight_type(w_type, rnn, [&](auto w, auto kernel_rnn) {
    return with_element_type(base_type, [&](auto base) { return f(w, base, kernel_rnn); });
  });
}

}  // namespace

int draft_shared_bytes(int w_type, bool rnn, int group_size, int rank, int stages) {
  return with_weight_type(w_type, rnn, [&](auto w, auto kernel_rnn) {
    return draft_shared_bytes<decltype(w), decltype(kernel_rnn)::value>(group_size, rank, stages);
  });
}

int draft_w2_stages(int w_type, bool rnn, int group_size, int rank, int budget) {
  if (w_type == kElementFloat) return 0;
  int stages = kMaxW2Stages;
  while (stages > kMinW2Stages && draft_shared_bytes(w_type, rnn, group_size, rank, stages) > budget) {
    stages /= 2;
  }
  return stages;
}

int draft_input_budget(int device, int blocks) {
  constexpr int kMostBlocks = 8;  // 8 warps a block: 64 warps an SM at most
  static DeviceCache caches[kMostBlocks + 1]{};
  blocks = std::clamp(blocks, 1, kMostBlocks);
  return once_per_device(caches[blocks], device, [device, blocks] {
    int per_sm = 0, per_block = 0;
    if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // the query's own error
      return kFallbackInputBytes;
    }
    return std::max(kFallbackInputBytes,
                    std::min(per_sm / blocks, per_block) - kSlotSharedReserve);
  });
}

cudaError_t allow_draft_shared(int w_type, int base_type, bool rnn, int shared_bytes) {
  return with_slot_types(w_type, base_type, rnn, [&](auto w, auto base, auto kernel_rnn) {
    return allow_draft_shared<decltype(w), decltype(base), decltype(kernel_rnn)::value>(
        shared_bytes);
  });
}

int draft_blocks_per_sm(int w_type, int base_type, bool rnn, int device, int shared_bytes) {
  return with_slot_types(w_type, base_type, rnn, [&](auto w, auto base, auto kernel_rnn) {
    return draft_blocks_per_sm<decltype(w), decltype(base), decltype(kernel_rnn)::value>(
        device, shared_bytes);
  });
}

cudaError_t launch_draft(int w_type, int base_type, bool rnn, const DraftParams& p,
                         int grid_tiles, cudaStream_t stream) {
  return with_slot_types(w_type, base_type, rnn, [&](auto w, auto base, auto kernel_rnn) {
    return launch_draft<decltype(w), decltype(base), decltype(kernel_rnn)::value>(p, grid_tiles,
                                                                                 stream);
  });
}

cudaError_t launch_draft_confidence(int w_type, const ConfidenceParams& p, cudaStream_t stream) {
  return with_element_type(w_type, [&](auto w) {
    return with_element_type(p.weight_type, [&](auto weight) {
      return launch_draft_confidence<decltype(w), decltype(weight)>(p, stream);
    });
  });
}

}  // namespace dspark_ops::kernels
