// Asynchronous global -> shared copies (cp.async, sm_80+; PTX ISA "cp.async",
// "cp.async.commit_group", "cp.async.wait_group"), torch-free.
//
// A thread issues 16-byte (or 4-byte) copies that need no registers to stage the data and are
// all in flight together; commit_group closes the copies issued since the last commit into a
// group, and wait_group<N> returns once at most the N most recent groups are still pending. Until
// then the destination holds undefined bytes, and only the issuing thread's wait makes the data
// visible to it: other threads see it after a barrier that follows the wait.
//
// In the SIMT emulator (csrc/sim/prelude.h) a copy poisons its destination at issue and is
// performed by the issuing thread at the wait that completes it, through instrumented loads and
// stores: a read before the wait sees the poison, a read by another thread without a barrier after
// the wait is a race, and the bounds checker sees the source read. Copies never waited for are
// reported when the thread exits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dspark_ops::kernels {

// 16 bytes from global `src` to shared `dst`, both 16-byte aligned. With `fill` false nothing is
// read and dst gets 16 zero bytes; src must still be a valid address (it is not dereferenced).
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool fill) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src),
               "r"(fill ? 16 : 0)
               : "memory");
#elif defined(DSPARK_OPS_SIM)
  ::dspark_sim::copy_async(DSPARK_SIM_SITE, dst, src, 16, fill ? 16 : 0);
#else
  __trap();
#endif
}

// 4 bytes from global `src` to shared `dst`, both 4-byte aligned (cp.async.ca: the only cache
// mode for copies under 16 bytes); `fill` as for copy_async_16.
__device__ __forceinline__ void copy_async_4(void* dst, const void* src, bool fill) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared), "l"(src),
               "r"(fill ? 4 : 0)
               : "memory");
#elif defined(DSPARK_OPS_SIM)
  ::dspark_sim::copy_async(DSPARK_SIM_SITE, dst, src, 4, fill ? 4 : 0);
#else
  __trap();
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(DSPARK_OPS_SIM)
  ::dspark_sim::copy_async_commit();
#else
  __trap();
#endif
}

// Returns once at most `kPending` of this thread's most recent committed groups are incomplete.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#elif defined(DSPARK_OPS_SIM)
  ::dspark_sim::copy_async_wait(kPending);
#else
  __trap();
#endif
}

// copy_async_wait with a runtime `pending` in [0, kMaxPending]: wait_group takes an immediate, so
// one of kMaxPending + 1 waits, chosen by a branch that is uniform wherever `pending` is.
template <int kMaxPending>
__device__ __forceinline__ void copy_async_wait_upto(int pending) {
  if constexpr (kMaxPending > 0) {
    if (pending >= kMaxPending) {
      copy_async_wait<kMaxPending>();
      return;
    }
    copy_async_wait_upto<kMaxPending - 1>(pending);
  } else {
    copy_async_wait<0>();
  }
}

// A thread's own ring of `stages` stages in shared memory, for a stream whose iterations the
// thread copies ahead (cp.async) and reads back itself, so no barrier is needed. Word w of stage
// k is ring[(k * kWords + w) * kThreads + thread]: a warp's copies and reads of one word are 512
// contiguous bytes and hit every bank equally. The caller issues each iteration's copies
// (copy(w, src) for its words, then commit(): one group an iteration, empty ones included, as the
// waits count groups) stages - 1 iterations before it reads them (next()).
template <int kWords, int kThreads, int kMaxStages>
class ThreadRing {
 public:
  __device__ __forceinline__ ThreadRing(uint4* ring, int stages)
      : mine_(ring + threadIdx.x), stages_(stages) {}

  // Word w of the iteration being issued, from global `src` (16-byte aligned).
  __device__ __forceinline__ void copy(int w, const void* src) {
    copy_async_16(mine_ + (issue_ * kWords + w) * kThreads, src, true);
  }

  // Closes the iteration being issued (its copies, if any) and moves on to the next stage.
  __device__ __forceinline__ void commit() {
    copy_async_commit();
    issue_ = issue_ + 1 == stages_ ? 0 : issue_ + 1;
  }

  // Waits for the oldest iteration not yet read (the stages - 1 issued after it may still load)
  // and returns its stage; word(stage, w) reads its words.
  __device__ __forceinline__ const uint4* next() {
    copy_async_wait_upto<kMaxStages - 1>(stages_ - 1);
    const uint4* const stage = mine_ + read_ * kWords * kThreads;
    read_ = read_ + 1 == stages_ ? 0 : read_ + 1;
    return stage;
  }

  __device__ __forceinline__ static uint4 word(const uint4* stage, int w) {
    return stage[w * kThreads];
  }

  // Every copy issued has landed (before the ring's memory is used for something else).
  __device__ __forceinline__ void drain() { copy_async_wait<0>(); }

 private:
  uint4* mine_;
  int stages_;
  int issue_ = 0, read_ = 0;
};

}  // namespace dspark_ops::kernels
