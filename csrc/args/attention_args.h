// The entries of the attention family, shared by the CPU and CUDA kernels of
// block_draft_attention and append_context_kv: argument and value checks, output allocation,
// then the backend's check of what it cannot run, and its run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

#include "../common/backend.h"
#include "../common/checks.h"

namespace dspark_ops {

struct AttentionArgs {
  at::Tensor q, k_block, v_block;  // [B, G, Hq|Hkv, D], unit stride along D
  at::Tensor k_cache, v_cache;     // [N, L, Hkv, D], unit stride along D
  at::Tensor cache_seqlens;        // int32 [B], contiguous
  at::Tensor cache_slot;           // undefined (b), or int32 [B], contiguous
  int64_t batch = 0, block = 0, heads = 0, kv_heads = 0, dim = 0, slots = 0, length = 0;
  float scale = 0.f;
  int64_t window = -1;  // -1: no window
  bool return_lse = false;
};

// out [B, G, Hq, D] in q's dtype, and lse float32 [B, G, Hq] (empty unless return_lse), on q's
// device.
using AttentionResult = std::tuple<at::Tensor, at::Tensor>;
AttentionResult allocate_attention_outputs(const AttentionArgs& args);

// append_context_kv's arguments; it writes k_cache, v_cache and cache_seqlens in place.
struct AppendArgs {
  at::Tensor k_cache, v_cache;  // [N, L, Hkv, D], unit stride along D
  at::Tensor k_new, v_new;      // [B, n_max, Hkv, D], any strides
  at::Tensor num_new;           // int32 [B], any strides
  at::Tensor cache_seqlens;     // int32 [B], contiguous
  at::Tensor cache_slot;        // undefined (b), or int32 [B], distinct, contiguous
};

void check_head_dim(const char* op, int64_t dim);
// The caches are large: their rows are read in place, so they must have unit stride along D.
void check_cache(const char* op, const char* name, const at::Tensor& cache,
                 const at::Tensor& reference, const char* reference_name);
// cache_slot int32 [B] in [0, N) (and distinct when `unique`), made contiguous; undefined when
// absent (then N >= B).
at::Tensor check_slots(const char* op, const std::optional<at::Tensor>& cache_slot,
                       const at::Tensor& reference, int64_t batch, int64_t slots, bool unique);
// cache_seqlens int32 [B] in [0, L].
at::Tensor check_seqlens(const char* op, const at::Tensor& cache_seqlens,
                         const at::Tensor& reference, int64_t batch, int64_t length);

namespace ops {

template <typename Backend>
AttentionResult block_draft_attention(const at::Tensor& q, const at::Tensor& k_block,
                                      const at::Tensor& v_block, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                      const std::optional<at::Tensor>& cache_slot,
                                      std::optional<double> softmax_scale,
                                      std::optional<int64_t> window, bool return_lse) {
  constexpr const char* op = "block_draft_attention";
  AttentionArgs a;
  check_dim(op, "q", q, {4}, "4-D [B, G, Hq, D]");
  check_dtype(op, "q", q, {at::kHalf, at::kBFloat16, at::kFloat});
  a.batch = q.size(0);
  a.block = q.size(1);
  a.heads = q.size(2);
  a.dim = q.size(3);
  check_head_dim(op, a.dim);
  check_cache(op, "k_cache", k_cache, q, "q");
  a.slots = k_cache.size(0);
  a.length = k_cache.size(1);
  a.kv_heads = k_cache.size(2);
  check_shape(op, "k_cache", k_cache, {a.slots, a.length, a.kv_heads, a.dim}, "[N, L, Hkv, D]");
  check_cache(op, "v_cache", v_cache, q, "q");
  check_shape(op, "v_cache", v_cache, k_cache.sizes(), "[N, L, Hkv, D] like 'k_cache'");
  TORCH_CHECK_VALUE(a.kv_heads >= 1 && a.heads % a.kv_heads == 0, op,
                    "(): the query heads Hq = ", a.heads, " of 'q' must be a multiple of the KV "
                    "heads Hkv = ", a.kv_heads, " of 'k_cache'");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k_block", k_block},
                                std::pair<const char*, const at::Tensor&>{"v_block", v_block}}) {
    check_device(op, name, t, q, "q");
    TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), op, "(): '", name,
                     "' must have the dtype of 'q' (", q.scalar_type(), "), got ", t.scalar_type());
    check_shape(op, name, t, {a.batch, a.block, a.kv_heads, a.dim}, "[B, G, Hkv, D]");
  }
  const auto unit = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  a.q = unit(q);
  a.k_block = unit(k_block);
  a.v_block = unit(v_block);
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.cache_seqlens = check_seqlens(op, cache_seqlens, q, a.batch, a.length).contiguous();
  a.cache_slot = check_slots(op, cache_slot, q, a.batch, a.slots, /*unique=*/false);
  if (softmax_scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*softmax_scale) && *softmax_scale > 0, op,
                      "(): 'softmax_scale' must be finite and > 0, got ", *softmax_scale);
  }
  a.scale = static_cast<float>(softmax_scale.value_or(1.0 / std::sqrt(double(a.dim))));
  if (window.has_value()) {
    TORCH_CHECK_VALUE(*window >= 0, op, "(): 'window' must be >= 0, got ", *window);
    a.window = *window;
  }
  a.return_lse = return_lse;
  Backend::check(a);
  const typename Backend::Guard guard(q.device());
  auto outputs = allocate_attention_outputs(a);
  Backend::run(a, outputs);
  return outputs;
}

template <typename Backend>
void append_context_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& num_new,
                       const at::Tensor& cache_seqlens,
                       const std::optional<at::Tensor>& cache_slot) {
  constexpr const char* op = "append_context_kv";
  check_dim(op, "k_cache", k_cache, {4}, "4-D [N, L, Hkv, D]");
  check_dtype(op, "k_cache", k_cache, {at::kHalf, at::kBFloat16, at::kFloat});
  check_cache(op, "k_cache", k_cache, k_cache, "k_cache");
  check_cache(op, "v_cache", v_cache, k_cache, "k_cache");
  check_shape(op, "v_cache", v_cache, k_cache.sizes(), "[N, L, Hkv, D] like 'k_cache'");
  check_dim(op, "k_new", k_new, {4}, "4-D [B, n_max, Hkv, D]");
  const int64_t batch = k_new.size(0), rows = k_new.size(1);
  const int64_t slots = k_cache.size(0), length = k_cache.size(1);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k_new", k_new},
                                std::pair<const char*, const at::Tensor&>{"v_new", v_new}}) {
    check_device(op, name, t, k_cache, "k_cache");
    TORCH_CHECK_TYPE(t.scalar_type() == k_cache.scalar_type(), op, "(): '", name,
                     "' must have the dtype of 'k_cache' (", k_cache.scalar_type(), "), got ",
                     t.scalar_type());
    check_shape(op, name, t, {batch, rows, k_cache.size(2), k_cache.size(3)}, "[B, n_max, Hkv, D]");
  }
  check_device(op, "num_new", num_new, k_cache, "k_cache");
  check_dtype(op, "num_new", num_new, {at::kInt});
  check_shape(op, "num_new", num_new, {batch}, "[B]");
  if (value_checks_enabled(num_new) && batch > 0) {
    check_values_in_range(op, "num_new", num_new, 0, rows);
  }
  check_seqlens(op, cache_seqlens, k_cache, batch, length);
  TORCH_CHECK_VALUE(cache_seqlens.is_contiguous(), op,
                    "(): 'cache_seqlens' must be contiguous (it is updated in place)");
  // The three in-place outputs: each element its own memory, no memory shared with another
  // argument (a request's rows would overwrite another's, or be read while written).
  const std::pair<const char*, const at::Tensor*> args[] = {
      {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_seqlens", &cache_seqlens},
      {"k_new", &k_new},     {"v_new", &v_new},     {"num_new", &num_new}};
  for (int out = 0; out < 3; ++out) {
    check_no_internal_overlap(op, args[out].first, *args[out].second);
    for (int other = out + 1; other < 6; ++other) {
      check_no_overlap(op, args[out].first, *args[out].second, args[other].first,
                       *args[other].second);
    }
  }
  if (cache_slot.has_value()) {
    for (int out = 0; out < 3; ++out) {
      check_no_overlap(op, args[out].first, *args[out].second, "cache_slot", *cache_slot);
    }
  }
  const AppendArgs a{k_cache, v_cache, k_new, v_new, num_new, cache_seqlens,
                    check_slots(op, cache_slot, k_cache, batch, slots, /*unique=*/true)};
  Backend::check(a);
  const typename Backend::Guard guard(k_cache.device());
  Backend::run(a);
}

}  // namespace ops
}  // namespace dspark_ops
