// The device-independent front end of the drafting family: argument and value checks shared by the
// CPU and CUDA kernels of markov_draft, rnn_draft and draft_confidence.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "filter_args.h"

namespace dspark_ops {

struct DraftArgs {
  at::Tensor base;         // [B, G, V], unit stride along V
  at::Tensor anchor;       // int32/int64 [B], contiguous
  at::Tensor w1, w2;       // [V, r] in one dtype, unit stride along r
  at::Tensor temperature;  // float32 [B], contiguous
  at::Tensor seed;         // int64 [B], contiguous
  at::Tensor position;     // int64 [B], contiguous
  FilterArgs filters;      // top_k / top_p / min_p of the proposal
  bool logits_bf16 = false;  // draft_logits in bfloat16: z rounded before it is sampled
  // rnn_draft only (undefined for markov_draft).
  at::Tensor hidden;        // [B, G, d], unit stride along d
  at::Tensor joint_weight;  // [3r, 2r + d] in w1's dtype, unit stride along columns
  at::Tensor joint_bias;    // [3r] in w1's dtype, contiguous
  int64_t batch = 0, block = 0, vocab = 0, rank = 0, hidden_size = 0;
};

// The largest Markov rank the kernels take (the released checkpoints use 256).
constexpr int64_t kMaxDraftRank = 1024;

DraftArgs check_markov_draft_args(const at::Tensor& base_logits, const at::Tensor& anchor,
                                  const at::Tensor& w1, const at::Tensor& w2,
                                  const at::Tensor& temperature, const at::Tensor& seed,
                                  const at::Tensor& position,
                                  const std::optional<at::Tensor>& top_k,
                                  const std::optional<at::Tensor>& top_p,
                                  const std::optional<at::Tensor>& min_p,
                                  std::optional<at::ScalarType> draft_logits_dtype);

DraftArgs check_rnn_draft_args(const at::Tensor& base_logits, const at::Tensor& anchor,
                               const at::Tensor& hidden, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& joint_weight,
                               const at::Tensor& joint_bias, const at::Tensor& temperature,
                               const at::Tensor& seed, const at::Tensor& position,
                               const std::optional<at::Tensor>& top_k,
                               const std::optional<at::Tensor>& top_p,
                               const std::optional<at::Tensor>& min_p,
                               std::optional<at::ScalarType> draft_logits_dtype);

// tokens int64 [B, G] and draft_logits float32 or bfloat16 (args.logits_bf16) [B, G, V]
// (contiguous) on the inputs' device.
std::tuple<at::Tensor, at::Tensor> allocate_draft_outputs(const DraftArgs& args);

struct ConfidenceArgs {
  at::Tensor hidden;             // [B, G, d], unit stride along d
  at::Tensor prev_tokens;        // int32/int64 [B, G], any strides
  at::Tensor w1;                 // [V, r], unit stride along r
  at::Tensor weight;             // [d + r], contiguous
  at::Tensor bias;               // undefined, or one element (contiguous)
  at::Tensor calib_temperature;  // undefined, or float32 [G], contiguous
  int64_t batch = 0, block = 0, vocab = 0, rank = 0, hidden_size = 0;
};

ConfidenceArgs check_confidence_args(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                     const at::Tensor& w1, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& calib_temperature);

}  // namespace dspark_ops
