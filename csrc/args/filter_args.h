// The sampling-filter arguments (top_k, top_p, min_p; README "Sampling filters") that verify and
// the drafting ops share: checks and normalised views.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace dspark_ops {

struct FilterArgs {
  at::Tensor top_k;  // undefined (off), or int32 [B], contiguous
  at::Tensor top_p;  // undefined (off), or float32 [B], contiguous
  at::Tensor min_p;  // undefined (off), or float32 [B], contiguous
  bool any() const { return top_k.defined() || top_p.defined() || min_p.defined(); }
  // Data of each, null when off (what make_filter_spec and the CUDA kernels take).
  const int32_t* top_k_data() const {
    return top_k.defined() ? top_k.const_data_ptr<int32_t>() : nullptr;
  }
  const float* top_p_data() const {
    return top_p.defined() ? top_p.const_data_ptr<float>() : nullptr;
  }
  const float* min_p_data() const {
    return min_p.defined() ? min_p.const_data_ptr<float>() : nullptr;
  }
};

// Checks device (that of `reference`, named `reference_name`), dtype and shape [batch] of each
// given filter, and when value checks run: top_k >= 0, top_p in (0, 1], min_p in [0, 1].
FilterArgs check_filter_args(const char* op, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p, int64_t batch,
                             const at::Tensor& reference, const char* reference_name);

}  // namespace dspark_ops
