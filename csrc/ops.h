// Entry points of every op on every backend (registered in cpu/*.cpp and cuda/*.cu). C++ users can
// also call the ops through the dispatcher: c10::Dispatcher::singleton().findSchemaOrThrow(
// "dspark_ops::verify", "").
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace dspark_ops {

// tokens, num_accepted, valid, logprobs
using VerifyResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

#define DSPARK_OPS_DECLARE_VERIFY(backend)                                                      \
  VerifyResult verify_##backend(                                                                \
      const at::Tensor& target_logits, const at::Tensor& draft_tokens,                          \
      const at::Tensor& num_draft, const at::Tensor& temperature, const at::Tensor& seed,       \
      const at::Tensor& position, const std::optional<at::Tensor>& draft_logits,                \
      const std::optional<at::Tensor>& target_start,                                            \
      const std::optional<at::Tensor>& draft_temperature, const std::optional<at::Tensor>& top_k, \
      const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,           \
      const std::optional<at::Tensor>& allowed_token_mask, bool return_logprobs);
DSPARK_OPS_DECLARE_VERIFY(cpu)
DSPARK_OPS_DECLARE_VERIFY(cuda)
#undef DSPARK_OPS_DECLARE_VERIFY

// Drafting family; a "backend" suffix per entry point.
using DraftResult = std::tuple<at::Tensor, at::Tensor>;  // tokens, draft_logits
#define DSPARK_OPS_DECLARE_DRAFT(backend)                                                       \
  DraftResult markov_draft_##backend(const at::Tensor& base_logits, const at::Tensor& anchor,  \
                                     const at::Tensor& w1, const at::Tensor& w2,               \
                                     const at::Tensor& temperature, const at::Tensor& seed,    \
                                     const at::Tensor& position,                               \
                                     const std::optional<at::Tensor>& top_k,                   \
                                     const std::optional<at::Tensor>& top_p,                   \
                                     const std::optional<at::Tensor>& min_p,                   \
                                     std::optional<at::ScalarType> draft_logits_dtype);        \
  DraftResult rnn_draft_##backend(const at::Tensor& base_logits, const at::Tensor& anchor,     \
                                  const at::Tensor& hidden, const at::Tensor& w1,              \
                                  const at::Tensor& w2, const at::Tensor& joint_weight,        \
                                  const at::Tensor& joint_bias, const at::Tensor& temperature, \
                                  const at::Tensor& seed, const at::Tensor& position,          \
                                  const std::optional<at::Tensor>& top_k,                      \
                                  const std::optional<at::Tensor>& top_p,                      \
                                  const std::optional<at::Tensor>& min_p,                      \
                                  std::optional<at::ScalarType> draft_logits_dtype);           \
  at::Tensor draft_confidence_##backend(const at::Tensor& hidden, const at::Tensor& prev_tokens, \
                                        const at::Tensor& w1, const at::Tensor& weight,         \
                                        const std::optional<at::Tensor>& bias,                  \
                                        const std::optional<at::Tensor>& calib_temperature);
DSPARK_OPS_DECLARE_DRAFT(cpu)
DSPARK_OPS_DECLARE_DRAFT(cuda)
#undef DSPARK_OPS_DECLARE_DRAFT

// Scheduling family; a "backend" suffix per entry point.
#define DSPARK_OPS_DECLARE_SCHEDULE(backend)                                                   \
  at::Tensor schedule_verify_##backend(const at::Tensor& confidence, const at::Tensor& step_rate, \
                                       const std::optional<at::Tensor>& max_verify);           \
  at::Tensor plan_verify_budget_##backend(const at::Tensor& confidence,                       \
                                          const at::Tensor& step_rate);                       \
  at::Tensor allocate_verify_##backend(const at::Tensor& confidence, const at::Tensor& budget, \
                                       const std::optional<at::Tensor>& max_verify);           \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_verify_inputs_##backend(                 \
      const at::Tensor& anchor, const at::Tensor& draft_tokens, const at::Tensor& num_verify,   \
      const at::Tensor& position);
DSPARK_OPS_DECLARE_SCHEDULE(cpu)
DSPARK_OPS_DECLARE_SCHEDULE(cuda)
#undef DSPARK_OPS_DECLARE_SCHEDULE

// Attention family.
#define DSPARK_OPS_DECLARE_ATTENTION(backend)                                                   \
  std::tuple<at::Tensor, at::Tensor> block_draft_attention_##backend(                          \
      const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block,              \
      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,   \
      const std::optional<at::Tensor>& cache_slot, std::optional<double> softmax_scale,        \
      std::optional<int64_t> window, bool return_lse);                                         \
  void append_context_kv_##backend(const at::Tensor& k_cache, const at::Tensor& v_cache,       \
                                   const at::Tensor& k_new, const at::Tensor& v_new,           \
                                   const at::Tensor& num_new, const at::Tensor& cache_seqlens, \
                                   const std::optional<at::Tensor>& cache_slot);
DSPARK_OPS_DECLARE_ATTENTION(cpu)
DSPARK_OPS_DECLARE_ATTENTION(cuda)
#undef DSPARK_OPS_DECLARE_ATTENTION

at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& position, int64_t purpose,
                              int64_t count);
at::Tensor philox_uniform_cuda(const at::Tensor& seed, const at::Tensor& position,
                               int64_t purpose, int64_t count);

// Loss family: loss, ce, l1, then the gradients of hidden, markov_latent, markov_w2, lm_head_weight.
using LossResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
LossResult dspark_loss_cpu(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& term_scale,
                           const std::optional<at::Tensor>& target_hidden,
                           const std::optional<at::Tensor>& markov_latent,
                           const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                           bool lm_head_grad, int64_t chunk_rows);
LossResult dspark_loss_cuda(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                            const at::Tensor& labels, const at::Tensor& weights,
                            const at::Tensor& term_scale,
                            const std::optional<at::Tensor>& target_hidden,
                            const std::optional<at::Tensor>& markov_latent,
                            const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                            bool lm_head_grad, int64_t chunk_rows);

}  // namespace dspark_ops
