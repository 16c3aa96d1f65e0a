// Entry points of every op on every backend (registered in cpu/*.cpp and cuda/*_cuda.cpp), one
// declaration each, in the order of schemas.h. C++ users can also call the ops through the
// dispatcher: c10::Dispatcher::singleton().findSchemaOrThrow("dspark_ops::verify", "").
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace dspark_ops {

// verify (cpu/verify_cpu.cpp, cuda/verify_cuda.cpp): tokens, num_accepted, valid, logprobs.
using VerifyResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

VerifyResult verify_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& num_draft,
    const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& position,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& target_start,
    const std::optional<at::Tensor>& draft_temperature, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& allowed_token_mask, bool return_logprobs);
VerifyResult verify_cuda(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& num_draft,
    const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& position,
    const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& target_start,
    const std::optional<at::Tensor>& draft_temperature, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& allowed_token_mask, bool return_logprobs);

// Drafting (cpu/draft_cpu.cpp, cuda/draft_cuda.cpp): tokens, draft_logits.
using DraftResult = std::tuple<at::Tensor, at::Tensor>;

DraftResult markov_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                             const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& temperature, const at::Tensor& seed,
                             const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p,
                             std::optional<at::ScalarType> draft_logits_dtype);
DraftResult markov_draft_cuda(const at::Tensor& base_logits, const at::Tensor& anchor,
                              const at::Tensor& w1, const at::Tensor& w2,
                              const at::Tensor& temperature, const at::Tensor& seed,
                              const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                              const std::optional<at::Tensor>& top_p,
                              const std::optional<at::Tensor>& min_p,
                              std::optional<at::ScalarType> draft_logits_dtype);
DraftResult rnn_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                          const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& joint_weight, const at::Tensor& joint_bias,
                          const at::Tensor& temperature, const at::Tensor& seed,
                          const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                          const std::optional<at::Tensor>& top_p,
                          const std::optional<at::Tensor>& min_p,
                          std::optional<at::ScalarType> draft_logits_dtype);
DraftResult rnn_draft_cuda(const at::Tensor& base_logits, const at::Tensor& anchor,
                           const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& joint_weight, const at::Tensor& joint_bias,
                           const at::Tensor& temperature, const at::Tensor& seed,
                           const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                           const std::optional<at::Tensor>& top_p,
                           const std::optional<at::Tensor>& min_p,
                           std::optional<at::ScalarType> draft_logits_dtype);
at::Tensor draft_confidence_cpu(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                const at::Tensor& w1, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& calib_temperature);
at::Tensor draft_confidence_cuda(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                 const at::Tensor& w1, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& calib_temperature);

// Scheduling (cpu/schedule_cpu.cpp, cuda/schedule_cuda.cpp).
at::Tensor schedule_verify_cpu(const at::Tensor& confidence, const at::Tensor& step_rate,
                               const std::optional<at::Tensor>& max_verify);
at::Tensor schedule_verify_cuda(const at::Tensor& confidence, const at::Tensor& step_rate,
                                const std::optional<at::Tensor>& max_verify);
at::Tensor plan_verify_budget_cpu(const at::Tensor& confidence, const at::Tensor& step_rate);
at::Tensor plan_verify_budget_cuda(const at::Tensor& confidence, const at::Tensor& step_rate);
at::Tensor allocate_verify_cpu(const at::Tensor& confidence, const at::Tensor& budget,
                               const std::optional<at::Tensor>& max_verify);
at::Tensor allocate_verify_cuda(const at::Tensor& confidence, const at::Tensor& budget,
                                const std::optional<at::Tensor>& max_verify);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_verify_inputs_cpu(
    const at::Tensor& anchor, const at::Tensor& draft_tokens, const at::Tensor& num_verify,
    const at::Tensor& position);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_verify_inputs_cuda(
    const at::Tensor& anchor, const at::Tensor& draft_tokens, const at::Tensor& num_verify,
    const at::Tensor& position);

// Attention (cpu/attention_cpu.cpp, cuda/attention_cuda.cpp).
std::tuple<at::Tensor, at::Tensor> block_draft_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& cache_slot, std::optional<double> softmax_scale,
    std::optional<int64_t> window, bool return_lse);
std::tuple<at::Tensor, at::Tensor> block_draft_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& cache_slot, std::optional<double> softmax_scale,
    std::optional<int64_t> window, bool return_lse);
void append_context_kv_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& num_new, const at::Tensor& cache_seqlens,
                           const std::optional<at::Tensor>& cache_slot);
void append_context_kv_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& num_new, const at::Tensor& cache_seqlens,
                            const std::optional<at::Tensor>& cache_slot);

// Random numbers (cpu/random_cpu.cpp, cuda/random_cuda.cpp).
at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& position, int64_t purpose,
                              int64_t count);
at::Tensor philox_uniform_cuda(const at::Tensor& seed, const at::Tensor& position,
                               int64_t purpose, int64_t count);

// Training loss (cpu/loss_cpu.cpp, cuda/loss_cuda.cpp): loss, ce, l1, then the gradients of hidden,
// markov_latent, markov_w2 and lm_head_weight.
using LossResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
LossResult dspark_loss_cpu(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& term_scale,
                           const std::optional<at::Tensor>& target_hidden,
                           const std::optional<at::Tensor>& markov_latent,
                           const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                           bool lm_head_grad, int64_t chunk_rows,
                           std::optional<double> logit_softcap);
LossResult dspark_loss_cuda(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                            const at::Tensor& labels, const at::Tensor& weights,
                            const at::Tensor& term_scale,
                            const std::optional<at::Tensor>& target_hidden,
                            const std::optional<at::Tensor>& markov_latent,
                            const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                            bool lm_head_grad, int64_t chunk_rows,
                           std::optional<double> logit_softcap);

}  // namespace dspark_ops
