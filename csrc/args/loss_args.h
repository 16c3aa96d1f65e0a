// The device-independent half of dspark_loss: argument and value checks, and the row-chunk loop
// shared by the CPU and CUDA kernels. The loop's matrix products go through ATen (cuBLAS on
// CUDA, the CPU BLAS on CPU); each backend supplies the kernel that walks the vocabulary of a
// chunk of rows (cpu/loss_cpu.cpp, kernels/loss.cuh).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "../ops.h"  // LossResult

namespace dspark_ops {

struct LossArgs {
  at::Tensor hidden;          // [N, d]
  at::Tensor lm_head_weight;  // [V, d], hidden's dtype
  at::Tensor labels;          // int64 [N], contiguous
  at::Tensor weights;         // float32 [N], contiguous
  at::Tensor term_scale;      // [2] float32 (float64 with float64 inputs), contiguous: (ce, l1)
                              // coefficients per unit weight
  at::Tensor target_hidden;   // [N, d] or undefined
  at::Tensor markov_latent;   // [N, r] or undefined
  at::Tensor markov_w2;       // [V, r] or undefined (with markov_latent)
  bool grad = false;          // compute the gradients of the loss during the forward
  bool lm_head_grad = false;  // ... and the LM head's
  double softcap = 0;         // logit_softcap, 0 for none
  int64_t rows = 0, vocab = 0, hidden_size = 0, rank = 0, chunk_rows = 0;
};

LossArgs check_dspark_loss_args(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                const at::Tensor& labels, const at::Tensor& weights,
                                const at::Tensor& term_scale,
                                const std::optional<at::Tensor>& target_hidden,
                                const std::optional<at::Tensor>& markov_latent,
                                const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                                bool lm_head_grad, int64_t chunk_rows,
                                std::optional<double> logit_softcap,
                                int64_t default_scratch_bytes);

// One chunk of C rows as the backend kernel sees it. z, bias and t are contiguous [C, V] in the
// inputs' dtype. Without a soft cap, z holds the draft logits W h + W2 u and t the target logits
// W g; with `grad` the kernel overwrites z with d loss / d z, with `t_grad` t with d loss / d t.
// With a cap s (softcap > 0) the buffers hold the LM head's products W h and W g, and, with a
// Markov head, bias holds W2 u: the kernel caps as it reads (z = s tanh(W h / s) + W2 u,
// t = s tanh(W g / s)) and overwrites z with d loss / d (W h), t with d loss / d (W g) (the
// logits' gradients times the cap's slope 1 - tanh^2) and bias with d loss / d z.
struct LossChunk {
  at::Tensor z;           // draft logits W h + W2 u; W h with a cap
  at::Tensor bias;        // W2 u with a cap and a Markov head, else undefined
  at::Tensor t;           // target logits W g, or undefined
  at::Tensor labels;      // int64 [C]
  at::Tensor weights;     // float32 [C]
  at::Tensor term_scale;  // [2], as LossArgs::term_scale
  at::Tensor ce;          // [C], out: float32 (float64 for float64 inputs)
  at::Tensor l1;          // [C], out, as ce (undefined without t)
  bool grad = false, t_grad = false;
  double softcap = 0;     // s, 0 for no cap
};
using LossRowKernel = void (*)(const LossChunk&);

LossResult run_dspark_loss(const LossArgs& args, LossRowKernel kernel);

// The row-chunk size when the caller passes 0: the z and t scratch of a chunk within this many
// bytes (at least one row). CUDA wants chunks that fill the GPU (a block per row: 441 rows at
// V = 151,936 in bf16); on CPU a row's pass runs in cache whatever the chunk, which only needs to
// keep the products efficient, so it holds half as much.
constexpr int64_t kLossScratchBytesCuda = int64_t{256} << 20;
constexpr int64_t kLossScratchBytesCpu = int64_t{128} << 20;

}  // namespace dspark_ops
