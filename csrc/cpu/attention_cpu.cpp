// CPU kernels of the attention family (docs/semantics.md §3.5): block_draft_attention and
// append_context_kv.
//
// block_draft_attention: one task per (request, KV head) (at::parallel_for, the only level of
// parallelism: everything inside a task is single-threaded, so a busy machine slows it down
// gracefully instead of oversubscribing threads). The G * Hq/Hkv query rows that share the KV
// head are held as float32 and every key/value row is converted once and used by all of them:
// keys in tiles of 256 (stored transposed, so the score micro-kernel broadcasts query elements
// against eight keys at a time), values row-major for the P.V micro-kernel, both register-blocked
// four rows by sixteen columns; online softmax (running max and sum per row). Context rows are read
// in place from the request's cache row; the block's own keys come last and are never written
// anywhere.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "../args/attention_args.h"
#include "../common/dispatch.h"

namespace dspark_ops {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kKeyTile = 256;

constexpr int64_t kRowBlock = 4;   // query rows per micro-kernel call
constexpr int64_t kColBlock = 16;  // two float vectors of keys or value columns

// scores[r][n] = q[r] . k[n] for r < rows (a multiple of kRowBlock) and n < cols (a multiple of
// kColBlock), with kt the key tile transposed: kt[d * ld + n].
void score_tile(const float* q, int64_t rows, int64_t dim, const float* kt, int64_t ld,
                int64_t cols, float* scores) {
  for (int64_t r = 0; r < rows; r += kRowBlock) {
    for (int64_t n = 0; n < cols; n += kColBlock) {
      Vec acc[kRowBlock][2];
      for (auto& row : acc) row[0] = row[1] = Vec(0.f);
      for (int64_t d = 0; d < dim; ++d) {
        const Vec k0 = Vec::loadu(kt + d * ld + n), k1 = Vec::loadu(kt + d * ld + n + Vec::size());
        for (int64_t i = 0; i < kRowBlock; ++i) {
          const Vec x(q[(r + i) * dim + d]);
          acc[i][0] = at::vec::fmadd(x, k0, acc[i][0]);
          acc[i][1] = at::vec::fmadd(x, k1, acc[i][1]);
        }
      }
      for (int64_t i = 0; i < kRowBlock; ++i) {
        acc[i][0].store(scores + (r + i) * ld + n);
        acc[i][1].store(scores + (r + i) * ld + n + Vec::size());
      }
    }
  }
}

// acc[r] += sum_n p[r][n] v[n] for r < rows (a multiple of kRowBlock), n < keys, dim a multiple
// of kColBlock; p rows of stride ld, value row n at v[n].
void accumulate_tile(const float* p, int64_t ld, int64_t rows, int64_t keys,
                     const float* const* v, int64_t dim, float* acc) {
  for (int64_t r = 0; r < rows; r += kRowBlock) {
    for (int64_t d = 0; d < dim; d += kColBlock) {
      Vec sum[kRowBlock][2];
      for (int64_t i = 0; i < kRowBlock; ++i) {
        sum[i][0] = Vec::loadu(acc + (r + i) * dim + d);
        sum[i][1] = Vec::loadu(acc + (r + i) * dim + d + Vec::size());
      }
      for (int64_t n = 0; n < keys; ++n) {
        const Vec v0 = Vec::loadu(v[n] + d), v1 = Vec::loadu(v[n] + d + Vec::size());
        for (int64_t i = 0; i < kRowBlock; ++i) {
          const Vec x(p[(r + i) * ld + n]);
          sum[i][0] = at::vec::fmadd(x, v0, sum[i][0]);
          sum[i][1] = at::vec::fmadd(x, v1, sum[i][1]);
        }
      }
      for (int64_t i = 0; i < kRowBlock; ++i) {
        sum[i][0].store(acc + (r + i) * dim + d);
        sum[i][1].store(acc + (r + i) * dim + d + Vec::size());
      }
    }
  }
}

// kt[d * ld + k] = rows[k][d] for k < n, d < dim (a multiple of 8): eight rows at a time through
// 8 x 8 register transposes.
void transpose_rows(const float* const* rows, int64_t n, int64_t dim, float* kt, int64_t ld) {
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  for (; k + 8 <= n; k += 8) {
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[k + i] + d);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      // r[0..3] hold columns (0, 1, 2, 3) of rows 0-3 (low lanes: d..d+3, high: d+4..d+7), r[4..7]
      // the same of rows 4-7.
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(kt + (d + j) * ld + k, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
        _mm256_storeu_ps(kt + (d + j + 4) * ld + k, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
      }
    }
  }
#endif
  for (; k < n; ++k) {
    for (int64_t d = 0; d < dim; ++d) kt[d * ld + k] = rows[k][d];
  }
}

template <typename T>
void attend(const AttentionArgs& a, at::Tensor& out, float* lse) {
  const int64_t ratio = a.heads / a.kv_heads, rows = a.block * ratio, dim = a.dim;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const T* q = a.q.const_data_ptr<T>();
  const T* kb = a.k_block.const_data_ptr<T>();
  const T* vb = a.v_block.const_data_ptr<T>();
  const T* kc = a.k_cache.const_data_ptr<T>();
  const T* vc = a.v_cache.const_data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int32_t* seqlens = a.cache_seqlens.const_data_ptr<int32_t>();
  const int32_t* slots = a.cache_slot.defined() ? a.cache_slot.const_data_ptr<int32_t>() : nullptr;

  at::parallel_for(0, a.batch * a.kv_heads, 1, [&](int64_t begin_task, int64_t end_task) {
    // Padded query rows stay zero; their results are never written.
    std::vector<float> query(padded_rows * dim, 0.f), acc(padded_rows * dim),
        key_t(dim * kKeyTile), scores(padded_rows * kKeyTile), row_max(padded_rows),
        row_sum(padded_rows);
    // 16-bit K/V rows are converted to float32 here; float32 rows are read in place.
    std::vector<float> converted(std::is_same_v<T, float> ? 0 : 2 * kKeyTile * dim);
    std::vector<const float*> key_rows(kKeyTile), value_rows(kKeyTile);
    for (int64_t task = begin_task; task < end_task; ++task) {
      const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
      const int64_t slot = slots ? slots[b] : b;
      const int64_t end = std::min<int64_t>(std::max(seqlens[b], 0), a.length);
      const int64_t begin = a.window >= 0 ? std::max<int64_t>(0, end - a.window) : 0;
      // Row g * ratio + i is query head h * ratio + i of slot g, pre-scaled.
      for (int64_t g = 0; g < a.block; ++g) {
        for (int64_t i = 0; i < ratio; ++i) {
          const T* src = q + b * a.q.stride(0) + g * a.q.stride(1) + (h * ratio + i) * a.q.stride(2);
          float* dst = query.data() + (g * ratio + i) * dim;
          to_float(src, dim, dst);
          for (int64_t d = 0; d < dim; ++d) dst[d] *= a.scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), -INFINITY);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      // Key n: context position begin + n of the request's cache row, then block key n - context.
      const int64_t context = end - begin, total = context + a.block;
      const auto source = [&](int64_t n, const T* cache, const at::Tensor& c, const T* blk,
                              const at::Tensor& bt) {
        return n < context
            ? cache + slot * c.stride(0) + (begin + n) * c.stride(1) + h * c.stride(2)
            : blk + b * bt.stride(0) + (n - context) * bt.stride(1) + h * bt.stride(2);
      };
      for (int64_t t0 = 0; t0 < total; t0 += kKeyTile) {
        const int64_t tile = std::min(kKeyTile, total - t0);
        const int64_t cols = (tile + kColBlock - 1) / kColBlock * kColBlock;
        for (int64_t k = 0; k < tile; ++k) {
          const T* key = source(t0 + k, kc, a.k_cache, kb, a.k_block);
          const T* value = source(t0 + k, vc, a.v_cache, vb, a.v_block);
          if constexpr (std::is_same_v<T, float>) {
            key_rows[k] = key;
            value_rows[k] = value;
          } else {
            float* key_f = converted.data() + k * dim;
            float* value_f = converted.data() + (kKeyTile + k) * dim;
            to_float(key, dim, key_f);
            to_float(value, dim, value_f);
            key_rows[k] = key_f;
            value_rows[k] = value_f;
          }
        }
        transpose_rows(key_rows.data(), tile, dim, key_t.data(), kKeyTile);
        for (int64_t k = tile; k < cols; ++k) {
          for (int64_t d = 0; d < dim; ++d) key_t[d * kKeyTile + k] = 0.f;
        }
        score_tile(query.data(), padded_rows, dim, key_t.data(), kKeyTile, cols, scores.data());
        // Online softmax: rescale what was accumulated to the new running max of each row.
        for (int64_t r = 0; r < padded_rows; ++r) {
          float* s = scores.data() + r * kKeyTile;
          float tile_max = -INFINITY;
          for (int64_t k = 0; k < tile; ++k) tile_max = std::max(tile_max, s[k]);
          const float new_max = std::max(row_max[r], tile_max);
          const float rescale = std::exp(row_max[r] - new_max);  // 0 on the first tile
          float* acc_row = acc.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d) acc_row[d] *= rescale;
          // exp(s - max) over the tile: vectorised (SLEEF), the tail in scalar.
          const Vec max_v(new_max);
          Vec sum_v(0.f);
          int64_t k = 0;
          for (; k + Vec::size() <= tile; k += Vec::size()) {
            const Vec e = (Vec::loadu(s + k) - max_v).exp();
            e.store(s + k);
            sum_v += e;
          }
          float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum_v);
          for (; k < tile; ++k) {
            s[k] = std::exp(s[k] - new_max);
            sum += s[k];
          }
          row_sum[r] = row_sum[r] * rescale + sum;
          row_max[r] = new_max;
        }
        accumulate_tile(scores.data(), kKeyTile, padded_rows, tile, value_rows.data(), dim,
                        acc.data());
      }
      for (int64_t g = 0; g < a.block; ++g) {
        for (int64_t i = 0; i < ratio; ++i) {
          const int64_t r = g * ratio + i, head = h * ratio + i;
          T* dst = o + ((b * a.block + g) * a.heads + head) * dim;
          const float inv = 1.f / row_sum[r];
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[r * dim + d] * inv);
          if (lse) lse[(b * a.block + g) * a.heads + head] = row_max[r] + std::log(row_sum[r]);
        }
      }
    }
  });
}

struct BlockDraftAttentionCpu : CpuBackend {
  static void run(const AttentionArgs& a, AttentionResult& outputs) {
    auto& [out, lse] = outputs;
    dispatch_logit_type(a.q.scalar_type(), [&](auto tag) {
      attend<decltype(tag)>(a, out, a.return_lse ? lse.data_ptr<float>() : nullptr);
    });
  }
};

struct AppendContextKvCpu : CpuBackend {
  static void run(const AppendArgs& a) {
    const at::Tensor &k_cache = a.k_cache, &v_cache = a.v_cache, &k_new = a.k_new,
                     &v_new = a.v_new, &slots = a.cache_slot;
    const int64_t batch = k_new.size(0), length = k_cache.size(1);
    const auto counts = a.num_new.contiguous();
    int32_t* seqlens = a.cache_seqlens.data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t slot = slots.defined() ? slots.const_data_ptr<int32_t>()[b] : b;
      const int64_t start = std::clamp<int64_t>(seqlens[b], 0, length);
      const int64_t n = std::max<int32_t>(counts.const_data_ptr<int32_t>()[b], 0);
      const int64_t kept = std::min(n, length - start);  // rows at or past L are dropped
      if (kept > 0) {
        k_cache[slot].slice(0, start, start + kept).copy_(k_new[b].slice(0, 0, kept));
        v_cache[slot].slice(0, start, start + kept).copy_(v_new[b].slice(0, 0, kept));
      }
      seqlens[b] = static_cast<int32_t>(std::min(start + n, length));
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("block_draft_attention", &ops::block_draft_attention<BlockDraftAttentionCpu>);
  m.impl("append_context_kv", &ops::append_context_kv<AppendContextKvCpu>);
}

}  // namespace dspark_ops
