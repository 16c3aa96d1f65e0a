#include "attention_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_unique.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "../common/checks.h"

namespace dspark_ops {

namespace {

// Whether the values of int32 [B] `slots` are distinct (on CPU a sorted copy, cheaper than
// at::_unique for the small B of a call).
bool distinct(const at::Tensor& slots) {
  if (!slots.device().is_cpu()) return std::get<0>(at::_unique(slots)).numel() == slots.numel();
  const int32_t* data = slots.const_data_ptr<int32_t>();
  std::vector<int32_t> sorted(slots.numel());
  for (size_t i = 0; i < sorted.size(); ++i) sorted[i] = data[i * slots.stride(0)];
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

}  // namespace

void check_head_dim(const char* op, int64_t dim) {
  TORCH_CHECK_VALUE(dim == 64 || dim == 128 || dim == 256 || dim == 512, op,
                    "(): the head dimension D of 'q' must be 64, 128, 256 or 512, got ", dim);
}

void check_cache(const char* op, const char* name, const at::Tensor& cache,
                 const at::Tensor& reference, const char* reference_name) {
  check_dim(op, name, cache, {4}, "4-D [N, L, Hkv, D]");
  check_device(op, name, cache, reference, reference_name);
  TORCH_CHECK_TYPE(cache.scalar_type() == reference.scalar_type(), op, "(): '", name,
                   "' must have the dtype of '", reference_name, "' (", reference.scalar_type(),
                   "), got ", cache.scalar_type());
  TORCH_CHECK_VALUE(cache.stride(3) == 1, op, "(): '", name,
                    "' must have unit stride along D (its rows are read in place), got strides ",
                    cache.strides());
}

at::Tensor check_slots(const char* op, const std::optional<at::Tensor>& cache_slot,
                       const at::Tensor& reference, int64_t batch, int64_t slots, bool unique) {
  if (!cache_slot.has_value()) {
    TORCH_CHECK_VALUE(batch <= slots, op, "(): without 'cache_slot', the cache must have a row per "
                      "request: N = ", slots, " < B = ", batch);
    return at::Tensor();
  }
  const auto& s = *cache_slot;
  check_device(op, "cache_slot", s, reference, "k_cache");
  check_dtype(op, "cache_slot", s, {at::kInt});
  check_shape(op, "cache_slot", s, {batch}, "[B]");
  if (value_checks_enabled(s) && batch > 0) {
    check_values_in_range(op, "cache_slot", s, 0, slots - 1);
    if (unique) {
      TORCH_CHECK_VALUE(distinct(s), op,
                        "(): 'cache_slot' values must be distinct (two requests would write the "
                        "same cache row)");
    }
  }
  return s.contiguous();
}

at::Tensor check_seqlens(const char* op, const at::Tensor& cache_seqlens,
                         const at::Tensor& reference, int64_t batch, int64_t length) {
  check_device(op, "cache_seqlens", cache_seqlens, reference, "k_cache");
  check_dtype(op, "cache_seqlens", cache_seqlens, {at::kInt});
  check_shape(op, "cache_seqlens", cache_seqlens, {batch}, "[B]");
  if (value_checks_enabled(cache_seqlens) && batch > 0) {
    check_values_in_range(op, "cache_seqlens", cache_seqlens, 0, length);
  }
  return cache_seqlens;
}

AttentionResult allocate_attention_outputs(const AttentionArgs& a) {
  const auto lse_options = a.q.options().dtype(at::kFloat);
  return {at::empty({a.batch, a.block, a.heads, a.dim}, a.q.options()),
          a.return_lse ? at::empty({a.batch, a.block, a.heads}, lse_options)
                       : at::empty({0}, lse_options)};
}

}  // namespace dspark_ops
