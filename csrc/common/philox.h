// Counter-based Philox4x32-10 shared by the CPU and CUDA kernels.
//
// Every random number an op uses is a pure function of (seed, absolute token position, purpose,
// element index), never of the batch row, the batch size, the device or a host generator. That is
// what makes a request's output independent of its batch neighbours, identical on CPU and CUDA,
// and safe to capture in a CUDA graph.
//
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (element >> 2, purpose, position & 0xffffffff, position >> 32)
//   element i uses output word i & 3 of that Philox block.
//
// A 32-bit word w becomes a float32 uniform u = min(w * 2^-32 + 2^-33, 1 - 2^-24), in (0, 1) and
// finest near 0: the acceptance test u * q < p resolves acceptance probabilities down to 2^-33,
// and the race's exponential E = -log1p(-u) resolves E down to 2^-33 (the small E decide which
// low-probability token wins). Each step is one correctly rounded float32 operation, so the
// Python reference reproduces u bit for bit.
//
// Philox4x32-10 is the generator of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"
// (SC'11), as in Random123 and cuRAND; tests check it against the Random123 known-answer vectors.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DSPARK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DSPARK_HOST_DEVICE inline
#endif

namespace dspark_ops {

// Independent streams: a token's draft proposal, its acceptance test and its resampling never share
// random numbers.
enum RandomPurpose : uint32_t {
  kPurposeDraft = 0,
  kPurposeAccept = 1,
  kPurposeResample = 2,
};

struct Philox4 {
  uint32_t x[4];
};

DSPARK_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  lo = static_cast<uint32_t>(product);
  hi = static_cast<uint32_t>(product >> 32);
#endif
}

DSPARK_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, counter.x[0], hi0, lo0);
    philox_mulhilo(kMul1, counter.x[2], hi1, lo1);
    counter = Philox4{{hi1 ^ counter.x[1] ^ key0, lo1, hi0 ^ counter.x[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Position `offset` tokens after `position`, modulo 2^64: the stream a row draws from. Unsigned
// arithmetic, so no int64 input (value checks are off on CUDA by default) overflows a signed
// integer; documented positions (at most 2^62) never wrap.
DSPARK_HOST_DEVICE int64_t offset_position(int64_t position, int64_t offset) {
  return static_cast<int64_t>(static_cast<uint64_t>(position) + static_cast<uint64_t>(offset));
}

// The Philox block holding elements [4*group, 4*group + 4) of stream (seed, position, purpose).
DSPARK_HOST_DEVICE Philox4 philox_block(int64_t seed, int64_t position, uint32_t purpose,
                                        uint32_t group) {
  const uint64_t s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  return philox4x32_10(
      Philox4{{group, purpose, static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32)}},
      static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
}

DSPARK_HOST_DEVICE float uniform_from_bits(uint32_t bits) {
  const float u = static_cast<float>(bits) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
  return u < 0.99999994f ? u : 0.99999994f;  // 2^-32, 2^-33, 1 - 2^-24
}

// Uniform number `element` of stream (seed, position, purpose).
DSPARK_HOST_DEVICE float philox_uniform(int64_t seed, int64_t position, uint32_t purpose,
                                        uint32_t element) {
  const Philox4 block = philox_block(seed, position, purpose, element >> 2);
  const uint32_t k = element & 3;  // selected, not indexed: a runtime index puts x in local memory
  return uniform_from_bits(k == 0   ? block.x[0]
                           : k == 1 ? block.x[1]
                           : k == 2 ? block.x[2]
                                    : block.x[3]);
}

}  // namespace dspark_ops
