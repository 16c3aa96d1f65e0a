// The kernels' counters (arrivals, rejection marks, claims, best keys) in a buffer kept per
// (device, stream) for the ATen glue in cuda/*_cuda.cpp.
//
// Every counter is zero when a call starts and back to zero when it ends, since each counter's
// last user resets it (kernels/verify.cuh, kernels/draft_slot.cuh). So instead of a zero fill before
// every call (one more kernel on the stream), each (device, stream) keeps one buffer, filled once
// when made or grown; calls on one stream run in order, whatever op they are, so they take turns
// on it. While the stream is being captured into a CUDA graph a call gets a fresh buffer, filled
// inside the graph: a graph may be replayed on several streams at once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace dspark_ops {

class StreamCounters {
 public:
  // At least `bytes` zero bytes on `like`'s device (16-byte aligned), for `stream`'s calls.
  static at::Tensor get(const at::Tensor& like, int64_t bytes, cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const auto options = like.options().dtype(at::kByte);
    if (capture != cudaStreamCaptureStatusNone) return at::zeros({bytes}, options);
    std::lock_guard<std::mutex> lock(mutex());
    at::Tensor& buffer = buffers()[key(like, stream)];
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::zeros({bytes}, options);
    return buffer;
  }

  // After a failed launch the counters may be left set: the next call on the stream starts over.
  static void forget(const at::Tensor& like, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex());
    buffers().erase(key(like, stream));
  }

 private:
  using Key = std::pair<int, uintptr_t>;
  static Key key(const at::Tensor& like, cudaStream_t stream) {
    return {like.device().index(), reinterpret_cast<uintptr_t>(stream)};
  }
  // Never destroyed: tensors freed after the CUDA runtime has shut down would fail. (Inline
  // functions: one map for every translation unit.)
  static std::map<Key, at::Tensor>& buffers() {
    static auto* map = new std::map<Key, at::Tensor>();
    return *map;
  }
  static std::mutex& mutex() {
    static auto* m = new std::mutex();
    return *m;
  }
};

}  // namespace dspark_ops
