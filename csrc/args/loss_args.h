// The device-independent half of dspark_loss: its entry (argument and value checks), and the
// row-chunk loop shared by the CPU and CUDA kernels. The loop's matrix products go through ATen
// (cuBLAS on CUDA, the CPU BLAS on CPU); each backend's run is the kernel that walks the
// vocabulary of a chunk of rows (cpu/loss_cpu.cpp, kernels/loss.cuh).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "../common/backend.h"
#include "../common/checks.h"

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

// loss, ce, l1, then the gradients of hidden, markov_latent, markov_w2 and lm_head_weight.
using LossResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Allocates the outputs and walks the rows chunk by chunk, `kernel` doing each chunk's
// vocabulary pass.
LossResult run_dspark_loss(const LossArgs& args, LossRowKernel kernel);

// The row-chunk size when the caller passes 0: the z and t scratch of a chunk within this many
// bytes (at least one row), the rows spread evenly over the fewest such chunks. CUDA wants chunks
// that fill the GPU (a block per row: at most 441 rows at V = 151,936 in bf16, so 3,584 rows are
// nine chunks of 399 or 392); on CPU a row's pass runs in cache whatever the chunk, which only needs to
// keep the products efficient, so it holds half as much.
constexpr int64_t kLossScratchBytesCuda = int64_t{256} << 20;
constexpr int64_t kLossScratchBytesCpu = int64_t{128} << 20;

// lm_head_weight, target_hidden, markov_latent and markov_w2: 2-D, on hidden's device, in
// hidden's dtype, of shape [rows, cols] (`expected` in messages).
void check_loss_matrix(const char* name, const at::Tensor& t, const at::Tensor& hidden,
                       int64_t rows, int64_t cols, const char* expected);

namespace ops {

// Backend::kTakesFloat64: whether its kernels take float64 inputs; Backend::kScratchBytes: the
// default chunk's scratch (kLossScratchBytesCpu / kLossScratchBytesCuda).
template <typename Backend>
LossResult dspark_loss(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                       const at::Tensor& labels, const at::Tensor& weights,
                       const at::Tensor& term_scale, const std::optional<at::Tensor>& target_hidden,
                       const std::optional<at::Tensor>& markov_latent,
                       const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                       bool lm_head_grad, int64_t chunk_rows,
                       std::optional<double> logit_softcap) {
  constexpr const char* kOp = "dspark_loss";
  TORCH_CHECK_TYPE(Backend::kTakesFloat64 || hidden.scalar_type() != at::kDouble,
                   "dspark_loss(): float64 'hidden' runs on CPU only; on CUDA use float32, "
                   "bfloat16 or float16");
  LossArgs a;
  check_dim(kOp, "hidden", hidden, {2}, "2-D [N, d]");
  check_dtype(kOp, "hidden", hidden, {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble});
  a.rows = hidden.size(0);
  a.hidden_size = hidden.size(1);
  check_dim(kOp, "lm_head_weight", lm_head_weight, {2}, "2-D [V, d]");
  a.vocab = lm_head_weight.size(0);
  TORCH_CHECK_VALUE(a.vocab >= 1, kOp, "(): 'lm_head_weight' must have at least one row (V >= 1)");
  check_loss_matrix("lm_head_weight", lm_head_weight, hidden, a.vocab, a.hidden_size, "[V, d]");

  check_dim(kOp, "labels", labels, {1}, "1-D [N]");
  check_device(kOp, "labels", labels, hidden, "hidden");
  check_dtype(kOp, "labels", labels, {at::kLong, at::kInt});
  check_shape(kOp, "labels", labels, {a.rows}, "[N]");
  check_dim(kOp, "weights", weights, {1}, "1-D [N]");
  check_device(kOp, "weights", weights, hidden, "hidden");
  check_dtype(kOp, "weights", weights, {at::kFloat});
  check_shape(kOp, "weights", weights, {a.rows}, "[N]");
  check_device(kOp, "term_scale", term_scale, hidden, "hidden");
  // The loss's scalars carry the precision of its sums: float64 with float64 inputs.
  check_dtype(kOp, "term_scale", term_scale,
              {hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat});
  check_shape(kOp, "term_scale", term_scale, {2}, "[2]");

  if (target_hidden.has_value()) {
    check_loss_matrix("target_hidden", *target_hidden, hidden, a.rows, a.hidden_size, "[N, d]");
    a.target_hidden = *target_hidden;
  }
  TORCH_CHECK_VALUE(markov_latent.has_value() == markov_w2.has_value(), kOp,
                    "(): 'markov_latent' and 'markov_w2' must be given together (got ",
                    markov_latent.has_value() ? "markov_latent" : "markov_w2", " alone)");
  if (markov_latent.has_value()) {
    check_dim(kOp, "markov_latent", *markov_latent, {2}, "2-D [N, r]");
    a.rank = markov_latent->size(1);
    check_loss_matrix("markov_latent", *markov_latent, hidden, a.rows, a.rank, "[N, r]");
    check_loss_matrix("markov_w2", *markov_w2, hidden, a.vocab, a.rank, "[V, r]");
    a.markov_latent = *markov_latent;
    a.markov_w2 = *markov_w2;
  }
  TORCH_CHECK_VALUE(chunk_rows >= 0, kOp, "(): 'chunk_rows' must be >= 0 (0 chooses), got ",
                    chunk_rows);
  if (logit_softcap.has_value()) {
    // The kernels cap in float32 (float64 inputs in float64): s must stay finite and nonzero
    // as a float32 too, or s tanh(x / s) would be inf * 0 or 0 * tanh(NaN).
    const double s = *logit_softcap;
    const float s32 = static_cast<float>(s);
    TORCH_CHECK_VALUE(std::isfinite(s) && s > 0 && std::isfinite(s32) && s32 > 0, kOp,
                      "(): 'logit_softcap' must be finite and > 0 as a float32 (None: no cap), "
                      "got ", s);
    a.softcap = s;
  }

  a.hidden = hidden;
  a.lm_head_weight = lm_head_weight;
  a.labels = labels.to(at::kLong).contiguous();
  a.weights = weights.contiguous();
  a.term_scale = term_scale.contiguous();
  a.grad = compute_grad || lm_head_grad;
  a.lm_head_grad = lm_head_grad;
  // Scratch rows per chunk row: z, t with a target, the Markov bias apart with a cap.
  const int64_t buffers = 1 + (a.target_hidden.defined() ? 1 : 0) +
                          (a.softcap > 0 && a.markov_latent.defined() ? 1 : 0);
  const int64_t per_row = a.vocab * static_cast<int64_t>(hidden.element_size()) * buffers;
  if (chunk_rows > 0) {
    a.chunk_rows = chunk_rows;
  } else {
    // The fewest chunks the scratch allows, with the rows spread evenly over them: a short last
    // chunk would read all of the LM head for a few rows in each of its products.
    const int64_t most = std::max<int64_t>(1, Backend::kScratchBytes / per_row);
    const int64_t chunks = std::max<int64_t>(1, (a.rows + most - 1) / most);
    a.chunk_rows = (a.rows + chunks - 1) / chunks;
  }
  a.chunk_rows = std::max<int64_t>(1, std::min(a.chunk_rows, a.rows));

  // The kernels guard out-of-range labels (their row's ce is NaN); the checks say so first.
  if (value_checks_enabled(labels)) {
    check_values_in_range(kOp, "labels", a.labels, 0, a.vocab - 1);
    check_finite_non_negative(kOp, "weights", a.weights);
  }
  const typename Backend::Guard guard(hidden.device());
  return run_dspark_loss(a, &Backend::run);
}

}  // namespace ops

}  // namespace dspark_ops
