// Every op schema of the library. dspark_ops.cpp defines them in torch.ops.dspark_ops; the SIMT
// emulator's test library (csrc/sim/) defines the same schemas in torch.ops.dspark_ops_sim, so its
// entry points are called exactly like the CUDA ones. What each op does is written once, in its
// Python wrapper's docstring (dspark_ops/ops/) and in docs/semantics.md, section given per op.
#pragma once

namespace dspark_ops {

inline constexpr const char* kSchemas[] = {
  // docs/semantics.md §3.1 (filters: §3.1b)
  "verify(Tensor target_logits, Tensor draft_tokens, Tensor num_draft, Tensor temperature, "
      "Tensor seed, Tensor position, Tensor? draft_logits=None, Tensor? target_start=None, "
      "Tensor? draft_temperature=None, Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, Tensor? allowed_token_mask=None, bool return_logprobs=False) "
      "-> (Tensor tokens, Tensor num_accepted, Tensor valid, Tensor logprobs)",
  // docs/semantics.md §3.2 (markov_draft and rnn_draft)
  "markov_draft(Tensor base_logits, Tensor anchor, Tensor w1, Tensor w2, Tensor temperature, "
      "Tensor seed, Tensor position, Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, ScalarType? draft_logits_dtype=None) "
      "-> (Tensor tokens, Tensor draft_logits)",
  "rnn_draft(Tensor base_logits, Tensor anchor, Tensor hidden, Tensor w1, Tensor w2, "
      "Tensor joint_weight, Tensor joint_bias, Tensor temperature, Tensor seed, Tensor position, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "ScalarType? draft_logits_dtype=None) -> (Tensor tokens, Tensor draft_logits)",
  // docs/semantics.md §3.3
  "draft_confidence(Tensor hidden, Tensor prev_tokens, Tensor w1, Tensor weight, "
      "Tensor? bias=None, Tensor? calib_temperature=None) -> Tensor",
  // docs/semantics.md §3.4 (schedule_verify, plan_verify_budget, allocate_verify, pack_verify_inputs)
  "schedule_verify(Tensor confidence, Tensor step_rate, Tensor? max_verify=None) -> Tensor",
  "plan_verify_budget(Tensor confidence, Tensor step_rate) -> Tensor",
  "allocate_verify(Tensor confidence, Tensor budget, Tensor? max_verify=None) -> Tensor",
  "pack_verify_inputs(Tensor anchor, Tensor draft_tokens, Tensor num_verify, Tensor position) "
      "-> (Tensor input_ids, Tensor positions, Tensor cu_seqlens)",
  // docs/semantics.md §3.5 (block_draft_attention and append_context_kv)
  "block_draft_attention(Tensor q, Tensor k_block, Tensor v_block, Tensor k_cache, "
      "Tensor v_cache, Tensor cache_seqlens, Tensor? cache_slot=None, float? softmax_scale=None, "
      "int? window=None, bool return_lse=False) -> (Tensor out, Tensor lse)",
  "append_context_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
      "Tensor num_new, Tensor(c!) cache_seqlens, Tensor? cache_slot=None) -> ()",
  // docs/semantics.md §2.1
  "philox_uniform(Tensor seed, Tensor position, int purpose, int count) -> Tensor",
  // docs/semantics.md §3.7
  "dspark_loss(Tensor hidden, Tensor lm_head_weight, Tensor labels, Tensor weights, "
      "Tensor term_scale, Tensor? target_hidden=None, Tensor? markov_latent=None, "
      "Tensor? markov_w2=None, bool compute_grad=False, bool lm_head_grad=False, "
      "int chunk_rows=0, float? logit_softcap=None) -> (Tensor loss, Tensor ce, Tensor l1, "
      "Tensor grad_hidden, Tensor grad_markov_latent, Tensor grad_markov_w2, "
      "Tensor grad_lm_head_weight)",
};

}  // namespace dspark_ops
