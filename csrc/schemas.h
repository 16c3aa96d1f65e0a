// Every op schema of the library, each with what the op does. dspark_ops.cpp defines them in
// torch.ops.dspark_ops; the SIMT emulator's test library (csrc/sim/) defines the same schemas in
// torch.ops.dspark_ops_sim, so its entry points are called exactly like the CUDA ones.
#pragma once

namespace dspark_ops {

inline constexpr const char* kSchemas[] = {
  // Lossless speculative verification of a block of draft tokens against target logits (README
  // "verify"): accepts the longest valid prefix and emits one more token, stateless Philox. The
  // target distribution is filtered by the allowed-token bitmask and top-k / top-p / min-p
  // (README "Sampling filters"); logprobs is [B, G+1] when return_logprobs, else [B, 0].
  "verify(Tensor target_logits, Tensor draft_tokens, Tensor num_draft, Tensor temperature, "
      "Tensor seed, Tensor position, Tensor? draft_logits=None, Tensor? target_start=None, "
      "Tensor? draft_temperature=None, Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, Tensor? allowed_token_mask=None, bool return_logprobs=False) "
      "-> (Tensor tokens, Tensor num_accepted, Tensor valid, Tensor logprobs)",
  // The sequential drafting stage (README "Drafting"): the whole block of G slots in one call,
  // each slot's logits corrected by W2 . W1[previous token] (Markov head) or W2 . tanh(o) (RNN
  // head) and sampled from the draft stream; returns the tokens and the corrected
  // pre-temperature logits, -inf where the sampling filters (README "Sampling filters") drop a
  // token; float32, or bfloat16 with draft_logits_dtype (the token then drawn from the rounded
  // logits).
  "markov_draft(Tensor base_logits, Tensor anchor, Tensor w1, Tensor w2, Tensor temperature, "
      "Tensor seed, Tensor position, Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, ScalarType? draft_logits_dtype=None) "
      "-> (Tensor tokens, Tensor draft_logits)",
  "rnn_draft(Tensor base_logits, Tensor anchor, Tensor hidden, Tensor w1, Tensor w2, "
      "Tensor joint_weight, Tensor joint_bias, Tensor temperature, Tensor seed, Tensor position, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
      "ScalarType? draft_logits_dtype=None) -> (Tensor tokens, Tensor draft_logits)",
  // Conditional draft confidences sigmoid((w . [h_j; W1[x_j]] + b) / tau_j), float32 [B, G].
  "draft_confidence(Tensor hidden, Tensor prev_tokens, Tensor w1, Tensor weight, "
      "Tensor? bias=None, Tensor? calib_temperature=None) -> Tensor",
  // Algorithm 1 of DSpark (README "Scheduling"): per-request verify lengths admitted in survival
  // order while expected tokens x step rate strictly improves, stopping at the first admission
  // that does not.
  "schedule_verify(Tensor confidence, Tensor step_rate, Tensor? max_verify=None) -> Tensor",
  // Global search of the verify token budget K in [B, M) on (stale) confidences; int32 [1].
  "plan_verify_budget(Tensor confidence, Tensor step_rate) -> Tensor",
  // Per-request verify lengths admitting the top budget - B survivals.
  "allocate_verify(Tensor confidence, Tensor budget, Tensor? max_verify=None) -> Tensor",
  // Flattens [x0, x_1..x_l] of every request into one ragged target batch.
  "pack_verify_inputs(Tensor anchor, Tensor draft_tokens, Tensor num_verify, Tensor position) "
      "-> (Tensor input_ids, Tensor positions, Tensor cu_seqlens)",
  // Block drafting attention (README "Block drafting attention"): the G block slots attend
  // non-causally to all G block keys and to their request's context cache rows
  // [max(0, p0 - window), p0); lse is [B, G, Hq] float32 when return_lse, else empty.
  "block_draft_attention(Tensor q, Tensor k_block, Tensor v_block, Tensor k_cache, "
      "Tensor v_cache, Tensor cache_seqlens, Tensor? cache_slot=None, float? softmax_scale=None, "
      "int? window=None, bool return_lse=False) -> (Tensor out, Tensor lse)",
  // Appends context K/V rows at cache_seqlens and advances it (never past L), in place.
  "append_context_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
      "Tensor num_new, Tensor(c!) cache_seqlens, Tensor? cache_slot=None) -> ()",
  // The uniforms every sampling op draws: element k of stream (seed[i], position[i], purpose).
  "philox_uniform(Tensor seed, Tensor position, int purpose, int count) -> Tensor",
  // DSpark's training loss over N rows (README "Training loss"), never holding more than a chunk
  // of [rows, V] logits: loss = sum_i weights_i (term_scale[0] ce_i + term_scale[1] l1_i), the
  // per-row ce and l1 (float32, float64 for float64 inputs; l1 is [0] without target_hidden) and, with compute_grad, the
  // loss's gradients (hidden, markov_latent, markov_w2; lm_head_weight with lm_head_grad), [0]
  // where not computed. logit_softcap s caps the LM head's products before the Markov bias:
  // z = s tanh(W h / s) + W2 u, t = s tanh(W g / s) (Gemma4's final_logit_softcapping).
  "dspark_loss(Tensor hidden, Tensor lm_head_weight, Tensor labels, Tensor weights, "
      "Tensor term_scale, Tensor? target_hidden=None, Tensor? markov_latent=None, "
      "Tensor? markov_w2=None, bool compute_grad=False, bool lm_head_grad=False, "
      "int chunk_rows=0, float? logit_softcap=None) -> (Tensor loss, Tensor ce, Tensor l1, "
      "Tensor grad_hidden, Tensor grad_markov_latent, Tensor grad_markov_w2, "
      "Tensor grad_lm_head_weight)",
};

}  // namespace dspark_ops
