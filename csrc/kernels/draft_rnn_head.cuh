// The RNN head of rnn_draft (docs/semantics.md §3.2), torch-free: per slot, before the slot
// kernel, [g; c; o] = J [s; W1[x]; h] + b for every request: rnn_head_mma_kernel for 16-bit J on
// tensor cores (a block per 16 rows x 8 requests, its warps splitting the columns; float32 inputs
// enter as three 16-bit parts, so the products are those of the float32 values), rnn_head_kernel
// for float32 J on CUDA cores (each warp 4 rows of J x 8 requests, each lane a pair of columns
// per step). The slot kernel (draft_slot.cuh) reads o and advances the state s from g and c.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.cuh"
#include "draft_params.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace dspark_ops::kernels {

// [g; c; o] = J [s; W1[x]; h] + b for slot p.slot. Grid (3r / 32, ceil(B / 8)): warp w of block
// (x, y) computes rows 32x + 4w .. +4 of J for requests 8y .. 8y + 8, each lane taking pairs of
// consecutive columns of each input segment: 12 loads (one 32- or 64-bit load per row of J and
// per request where the segment's rows are pair-aligned) per 64 multiply-adds, no branch in the
// loop. Rows past 3r and requests past B read the last valid one and are not stored.
constexpr int kHeadRowsPerWarp = 4;

// Whether pairs (2i, 2i + 1) of rows base + m * stride_a + n * stride_b are 2-element aligned.
template <typename T>
__device__ __forceinline__ bool pairs_aligned(const T* base, int64_t stride_a, int64_t stride_b = 0) {
  return reinterpret_cast<uintptr_t>(base) % (2 * sizeof(T)) == 0 && stride_a % 2 == 0 &&
         stride_b % 2 == 0;
}

// at[0] and at[1] as floats: one load when kAligned.
template <bool kAligned, typename T>
__device__ __forceinline__ float2 load_pair(const T* at) {
  if constexpr (!kAligned) {
    return make_float2(to_float(at[0]), to_float(at[1]));
  } else if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const float2*>(at));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // a bfloat16 is a float's high half
    const unsigned int bits = __ldg(reinterpret_cast<const unsigned int*>(at));
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  } else {
    const unsigned int bits = __ldg(reinterpret_cast<const unsigned int*>(at));
    const uint16_t lo = bits & 0xffffu, hi = bits >> 16;
    T a, b;
    memcpy(&a, &lo, sizeof(T));
    memcpy(&b, &hi, sizeof(T));
    return make_float2(to_float(a), to_float(b));
  }
}

// acc[r][q] += J[row r, k0 + k] * in_q[k] over k in [0, len): the lane's pairs, then the odd last
// column. `in[q]` is request q's segment row; with kMasked, requests whose bit of `valid` is clear
// read zeros (an id outside [0, V)).
template <bool kAligned, bool kMasked, typename W, typename T>
__device__ __forceinline__ void head_segment(const W* const (&joint)[kHeadRowsPerWarp], int k0,
                                             int len, const T* const (&in)[kHeadRequests],
                                             unsigned valid, int lane,
                                             float (&acc)[kHeadRowsPerWarp][kHeadRequests]) {
  // The loads' addresses advance by 64 columns a step (no per-load index arithmetic).
  const W* weight_at[kHeadRowsPerWarp];
  const T* input_at[kHeadRequests];
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) weight_at[r] = joint[r] + k0 + 2 * lane;
#pragma unroll
  for (int q = 0; q < kHeadRequests; ++q) input_at[q] = in[q] + 2 * lane;
  int k = 2 * lane;
#pragma unroll 1
  for (; k + 1 < len; k += 64) {
    float2 weight[kHeadRowsPerWarp], x[kHeadRequests];
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
      weight[r] = load_pair<kAligned>(weight_at[r]);
      weight_at[r] += 64;
    }
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      x[q] = !kMasked || (valid >> q & 1u) ? load_pair<kAligned>(input_at[q]) : make_float2(0.f, 0.f);
      input_at[q] += 64;
    }
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
#pragma unroll
      for (int q = 0; q < kHeadRequests; ++q) {
        acc[r][q] = fmaf(weight[r].y, x[q].y, fmaf(weight[r].x, x[q].x, acc[r][q]));
      }
    }
  }
  if (k < len) {
#pragma unroll
    for (int r = 0; r < kHeadRowsPerWarp; ++r) {
      const float weight = to_float(joint[r][k0 + k]);
#pragma unroll
      for (int q = 0; q < kHeadRequests; ++q) {
        const float x = !kMasked || (valid >> q & 1u) ? to_float(in[q][k]) : 0.f;
        acc[r][q] = fmaf(weight, x, acc[r][q]);
      }
    }
  }
}

// Row `row` of [g; c; o] = J [s; W1[x]; h] + b for request b with the dot product in float64: the
// rare path of both head kernels, for a float32 sum at or above kExactHeadAbove or not finite
// (finite weights near float32's range). s_0 = 0 is multiplied as the float32 path does.
template <typename W>
__device__ float exact_preactivation(const DraftParams& p, int b, int row) {
  const W* joint = static_cast<const W*>(p.joint_weight) + int64_t{row} * p.joint_stride;
  const auto term = [&](int k, float input) {
    return static_cast<double>(to_float(joint[k])) * static_cast<double>(input);
  };
  double sum = 0.0;
  for (int k = 0; k < p.rank; ++k) {
    sum += term(k, p.slot > 0 ? p.state[int64_t{b} * p.rank + k] : 0.f);
  }
  const int64_t x = previous_token(p, b);
  if (x >= 0 && x < p.vocab) {
    const W* w1 = static_cast<const W*>(p.w1) + x * p.w1_stride;
    for (int k = 0; k < p.rank; ++k) sum += term(p.rank + k, to_float(w1[k]));
  }
  const int64_t h = int64_t{b} * p.hidden_stride_b + int64_t{p.slot} * p.hidden_stride_j;
  for (int k = 0; k < p.hidden_size; ++k) {
    sum += term(2 * p.rank + k, load_float(p.hidden, p.hidden_type, h + k));
  }
  const double bias = static_cast<double>(to_float(static_cast<const W*>(p.joint_bias)[row]));
  return static_cast<float>(sum + bias);
}

template <typename W>
__global__ void __launch_bounds__(kDraftThreads, 2) rnn_head_kernel(const DraftParams p) {
  wait_for_previous_grid();  // a dependent launch after the previous slot's: its state, tokens
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kDraftWarps + warp) * kHeadRowsPerWarp;
  const int b0 = blockIdx.y * kHeadRequests;
  const int rows = 3 * p.rank;
  if (row0 >= rows) return;
  const W* joint_weight = static_cast<const W*>(p.joint_weight);
  const W* joint[kHeadRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) {
    joint[r] = joint_weight + int64_t{min(row0 + r, rows - 1)} * p.joint_stride;
  }
  int request[kHeadRequests];
#pragma unroll
  for (int q = 0; q < kHeadRequests; ++q) request[q] = min(b0 + q, p.batch - 1);
  float acc[kHeadRowsPerWarp][kHeadRequests] = {};
  // Each segment's loop runs with pair loads when J's and the segment's rows are pair-aligned.
  const auto segment = [&](int k0, int len, const auto* const (&in)[kHeadRequests], bool aligned,
                           unsigned valid, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    if (aligned && pairs_aligned(joint_weight, p.joint_stride, k0)) {
      head_segment<true, kMasked>(joint, k0, len, in, valid, lane, acc);
    } else {
      head_segment<false, kMasked>(joint, k0, len, in, valid, lane, acc);
    }
  };
  using Unmasked = std::false_type;
  {  // W1[x_j]: a zero row for an id outside [0, V)
    const W* w1 = static_cast<const W*>(p.w1);
    const W* in[kHeadRequests];
    unsigned valid = 0;
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      const int64_t x = previous_token(p, request[q]);
      const bool ok = x >= 0 && x < p.vocab;
      valid |= unsigned{ok} << q;
      in[q] = w1 + (ok ? x : 0) * p.w1_stride;
    }
    segment(p.rank, p.rank, in, pairs_aligned(w1, p.w1_stride), valid, std::true_type{});
  }
  {  // s_j: zeros at slot 0 (multiplied, as the reference does, but not read)
    const float* in[kHeadRequests];
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) in[q] = p.state + int64_t{request[q]} * p.rank;
    if (p.slot > 0) {
      segment(0, p.rank, in, pairs_aligned(p.state, p.rank), ~0u, Unmasked{});
    } else {
      segment(0, p.rank, in, pairs_aligned(p.state, p.rank), 0u, std::true_type{});
    }
  }
  // h_j, its dtype dispatched once, outside the loops.
  const auto hidden_segment = [&](auto* hidden) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(hidden)>>;
    const T* in[kHeadRequests];
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      in[q] = hidden + request[q] * p.hidden_stride_b + p.slot * p.hidden_stride_j;
    }
    segment(2 * p.rank, p.hidden_size, in,
            pairs_aligned(hidden, p.hidden_stride_b, p.hidden_stride_j), ~0u, Unmasked{});
  };
  switch (p.hidden_type) {
    case kElementBFloat16: hidden_segment(static_cast<const __nv_bfloat16*>(p.hidden)); break;
    case kElementHalf: hidden_segment(static_cast<const __half*>(p.hidden)); break;
    default: hidden_segment(static_cast<const float*>(p.hidden)); break;
  }
#pragma unroll
  for (int r = 0; r < kHeadRowsPerWarp; ++r) {
#pragma unroll
    for (int q = 0; q < kHeadRequests; ++q) {
      float v = acc[r][q];
#pragma unroll
      for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
      const int b = b0 + q;
      if (lane == 0 && b < p.batch && row0 + r < rows) {
        p.preactivation[int64_t{b} * rows + row0 + r] =
            fabsf(v) < kExactHeadAbove ? v + to_float(static_cast<const W*>(p.joint_bias)[row0 + r])
                                       : exact_preactivation<W>(p, b, row0 + r);
      }
    }
  }
}

// The same product on tensor cores for 16-bit weights W: block (x, y) owns the 16 x 8 output tile
// of rows 16x .. 16x + 16 and requests 8y .. 8y + 8; its eight warps split each input segment's
// 16-column steps (warp w takes steps w, w + 8, ...), each accumulating its share of the tile with
// mma.sync m16n8k16 (J rows as A, the requests' inputs as B, float32 accumulators), and the warps'
// partial tiles are summed in warp order, so a request's sums do not depend on the batch. An input
// of type W is exact in one B fragment; any other (the float32 state, a hidden state of another
// type) enters as three W parts, hi + mid + lo, which carry float32's 24-bit significand (bf16:
// 3 x 8 bits; fp16 past its range's lower end loses only bits below 2^-24), so the products are
// those of the float32 inputs. Rows past 3r and requests past B read the last valid one and are
// not stored.
constexpr int kHeadMmaWarps = 8;
constexpr int kHeadMmaThreads = 32 * kHeadMmaWarps;
// Three blocks an SM (80 registers): at B 64, r 256 the 48 x 8 blocks are all resident at once on
// a 132-SM GPU, where the compiler's own choice for rounds of eight steps (128) allows two.
constexpr int kHeadMmaBlocksPerSm = 3;
// The most steps whose loads a warp issues together, before their MMAs (head_mma_segment): one
// HBM round trip for the round. Seven steps of pair loads of 16-bit inputs hold 42 registers of
// loads; within 80 registers ptxas issued only 38 of eight steps' 48 before the first MMA (two
// round trips), all of seven's. An input converted to three parts (float32) takes two more load
// words a step, and unaligned rows load each element apart (twice the registers): four and two.
constexpr int kHeadRound16 = 7;
constexpr int kHeadRoundFloat = 4;
constexpr int kHeadRoundUnaligned = 2;

template <typename W>
__device__ __forceinline__ uint16_t head_bits(W v) {
  uint16_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Elements k, k + 1 of `row` as a packed pair of W (the lower index in the low half); with
// kGuarded, zero from `len` on. One 32-bit load when kAligned and both are read.
template <bool kAligned, bool kGuarded, typename W>
__device__ __forceinline__ uint32_t head_weight_pair(const W* row, int k, int len) {
  if (kAligned && (!kGuarded || k + 1 < len)) {
    return __ldg(reinterpret_cast<const unsigned int*>(row + k));
  }
  const uint32_t lo = !kGuarded || k < len ? head_bits(row[k]) : 0u;
  const uint32_t hi = !kGuarded || k + 1 < len ? head_bits(row[k + 1]) : 0u;
  return lo | (hi << 16);
}

// Elements k, k + 1 of an input row as floats (kGuarded: zero from `len` on).
template <bool kAligned, bool kGuarded, typename T>
__device__ __forceinline__ float2 head_input_pair(const T* row, int k, int len) {
  if (kAligned && (!kGuarded || k + 1 < len)) return load_pair<true>(row + k);
  return make_float2(!kGuarded || k < len ? to_float(row[k]) : 0.f,
                     !kGuarded || k + 1 < len ? to_float(row[k + 1]) : 0.f);
}

template <typename W>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return static_cast<uint32_t>(head_bits(from_float<W>(lo))) |
         (static_cast<uint32_t>(head_bits(from_float<W>(hi))) << 16);
}

// acc += the 16 x 8 x 16 product of the step whose lane columns are k, k + 1, k + 8, k + 9 (of
// the segment starting at column k0 of J): `jg` and `jg8` are rows g and g + 8 of the tile, `in`
// the lane's request's segment row (its B column g); `valid` false reads zeros (an id outside
// [0, V)). kGuarded: the segment's last, partial step (columns from `len` on are zero).
template <bool kAligned, bool kGuarded, typename W, typename T>
__device__ __forceinline__ void head_mma_step(const W* jg, const W* jg8, int k, int len,
                                              const T* in, bool valid, float (&acc)[4]) {
  const uint32_t a0 = head_weight_pair<kAligned, kGuarded>(jg, k, len);
  const uint32_t a1 = head_weight_pair<kAligned, kGuarded>(jg8, k, len);
  const uint32_t a2 = head_weight_pair<kAligned, kGuarded>(jg, k + 8, len);
  const uint32_t a3 = head_weight_pair<kAligned, kGuarded>(jg8, k + 8, len);
  if constexpr (std::is_same_v<T, W>) {  // exact in one fragment
    const uint32_t b0 = valid ? head_weight_pair<kAligned, kGuarded>(in, k, len) : 0u;
    const uint32_t b1 = valid ? head_weight_pair<kAligned, kGuarded>(in, k + 8, len) : 0u;
    mma_m16n8k16<W>(acc, a0, a1, a2, a3, b0, b1);
  } else {
    float2 x0 = valid ? head_input_pair<kAligned, kGuarded>(in, k, len) : make_float2(0.f, 0.f);
    float2 x1 = valid ? head_input_pair<kAligned, kGuarded>(in, k + 8, len) : make_float2(0.f, 0.f);
#pragma unroll
    for (int part = 0; part < 3; ++part) {  // hi, mid, lo: each the W rounding of what is left
      mma_m16n8k16<W>(acc, a0, a1, a2, a3, pack_pair<W>(x0.x, x0.y), pack_pair<W>(x1.x, x1.y));
      const auto rest = [](float v) { return v - to_float(from_float<W>(v)); };
      x0 = make_float2(rest(x0.x), rest(x0.y));
      x1 = make_float2(rest(x1.x), rest(x1.y));
    }
  }
}

// The round size of a segment's loop (kHeadRound16 and the two after it).
template <bool kAligned, typename W, typename T>
constexpr int head_round_steps() {
  return !kAligned ? kHeadRoundUnaligned : std::is_same_v<T, W> ? kHeadRound16 : kHeadRoundFloat;
}

// Steps step, step + 8, ... in rounds of kRound (each round's loads issued before its MMAs) while
// a whole round is left; returns the first step not taken.
template <int kRound, bool kAligned, typename W, typename T>
__device__ __forceinline__ int head_mma_rounds(const W* jg, const W* jg8, int step, int whole,
                                               int len, const T* in, bool valid, int t,
                                               float (&acc)[4]) {
#pragma unroll 1
  for (; step + (kRound - 1) * kHeadMmaWarps < whole; step += kRound * kHeadMmaWarps) {
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      head_mma_step<kAligned, false>(jg, jg8, 16 * (step + i * kHeadMmaWarps) + 2 * t, len, in,
                                     valid, acc);
    }
  }
  return step;
}

// acc += J[rows, k0 + k] x in[k] over k in [0, len): the warp's share of the segment's 16-column
// steps (w, w + 8, ...), the whole ones in rounds of head_round_steps, then at most one round
// each of 4, 2 and 1 steps for the rest, so a share of n steps waits on about n / 7 round trips
// and at most three more; then the partial last step if it is the warp's. The MMAs run in step
// order whatever the rounds, so the sums are those of one step at a time.
template <bool kAligned, typename W, typename T>
__device__ __forceinline__ void head_mma_segment(const W* jg, const W* jg8, int k0, int len,
                                                 const T* in, bool valid, int warp, int lane,
                                                 float (&acc)[4]) {
  constexpr int kRound = head_round_steps<kAligned, W, T>();
  const int t = lane & 3, whole = len / 16;
  jg += k0, jg8 += k0;
  int step = head_mma_rounds<kRound, kAligned>(jg, jg8, warp, whole, len, in, valid, t, acc);
  if constexpr (kRound > 4) {
    step = head_mma_rounds<4, kAligned>(jg, jg8, step, whole, len, in, valid, t, acc);
  }
  if constexpr (kRound > 2) {
    step = head_mma_rounds<2, kAligned>(jg, jg8, step, whole, len, in, valid, t, acc);
  }
  step = head_mma_rounds<1, kAligned>(jg, jg8, step, whole, len, in, valid, t, acc);
  if (16 * step < len) {
    head_mma_step<kAligned, true>(jg, jg8, 16 * step + 2 * t, len, in, valid, acc);
  }
}

template <typename W>
__global__ void __launch_bounds__(kHeadMmaThreads, kHeadMmaBlocksPerSm)
    rnn_head_mma_kernel(const DraftParams p) {
  wait_for_previous_grid();  // a dependent launch after the previous slot's: its state, tokens
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rows = 3 * p.rank, row0 = blockIdx.x * 16, b0 = blockIdx.y * 8;
  const W* joint_weight = static_cast<const W*>(p.joint_weight);
  const W* jg = joint_weight + int64_t{min(row0 + g, rows - 1)} * p.joint_stride;
  const W* jg8 = joint_weight + int64_t{min(row0 + g + 8, rows - 1)} * p.joint_stride;
  const int request = min(b0 + g, p.batch - 1);  // the lane's B column
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // Each segment's loop with pair loads when J's and the segment's rows are pair-aligned.
  const auto segment = [&](int k0, int len, const auto* in, bool in_aligned, bool valid) {
    if (in_aligned && pairs_aligned(joint_weight, p.joint_stride, k0)) {
      head_mma_segment<true>(jg, jg8, k0, len, in, valid, warp, lane, acc);
    } else {
      head_mma_segment<false>(jg, jg8, k0, len, in, valid, warp, lane, acc);
    }
  };
  // s_j: zeros at slot 0 (multiplied, as the reference does, but not read).
  segment(0, p.rank, p.state + int64_t{request} * p.rank, pairs_aligned(p.state, p.rank),
          p.slot > 0);
  {  // W1[x_j]: a zero row for an id outside [0, V)
    const W* w1 = static_cast<const W*>(p.w1);
    const int64_t x = previous_token(p, request);
    const bool ok = x >= 0 && x < p.vocab;
    segment(p.rank, p.rank, w1 + (ok ? x : 0) * p.w1_stride, pairs_aligned(w1, p.w1_stride), ok);
  }
  // h_j, its dtype dispatched once, outside the loops.
  const auto hidden_segment = [&](const auto* hidden) {
    segment(2 * p.rank, p.hidden_size,
            hidden + request * p.hidden_stride_b + p.slot * p.hidden_stride_j,
            pairs_aligned(hidden, p.hidden_stride_b, p.hidden_stride_j), true);
  };
  switch (p.hidden_type) {
    case kElementBFloat16: hidden_segment(static_cast<const __nv_bfloat16*>(p.hidden)); break;
    case kElementHalf: hidden_segment(static_cast<const __half*>(p.hidden)); break;
    default: hidden_segment(static_cast<const float*>(p.hidden)); break;
  }
  // The warps' partial tiles, summed in warp order by warp 0 (C fragment: rows g, g + 8, requests
  // 2t, 2t + 1).
  __shared__ float partial[kHeadMmaWarps][32][4];
#pragma unroll
  for (int e = 0; e < 4; ++e) partial[warp][lane][e] = acc[e];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kHeadMmaWarps; ++w) sum += partial[w][lane][e];
    const int row = row0 + g + 8 * (e >> 1), b = b0 + 2 * t + (e & 1);
    if (row < rows && b < p.batch) {
      p.preactivation[int64_t{b} * rows + row] =
          fabsf(sum) < kExactHeadAbove ? sum + to_float(static_cast<const W*>(p.joint_bias)[row])
                                       : exact_preactivation<W>(p, b, row);
    }
  }
}

}  // namespace dspark_ops::kernels
