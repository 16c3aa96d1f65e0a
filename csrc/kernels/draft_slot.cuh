// The slot kernel of markov_draft and rnn_draft (docs/semantics.md §3.2), torch-free: one launch
// per slot j computes z = draft_logits over the whole vocabulary for every request and draws the
// slot's tokens (G launches, no host work between).
//
// Grid (tiles, request groups): a block takes up to 64 requests and its warps walk 16-row tiles
// of the vocabulary, interleaved over the grid so every block gets the same share to within one
// tile. Its prologue gathers the group's bias inputs (markov_draft: W1[x_j], x_j = the anchor, or
// the token the previous launch wrote; rnn_draft: the activation tanh(o) of the RNN head,
// draft_rnn_head.cuh) into shared memory, every thread's loads in flight together; per tile a
// warp multiplies 16 rows of W2 by all of them with mma.sync m16n8k16 (bf16/fp16 in, float32
// accumulate; float32 weights use CUDA-core FMAs in the same register layout), so W2 is read from
// HBM once per slot for up to 64 requests. The slot is a skinny GEMM (M = V, N = the group,
// K = r) with its epilogue overlapped. With 16-bit weights three blocks share an SM (80 registers:
// the busiest warp walks 3 tiles instead of 5 at V 151,936), so a lane holds the accumulators of 4
// column tiles and a tile's column tiles go in sweeps of 4 (kSweepTiles), each sweep its products
// then its epilogue calls. 16-bit W2 streams through a per-warp ring of k chunks in shared memory
// (cp.async, 2-8 stages: W2Stream) once per sweep, issued ahead across sweeps and tiles, so the
// next sweep's chunks load during this sweep's epilogue; each lane copies and reads back only its
// own fragments (4-byte copies that land in the MMAs' register order: no moves), so the ring
// needs no barrier. The group's inputs are laid out k chunk by k chunk (input_index), so a
// column tile's fragments sit at fixed offsets. The ring's first chunks are issued before
// anything else, ahead of the wait for the previous launch of the walk (a programmatic dependent
// launch, kernels/draft.cuh). Base logits are loaded two column tiles ahead of their epilogue
// call. rnn_draft's activation enters as a high and a low 16-bit part (two MMAs against the same
// W2 fragments: ~16-bit mantissa instead of 8). The products are the same MMAs in the same order
// as a plain load of each chunk would feed them, so z does not depend on the ring. The
// epilogue (base logits of the kernel's Base type) adds the base logits, stores z = draft_logits
// (float32, or z rounded to bfloat16, a runtime choice: the key is then that of the rounded
// value), and computes Gumbel-max keys z/T - log(-log1p(-u)) with Philox uniforms (a lane
// computes one Philox block and a 4 x 4 transpose by shuffles hands each lane its words, so no
// block is computed twice). A token's logarithms are needed only when a cheap exact bound of its
// key (key_bound: no logarithm) reaches the best key known so far; a warp computes them only when
// one of its lanes needs them (a warp vote), which after the first tiles is rare. Warp maxima go
// straight to the slot's packed 64-bit maxima in global memory (atomicMax, key order then lower
// id; only where they can still win), and each block folds the grid's maxima into its shared best
// keys once per tile. The last block of the group to arrive (threadfence + arrival counter)
// writes the tokens, which the next slot's launch reads, and returns the group's keys and counter
// to zero (they live in a buffer kept per stream, not filled per call: common/stream_counters.h).
// For rnn_draft the blocks then advance the state. One launch per slot rather than a persistent
// kernel with a grid barrier per slot, which would need the whole grid co-resident
// (docs/performance-model.md, "Why the launch constants are what they are").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cuda/atomic>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "async_copy.cuh"
#include "convert.cuh"
#include "draft_math.h"
#include "draft_params.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "sampling_math.h"

namespace dspark_ops::kernels {

constexpr int kKChunk = 32;                  // k per fragment load (two m16n8k16 steps)
// The W2 ring of 16-bit weights: each warp keeps DraftParams::stages k chunks of its tiles in
// flight (kMinW2Stages to kMaxW2Stages). A lane copies (cp.async) and later reads back only its
// own fragments, so the ring needs no barrier.
constexpr int kW2StageBytes = kDraftWarps * 32 * 32;  // one chunk of every warp: 32 bytes a lane
// Shared memory a slot block keeps besides its group's inputs: the static GroupSampling and the
// 1 KB the runtime reserves per block.
constexpr int kSlotSharedReserve = 5 * 1024;
// The group's inputs when the device cannot be queried: below the 48 KB that needs no opt-in.
constexpr int kFallbackInputBytes = 44 * 1024;

// Column tiles per sweep of a tile's W2 chunks: kSweepTiles for 16-bit weights (16 accumulators a
// lane within 80 registers; a group of more than 32 requests streams each tile's chunks once per
// sweep, the later times mostly from L2), all of them for float32 weights.
template <typename W>
constexpr int sweep_tiles() { return sizeof(W) == 2 ? kSweepTiles : kMaxGroup / 8; }

__host__ __device__ constexpr int padded_rank(int rank) { return (rank + kKChunk - 1) / kKChunk * kKChunk; }

// Where input k of request i (pass `pass`) of the group's bias inputs lives in shared memory
// (elements). 16-bit inputs are [pass][k chunk][request][32 k]: a request's k chunk is one
// 64-byte row, so the MMA fragments of column tile nt sit at fixed offsets (nt x 512 bytes) from a
// lane's chunk base, and a quarter warp's 16-byte reads (two requests' whole rows) fall on
// distinct banks. float32 inputs (the CUDA-core path) are [request][padded rank + 4]: the 16 extra
// bytes keep one quarter warp's reads on distinct banks.
template <typename W>
__host__ __device__ constexpr int input_index(int pass, int i, int k, int group_size,
                                              int padded) {
  if (sizeof(W) == 2) {
    return ((pass * (padded / kKChunk) + k / kKChunk) * group_size + i) * kKChunk + k % kKChunk;
  }
  return (pass * group_size + i) * (padded + 4) + k;
}

// Passes over W2 per tile: the RNN activation enters 16-bit MMAs as a high and a low part.
template <typename W, bool kRnn>
constexpr int input_passes() { return kRnn && sizeof(W) == 2 ? 2 : 1; }

// The group's bias inputs (a multiple of 64 bytes for 16-bit weights: the ring after them stays
// 16-byte aligned).
template <typename W, bool kRnn>
__host__ __device__ int draft_input_bytes(int group_size, int rank) {
  return input_index<W>(input_passes<W, kRnn>(), 0, 0, group_size, padded_rank(rank)) *
         int{sizeof(W)};
}

// Dynamic shared memory: the inputs, then for 16-bit weights the W2 ring of `stages` chunks.
template <typename W, bool kRnn>
__host__ int draft_shared_bytes(int group_size, int rank, int stages) {
  return draft_input_bytes<W, kRnn>(group_size, rank) + (sizeof(W) == 2 ? stages * kW2StageBytes : 0);
}

// ------------------------------------------------------------------------------------------------
// Tensor-core fragments. Lane (g = lane / 4, t = lane % 4) of a warp owns W2 rows g and g + 8 of
// its 16-row tile and, for each k chunk of 32, the 8 consecutive k at 8t: that is one 16-byte
// load per row, feeding two m16n8k16 MMAs. The MMA's k positions {2t, 2t+1, 2t+8, 2t+9} map to
// k = 8t + {0..3} in the first MMA and 8t + {4..7} in the second; the B fragment (bias inputs of
// request g of the column tile) uses the same map, so the sum over k is unchanged. An MMA's A
// fragment alternates the two rows ({row g, row g + 8} words 0, 1, then 2, 3), so the W2 ring
// keeps each lane's words in that order (W2Stream).

// Eight k values of one W2 row starting at k (zero past the rank or past the vocabulary).
template <typename W>
__device__ __forceinline__ uint4 load_w2_8(const DraftParams& p, int64_t v, int k) {
  uint4 out = make_uint4(0, 0, 0, 0);
  if (v >= p.vocab || k >= p.rank) return out;
  const W* row = static_cast<const W*>(p.w2) + v * p.w2_stride;
  if (p.w2_aligned && k + 8 <= p.rank) return __ldg(reinterpret_cast<const uint4*>(row + k));
  W* e = reinterpret_cast<W*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = k + i < p.rank ? row[k + i] : from_float<W>(0.f);
  return out;
}

// The warp's stream of W2 chunks through its ring: each of the warp's tiles' chunks once per sweep
// (stream chunk n is k chunk n % chunks of sweep (n / chunks) % sweeps of the warp's
// (n / (chunks sweeps))-th tile), in ring slot n % stages. Chunks are issued `stages` ahead of
// their use and across sweeps and tiles, so the next sweep's first chunks load during this sweep's
// epilogue; a tile's later sweeps read its rows again (from L2, a few microseconds later).
struct W2Stream {
  uint4* ring;  // this warp's [stages][2 MMAs][32 lanes] A fragments
  int stages, chunks;
  int64_t tile, tile_stride, tiles;  // the tile of the next chunk to issue, the walk's step, end
  const char* rows[2];  // the lane's W2 rows g, g + 8 of that tile (row 0 past the vocabulary)
  int rows_left;        // vocabulary rows from that tile's first (rows past them are zero-filled)
  int k;                // the lane's first k of the next chunk: 32 chunk + 8t
  int vector_end;       // k + 8 at most this: one 16-byte copy (the rank; 0 for unaligned rows)
  int sweeps, sweep;    // streams of each tile's chunks, and the sweep of the next chunk to issue
  int issued, used;     // stream chunks issued and used
};

template <typename W>
__device__ __forceinline__ void w2_stream_rows(const DraftParams& p, W2Stream& w) {
  const int g = (threadIdx.x & 31) >> 2;
  w.rows_left = p.vocab - w.tile * 16 < 16 ? static_cast<int>(p.vocab - w.tile * 16) : 16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t v = g + 8 * h < w.rows_left ? w.tile * 16 + g + 8 * h : 0;
    w.rows[h] = reinterpret_cast<const char*>(static_cast<const W*>(p.w2) + v * p.w2_stride);
  }
}

// The warp's stream from its first tile, `first_tile` + i `tile_stride` below `tiles`, each tile's
// chunks `sweeps` times.
template <typename W>
__device__ __forceinline__ void w2_stream_start(const DraftParams& p, W2Stream& w, uint4* ring,
                                                int64_t first_tile, int64_t tile_stride,
                                                int64_t tiles, int sweeps) {
  w.ring = ring;
  w.stages = p.stages;
  w.chunks = padded_rank(p.rank) / kKChunk;
  w.tile = first_tile;
  w.tile_stride = tile_stride;
  w.tiles = tiles;
  w.k = 8 * (threadIdx.x & 3);
  w.vector_end = p.w2_aligned ? p.rank : 0;
  w.sweeps = sweeps;
  w.sweep = 0;
  w.issued = w.used = 0;
  if (first_tile < tiles) w2_stream_rows<W>(p, w);
}

// Where word m (0..3) of row g + 8h's 16 bytes goes among the 8 words of a lane's slot: the two
// MMAs' A fragments, {row g, row g + 8} words 0, 1 in the first and 2, 3 in the second (the
// second fragment 32 lanes' 16 bytes further on).
__device__ __forceinline__ constexpr int fragment_word(int m, int h) {
  return 128 * (m >> 1) + 2 * (m & 1) + h;
}

// Issues the stream's next chunk into its slot (the slot's previous chunk has been used) and
// commits its group (empty past the warp's last tile) and kMaxW2Stages / stages - 1 empty ones
// (wait_w2). A slot holds each lane's words in the order of its two MMAs' A fragments (rows g and
// g + 8 alternating: 4-byte copies), so the lane reads them back with two 16-byte loads and no
// register moves.
template <typename W>
__device__ __forceinline__ void issue_w2(const DraftParams& p, W2Stream& w) {
  if (w.tile < w.tiles) {
    uint32_t* slot = reinterpret_cast<uint32_t*>(w.ring + (w.issued & (w.stages - 1)) * 64 +
                                                 (threadIdx.x & 31));
    if (w.k + 8 <= w.vector_end) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const char* src = w.rows[h] + w.k * int{sizeof(W)};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          copy_async_4(slot + fragment_word(m, h), src + 4 * m,
                       ((threadIdx.x & 31) >> 2) + 8 * h < w.rows_left);
        }
      }
    } else {
      // Unaligned rows and the rank's tail: plain loads; zeros past the vocabulary or the rank.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = load_w2_8<W>(p, w.tile * 16 + ((threadIdx.x & 31) >> 2) + 8 * h, w.k);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) slot[fragment_word(m, h)] = words[m];
      }
    }
    w.k += kKChunk;
    if (w.k >= w.chunks * kKChunk) {
      w.k -= w.chunks * kKChunk;
      if (++w.sweep == w.sweeps) {
        w.sweep = 0;
        w.tile += w.tile_stride;
        if (w.tile < w.tiles) w2_stream_rows<W>(p, w);
      }
    }
  }
  for (int i = 0; i < kMaxW2Stages; i += w.stages) copy_async_commit();
  ++w.issued;
}

// Returns once stream chunk w.used has landed: every step of the stream commits
// kMaxW2Stages / stages groups (the chunk's, then empty ones), so the groups after the chunk's
// are kMaxW2Stages - 1 at any ring depth and one wait serves them all.
__device__ __forceinline__ void wait_w2() { copy_async_wait<kMaxW2Stages - 1>(); }

// acc[nt] += W2[16 rows] x inputs[column tile nt0 + nt] over all k, for 16-bit weights and
// kColumnTiles column tiles of a sweep: the tile's chunks from the ring, each slot refilled with
// the chunk `stages` ahead once its MMAs are issued (their operands are read from it by then).
template <typename W, int kPasses, int kColumnTiles, int kSweep>
__device__ __forceinline__ void tile_products_n(const DraftParams& p, W2Stream& w2,
                                                const W* inputs, int nt0,
                                                float (&acc)[kSweep][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunk_elems = p.group_size * kKChunk;  // one k chunk of the group's inputs
  const W* lane_inputs = inputs + (nt0 * 8 + g) * kKChunk + 8 * t;
  for (int c = 0; c < w2.chunks; ++c) {
    wait_w2();
    const uint4* slot = w2.ring + (w2.used & (w2.stages - 1)) * 64 + lane;
    const uint4 a0 = slot[0], a1 = slot[32];
    ++w2.used;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
#pragma unroll
      for (int nt = 0; nt < kColumnTiles; ++nt) {
        const W* in = lane_inputs + (pass * w2.chunks + c) * chunk_elems + nt * 8 * kKChunk;
        const uint4 b = *reinterpret_cast<const uint4*>(in);
        mma_m16n8k16<W>(acc[nt], a0.x, a0.y, a0.z, a0.w, b.x, b.y);
        mma_m16n8k16<W>(acc[nt], a1.x, a1.y, a1.z, a1.w, b.z, b.w);
      }
    }
    issue_w2<W>(p, w2);
  }
}

// The products for column tiles nt0 .. nt0 + n - 1 (n of 1..kSweep): one unrolled loop per count,
// no branch per column tile.
template <typename W, int kPasses, int kSweep, int kN = 1>
__device__ __forceinline__ void tile_products(const DraftParams& p, W2Stream& w2,
                                              const W* inputs, int nt0, int n,
                                              float (&acc)[kSweep][4]) {
  if constexpr (kN < kSweep) {
    if (n > kN) return tile_products<W, kPasses, kSweep, kN + 1>(p, w2, inputs, nt0, n, acc);
  }
  tile_products_n<W, kPasses, kN, kSweep>(p, w2, inputs, nt0, acc);
}

// The same products for float32 weights on CUDA cores, in the MMA's accumulator layout: lane
// (g, t) sums over all k for rows g, g + 8 and requests 2t, 2t + 1 of each column tile.
__device__ __forceinline__ void tile_products_f32(const DraftParams& p, int64_t row0,
                                                  const float* inputs, int column_tiles,
                                                  float (&acc)[kMaxGroup / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int padded = padded_rank(p.rank);
  const float* rows[2] = {nullptr, nullptr};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t v = row0 + g + 8 * h;
    if (v < p.vocab) rows[h] = static_cast<const float*>(p.w2) + v * p.w2_stride;
  }
  for (int k = 0; k < p.rank; k += 4) {
    float a[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows[h] && p.w2_aligned && k + 4 <= p.rank) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(rows[h] + k));
        a[h][0] = f.x, a[h][1] = f.y, a[h][2] = f.z, a[h][3] = f.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[h][e] = rows[h] && k + e < p.rank ? rows[h][k + e] : 0.f;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kMaxGroup / 8; ++nt) {
      if (nt >= column_tiles) break;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 b = *reinterpret_cast<const float4*>(
            inputs + input_index<float>(0, nt * 8 + 2 * t + q, k, p.group_size, padded));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& c = acc[nt][2 * h + q];
          c = fmaf(a[h][0], b.x, c);
          c = fmaf(a[h][1], b.y, c);
          c = fmaf(a[h][2], b.z, c);
          c = fmaf(a[h][3], b.w, c);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Epilogue helpers.

// A lane's warp index, through a shuffle so the compiler knows it is warp-uniform (branches on it
// then keep the warp converged, and the epilogue's shuffles need no divergence handling).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0); }

// The key of an ordered word (pack_candidate's high half); -inf for 0, "no candidate".
__device__ __forceinline__ float ordered_key(uint32_t ordered) {
  if (ordered == 0) return -INFINITY;
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

// An upper bound of the Gumbel key zt - log(E), E = -log1p(-u), for u in [2^-33, 1), without a
// logarithm: E >= u, and log2(u) = e + log2(m) >= e + m - 1 for u = m 2^e, m in [1, 2) (log2 is
// concave), which is u's bit pattern read as an integer times 2^-23, minus 127; so
// -log(E) <= 127 ln 2 - (ln 2) 2^-23 bits(u), within 0.06 of -log(u). Its float rounding
// (< 2e-5 + 2e-7 |zt|) and the key's (logf, log1pf: < 3e-5 + 3e-7 |zt|) are far inside the
// margin of the threshold the bound is compared with (tile_epilogue).
__device__ __forceinline__ float key_bound(float zt, float u) {
  constexpr float kLn2Ulp = 0x1.62e42ep-24f;  // (ln 2) 2^-23, rounded down
  constexpr float k127Ln2 = 0x1.601e68p+6f;   // 127 ln 2, rounded up
  return fmaf(static_cast<float>(__float_as_uint(u)), -kLn2Ulp, zt + k127Ln2);
}

struct GroupSampling {
  float inv_t[kMaxGroup];
  int64_t seed[kMaxGroup];
  int64_t position[kMaxGroup];  // p0 + 1 + j
  int64_t source[kMaxGroup];    // W1 row (Markov) or request (RNN) of the bias input; -1: zero
  const void* base_row[kMaxGroup];  // base_logits[b, j] (of the kernel's Base type)
  void* out_row[kMaxGroup];         // draft_logits[b, j] (float32 or bfloat16)
  // Best key known so far per request as pack_candidate's high word (0: none): this block's own
  // and, refreshed every tile, the grid's. A token whose key is below it cannot win.
  uint32_t seen[kMaxGroup];
  bool greedy[kMaxGroup];
  bool any_sampled;
};
static_assert(sizeof(GroupSampling) + 1024 <= kSlotSharedReserve, "kSlotSharedReserve too small");

// Fills the group's bias inputs (kPasses planes of [group, stride] W values) and sampling state.
// Each thread resolves one request's source first, then all loads of the rows are independent:
// one round trip for the whole gather instead of a few per request.
template <typename W, typename Base, bool kRnn>
__device__ void load_group(const DraftParams& p, int first, int members, W* inputs,
                           GroupSampling& s) {
  constexpr int kPasses = input_passes<W, kRnn>();
  constexpr int kBatch = 8;  // loads in flight per thread
  const int width = padded_rank(p.rank);
  for (int i = threadIdx.x; i < p.group_size; i += blockDim.x) {
    const int b = first + i;
    const float temperature = i < members ? p.temperature[b] : 0.f;
    s.greedy[i] = is_greedy(temperature);
    s.inv_t[i] = s.greedy[i] ? 1.f : 1.f / temperature;
    s.seed[i] = i < members ? p.seed[b] : 0;
    s.position[i] = i < members ? offset_position(p.position[b], 1 + p.slot) : 0;
    s.seen[i] = 0;
    s.base_row[i] = i < members ? static_cast<const Base*>(p.base) + int64_t{b} * p.base_stride_b +
                                      int64_t{p.slot} * p.base_stride_j
                                : nullptr;
    s.out_row[i] = i < members ? static_cast<char*>(p.draft_logits) +
                                     (int64_t{b} * p.block + p.slot) * p.vocab *
                                         (p.logits_bf16 ? 2 : 4)
                               : nullptr;
    int64_t source = -1;
    if (i < members && kRnn) source = b;
    if (i < members && !kRnn) {
      const int64_t x = previous_token(p, b);
      if (x >= 0 && x < p.vocab) source = x;
    }
    s.source[i] = source;
  }
  __syncthreads();
  const int threads = blockDim.x;
  // 16-byte rows of W1: one vector load per 16 bytes (a chunk past the rank is partly zero).
  constexpr int kVec = 16 / int{sizeof(W)};
  if (!kRnn && p.w1_aligned) {
    const int chunks = width / kVec, items = p.group_size * chunks;
    for (int base = threadIdx.x; base < items; base += kBatch * threads) {
      uint4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / chunks, k = (idx % chunks) * kVec;
        v[j] = make_uint4(0, 0, 0, 0);
        const int64_t x = idx < items ? s.source[i] : -1;
        if (x < 0 || k >= p.rank) continue;
        const W* row = static_cast<const W*>(p.w1) + x * p.w1_stride + k;
        if (k + kVec <= p.rank) {
          v[j] = __ldg(reinterpret_cast<const uint4*>(row));
        } else {
          W* e = reinterpret_cast<W*>(&v[j]);
          for (int m = 0; m < kVec && k + m < p.rank; ++m) e[m] = row[m];
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads;
        if (idx < items) {
          *reinterpret_cast<uint4*>(inputs + input_index<W>(0, idx / chunks, (idx % chunks) * kVec,
                                                            p.group_size, width)) = v[j];
        }
      }
    }
  } else {
    const int items = p.group_size * width;
    for (int base = threadIdx.x; base < items; base += kBatch * threads) {
      float value[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / width, k = idx % width;
        const int64_t source = idx < items ? s.source[i] : -1;
        value[j] = 0.f;
        if (source < 0 || k >= p.rank) continue;
        if (kRnn) {
          value[j] = __ldg(p.preactivation + (source * 3 + 2) * p.rank + k);
        } else {
          value[j] = to_float(static_cast<const W*>(p.w1)[source * p.w1_stride + k]);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int idx = base + j * threads, i = idx / width, k = idx % width;
        if (idx >= items) continue;
        const float v = kRnn ? tanhf(value[j]) : value[j];  // tanh(0) = 0 for the padding
        const W hi = from_float<W>(v);
        inputs[input_index<W>(0, i, k, p.group_size, width)] = hi;
        if (kPasses == 2) {
          inputs[input_index<W>(1, i, k, p.group_size, width)] = from_float<W>(v - to_float(hi));
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool any = false;
    for (int i = 0; i < members; ++i) any = any || !s.greedy[i];
    s.any_sampled = any;
  }
  __syncthreads();
}

// A relaxed read of a shared word that other threads update atomically.
__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const volatile uint32_t*>(p);  // one LDS (an atomic_ref load is generic)
#else
  return cuda::atomic_ref<uint32_t, cuda::thread_scope_block>(*const_cast<uint32_t*>(p))
      .load(cuda::memory_order_relaxed);
#endif
}


// z = fl32(W2[v] . x + base) with the dot product in float64 for request b's bias input (the
// previous token's W1 row, or tanh(o) of the RNN head's float32 preactivation); `source` is
// s.source (-1: a zero input). The rare path of tile_epilogue: one lane, global memory only.
template <typename W, bool kRnn>
__device__ float exact_head_logit(const DraftParams& p, int64_t source, int64_t v,
                                  float base) {
  double bias = 0.0;
  if (source >= 0) {
    const W* w2 = static_cast<const W*>(p.w2) + v * p.w2_stride;
    for (int k = 0; k < p.rank; ++k) {
      const float x = kRnn ? tanhf(p.preactivation[(source * 3 + 2) * p.rank + k])
                           : to_float(static_cast<const W*>(p.w1)[source * p.w1_stride + k]);
      bias += static_cast<double>(to_float(w2[k])) * static_cast<double>(x);
    }
  }
  return static_cast<float>(bias + static_cast<double>(base));
}

// Column tile nt's base logits of a lane (c[e]: row g + 8 (e / 2), request 2t + e % 2; zero past
// the vocabulary or the group), loaded two column tiles before their epilogue call.
template <typename Base>
__device__ __forceinline__ void load_base(const DraftParams& p, const GroupSampling& s,
                                          int64_t row0, int members, int nt, Base (&out)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int h = e >> 1, i = nt * 8 + 2 * t + (e & 1);
    const int64_t v = row0 + g + 8 * h;
    out[e] = i < members && v < p.vocab ? __ldg(static_cast<const Base*>(s.base_row[i]) + v)
                                        : from_float<Base>(0.f);
  }
}

// Stores z and folds the keys of one 16-row x 8-request accumulator tile into the slot's maxima
// (`best`, in global memory) and s.seen. `any_sampled` is warp-uniform.
template <typename W, bool kRnn>
__device__ __forceinline__ void tile_epilogue(const DraftParams& p, int64_t row0, int members,
                                              int nt, const float (&c)[4],
                                              const float (&base)[4], bool any_sampled,
                                              GroupSampling& s, unsigned long long* best_out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, quad = g & 3;
  // Philox: the lane at quad position m computes block m of its quad's four, m = (rows g+8?,
  // request 2t+1?); two butterfly stages transpose the quad's 4 x 4 words, so each lane ends with
  // word `quad` (its row's) of all four blocks.
  float u[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  if (any_sampled) {
    const int i_m = nt * 8 + 2 * t + (quad & 1);
    const int64_t v_m = row0 + (g & ~3) + 8 * (quad >> 1);
    const Philox4 block = philox_block(s.seed[i_m], s.position[i_m], kPurposeDraft,
                                       static_cast<uint32_t>(v_m >> 2));
    uint32_t x[4] = {block.x[0], block.x[1], block.x[2], block.x[3]};
#pragma unroll
    for (int stage = 1; stage <= 2; stage <<= 1) {
      const bool upper = (quad & stage) != 0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r & stage) continue;
        const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? x[r] : x[r | stage], stage << 2);
        x[r] = upper ? got : x[r];
        x[r | stage] = upper ? x[r | stage] : got;
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) u[m] = uniform_from_bits(x[m]);
  }
  // Per request q of the lane (2t + q): its state, and the threshold below which a key bound
  // proves a token cannot win: the best key seen so far less a margin far above the float rounding
  // of the bound and of the key (ties are kept: the lower id would win those).
  bool member[2], greedy[2];
  float inv_t[2], threshold[2];
  uint32_t seen[2];
  void* out_row[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int i = nt * 8 + 2 * t + q;
    member[q] = i < members;
    greedy[q] = s.greedy[i];
    inv_t[q] = s.inv_t[i];  // 1 when greedy: z * inv_t = z
    seen[q] = load_relaxed(&s.seen[i]);
    const float seen_key = ordered_key(seen[q]);
    // -inf while none is known; +inf when a key overflowed (only +inf keys can win, by their id).
    threshold[q] = seen_key == INFINITY ? INFINITY : seen_key - 1e-4f * (1.f + fabsf(seen_key));
    out_row[q] = s.out_row[i];
  }
  float key[4];
  bool needs_log[4];
  const bool in_vocab[2] = {row0 + g < p.vocab, row0 + g + 8 < p.vocab};
  float head[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) head[e] = c[e] + base[e];
  // The rare path, one branch per call: a float32 sum that is not finite or too large for its
  // rounding to be trusted is summed again in float64.
  if (!(fabsf(c[0]) < kExactHeadAbove && fabsf(c[1]) < kExactHeadAbove &&
        fabsf(c[2]) < kExactHeadAbove && fabsf(c[3]) < kExactHeadAbove)) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1, q = e & 1;
      if (!(fabsf(c[e]) < kExactHeadAbove) && member[q] && in_vocab[h]) {
        head[e] = exact_head_logit<W, kRnn>(p, s.source[nt * 8 + 2 * t + q], row0 + g + 8 * h,
                                            base[e]);
      }
    }
  }
  // The stored type is chosen once per call (a uniform branch around the loop, not per element).
  const auto store_and_bound = [&](auto bf16) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1, q = e & 1;  // c[e]: row g + 8h, request 2t + q; u[e] is its uniform
      const int64_t v = row0 + g + 8 * h;
      const bool valid = member[q] && in_vocab[h];
      // bfloat16 logits: z is rounded first, and the key below is that of the stored value.
      float z = head[e];
      if constexpr (decltype(bf16)::value) {
        const __nv_bfloat16 rounded = __float2bfloat16_rn(z);
        z = __bfloat162float(rounded);
        if (valid) static_cast<__nv_bfloat16*>(out_row[q])[v] = rounded;
      } else if (valid) {
        static_cast<float*>(out_row[q])[v] = z;
      }
      const bool finite = valid && isfinite(z);
      const float zt = z * inv_t[q];
      const bool may_win = key_bound(zt, u[e]) >= threshold[q];
      needs_log[e] = finite && !greedy[q] && may_win;
      key[e] = finite && (greedy[q] || may_win) ? zt : -INFINITY;
    }
  };
  if (p.logits_bf16) {
    store_and_bound(std::true_type{});
  } else {
    store_and_bound(std::false_type{});
  }
  // The logarithms only when some lane needs them: once the best keys are established, most warps
  // skip them as a whole.
  if (__any_sync(0xffffffffu, needs_log[0] || needs_log[1] || needs_log[2] || needs_log[3])) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (needs_log[e]) key[e] = key[e] - logf(-log1pf(-u[e]));
    }
  }
  // Per request: the lane's better row (row g wins ties: the lower id), a candidate where it can
  // still win against the best key seen ("-inf": none, z / T overflowing; keys are never NaN).
  float best_key[2];
  int32_t best_id[2];
  bool can_win[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const bool upper_row = key[2 + q] > key[q];
    best_key[q] = upper_row ? key[2 + q] : key[q];
    best_id[q] = static_cast<int32_t>(row0 + g + (upper_row ? 8 : 0));
    can_win[q] = best_key[q] > -INFINITY && best_key[q] >= ordered_key(seen[q]);
  }
  // Once the best keys are established almost no warp has such a candidate: it skips the
  // reductions. Else over the 8 lanes of each t (rows) in two 32-bit steps: the largest key, then
  // the lowest id (largest low word) among the lanes holding it; lanes 0..3 publish requests
  // 2t, 2t + 1.
  if (!__any_sync(0xffffffffu, can_win[0] || can_win[1])) return;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const unsigned long long packed = can_win[q] ? pack_candidate(best_key[q], best_id[q]) : 0ull;
    uint32_t hi = static_cast<uint32_t>(packed >> 32);
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, mask));
    uint32_t lo = static_cast<uint32_t>(packed >> 32) == hi ? static_cast<uint32_t>(packed) : 0u;
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) lo = max(lo, __shfl_xor_sync(0xffffffffu, lo, mask));
    const int i = nt * 8 + 2 * t + q;
    if (g == 0 && member[q] && hi != 0) {
      atomicMax(best_out + i, (static_cast<unsigned long long>(hi) << 32) | lo);
      atomicMax(&s.seen[i], hi);
    }
  }
}

// One slot of the block walk (see the file header).
template <typename W, typename Base, bool kRnn>
__global__ void __launch_bounds__(kDraftThreads, slot_blocks_per_sm(sizeof(W) == 2)) draft_slot_kernel(const DraftParams p) {
  constexpr int kPasses = input_passes<W, kRnn>();
  constexpr bool kRing = sizeof(W) == 2;
  constexpr int kSweep = sweep_tiles<W>();
  static_assert(kRing || kSweep == kMaxGroup / 8, "tile_products_f32 takes every column tile");
  DSPARK_EXTERN_SHARED(unsigned char, shared_raw);
  W* inputs = reinterpret_cast<W*>(shared_raw);
  __shared__ GroupSampling s;
  __shared__ bool last;
  const int group = blockIdx.y;
  const int first = group * p.group_size;
  const int members = min(p.group_size, p.batch - first);
  // Warp w of block x takes the 16-row warp tiles w * gridDim.x + x, x + (w + 8) * gridDim.x, ...:
  // the leftover of the last round falls on the low warps of every block, not on whole blocks, so
  // every block holds its share of the vocabulary to within a warp tile and the SMs finish
  // together whichever blocks the hardware pairs on one.
  const int warp = warp_index();
  const int64_t warp_tiles = (p.vocab + 15) / 16;
  const int64_t first_tile = int64_t{warp} * gridDim.x + blockIdx.x;
  const int64_t tile_stride = int64_t{kDraftWarps} * gridDim.x;
  // The ring's first chunks before anything else: no kernel of the block walk writes W2, so they
  // may load while the launch before this one (a dependent launch's) still runs.
  const int column_tiles = (members + 7) / 8;
  W2Stream w2{};
  if constexpr (kRing) {
    uint4* ring = reinterpret_cast<uint4*>(shared_raw +
                                           draft_input_bytes<W, kRnn>(p.group_size, p.rank)) +
                  warp * p.stages * 64;
    w2_stream_start<W>(p, w2, ring, first_tile, tile_stride, warp_tiles,
                      (column_tiles + kSweep - 1) / kSweep);
    for (int i = 0; i < p.stages; ++i) issue_w2<W>(p, w2);
  }
  wait_for_previous_grid();  // the tokens, the RNN head's activations
  load_group<W, Base, kRnn>(p, first, members, inputs, s);
  const bool any_sampled = __any_sync(0xffffffffu, s.any_sampled);  // warp-uniform to the compiler
  unsigned long long* best = p.best + int64_t{p.slot} * p.batch;

  for (int64_t tile = first_tile; tile < warp_tiles; tile += tile_stride) {
    // The grid's best keys so far (other blocks publish theirs as they go), loaded before the
    // products and folded into s.seen after the first sweep's, so the load's latency is hidden.
    unsigned long long grid_best = 0;
    if (any_sampled && static_cast<int>(threadIdx.x) < members) {
      grid_best = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(
                      best[first + threadIdx.x])
                      .load(cuda::memory_order_relaxed);
    }
    const int64_t row0 = tile * 16;
    // The tile's column tiles kSweep at a time: the products of a sweep, then its epilogue calls.
    for (int nt0 = 0; nt0 < column_tiles; nt0 += kSweep) {
      const int n = min(kSweep, column_tiles - nt0);
      // Base logits two column tiles ahead of their epilogue call: the first two load during the
      // products, each later one during the two calls before its own.
      Base base[kSweep][4];
      load_base(p, s, row0, members, nt0, base[0]);
      if (n > 1) load_base(p, s, row0, members, nt0 + 1, base[1]);
      float acc[kSweep][4] = {};
      if constexpr (kRing) {
        tile_products<W, kPasses, kSweep>(p, w2, inputs, nt0, n, acc);
      } else {
        tile_products_f32(p, row0, inputs, column_tiles, acc);
      }
      if (grid_best != 0) {
        atomicMax(&s.seen[threadIdx.x], static_cast<uint32_t>(grid_best >> 32));
        grid_best = 0;
      }
#pragma unroll
      for (int i = 0; i < kSweep; ++i) {
        if (i >= n) break;
        if (i + 2 < kSweep && i + 2 < n) load_base(p, s, row0, members, nt0 + i + 2, base[i + 2]);
        float b[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = to_float(base[i][e]);
        tile_epilogue<W, kRnn>(p, row0, members, nt0 + i, acc[i], b, any_sampled, s,
                               best + first);
      }
    }
  }
  // The next launch of the walk may start its blocks (they wait for this grid before they read
  // what it writes).
  allow_dependent_launch();

  // The last block of the group to arrive writes the tokens (every thread's maxima are fenced
  // before the barrier that precedes the arrival).
  __threadfence();
  __syncthreads();
  int32_t* const arrivals = p.arrivals + p.slot * static_cast<int>(gridDim.y) + group;
  if (threadIdx.x == 0) last = atomicAdd(arrivals, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (last) {  // every block of the group has arrived: its counters go back to zero
    __threadfence();
    for (int i = threadIdx.x; i < members; i += blockDim.x) {
      const int32_t id = candidate_id(__ldcg(best + first + i));
      p.tokens[int64_t{first + i} * p.block + p.slot] = id < 0 ? 0 : id;
      best[first + i] = 0;
    }
    if (threadIdx.x == 0) *arrivals = 0;
  }
  if (kRnn) {
    // s_{j+1} = sigmoid(g) * s_j + (1 - sigmoid(g)) * tanh(c), spread over the group's blocks;
    // rnn_head_kernel of this slot has read s_j already, and nothing in this launch reads it.
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < members * p.rank;
         e += gridDim.x * blockDim.x) {
      const int i = e / p.rank, k = e % p.rank, b = first + i;
      const float* pre = p.preactivation + int64_t{b} * 3 * p.rank;
      const float gate = 1.f / (1.f + expf(-pre[k]));
      float& state = p.state[int64_t{b} * p.rank + k];
      state = gate * (p.slot > 0 ? state : 0.f) + (1.f - gate) * tanhf(pre[p.rank + k]);
    }
  }
}

// Lets draft_slot_kernel take `shared_bytes` of dynamic shared memory (allow_dynamic_shared).
template <typename W, typename Base, bool kRnn>
cudaError_t allow_draft_shared(int shared_bytes) {
  return allow_dynamic_shared(draft_slot_kernel<W, Base, kRnn>, shared_bytes);
}

// Blocks of draft_slot_kernel resident per SM on the current device (a host query, cached per
// instantiation, device and shared-memory size; the caller has called allow_draft_shared).
template <typename W, typename Base, bool kRnn>
int draft_blocks_per_sm(int device, int shared_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find({device, shared_bytes});
  if (found != cache.end()) return found->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, draft_slot_kernel<W, Base, kRnn>, kDraftThreads,
                                                    shared_bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error; nothing else is pending at this point
    n = slot_blocks_per_sm(sizeof(W) == 2);
  }
  return cache[{device, shared_bytes}] = n > 0 ? n : 1;
}

}  // namespace dspark_ops::kernels
