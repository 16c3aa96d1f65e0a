// The dspark_ops operator library: every schema, defined once. Backends register their kernels
// with TORCH_LIBRARY_IMPL in cpu/<family>_cpu.cpp and cuda/<family>_cuda.cu; fake (meta) kernels
// for torch.compile live in dspark_ops/ops/<family>.py.
#include <torch/library.h>

TORCH_LIBRARY(dspark_ops, m) {
  // Lossless speculative verification of a block of draft tokens against target logits
  // (SPEC §3.1): accepts the longest valid prefix and emits one more token, stateless Philox.
  m.def(
      "verify(Tensor target_logits, Tensor draft_tokens, Tensor num_draft, Tensor temperature, "
      "Tensor seed, Tensor position, Tensor? draft_logits=None, Tensor? target_start=None, "
      "Tensor? draft_temperature=None) -> (Tensor tokens, Tensor num_accepted, Tensor valid)",
      {at::Tag::pt2_compliant_tag});
  // The uniforms every sampling op draws: element k of stream (seed[i], position[i], purpose).
  m.def("philox_uniform(Tensor seed, Tensor position, int purpose, int count) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}
