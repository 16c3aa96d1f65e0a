#include "loss_args.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>

#include "../common/checks.h"

namespace dspark_ops {

namespace {
constexpr const char* kOp = "dspark_loss";

void check_matrix(const char* name, const at::Tensor& t, const at::Tensor& hidden, int64_t rows,
                  int64_t cols, const char* expected) {
  check_dim(kOp, name, t, {2}, expected);
  check_device(kOp, name, t, hidden, "hidden");
  TORCH_CHECK_TYPE(t.scalar_type() == hidden.scalar_type(), kOp, "(): '", name,
                   "' must have hidden's dtype ", hidden.scalar_type(), ", got ", t.scalar_type());
  check_shape(kOp, name, t, {rows, cols}, expected);
}
}  // namespace

LossArgs check_dspark_loss_args(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                const at::Tensor& labels, const at::Tensor& weights,
                                const at::Tensor& term_scale,
                                const std::optional<at::Tensor>& target_hidden,
                                const std::optional<at::Tensor>& markov_latent,
                                const std::optional<at::Tensor>& markov_w2, bool compute_grad,
                                bool lm_head_grad, int64_t chunk_rows,
                                std::optional<double> logit_softcap,
                                int64_t default_scratch_bytes) {
  LossArgs a;
  check_dim(kOp, "hidden", hidden, {2}, "2-D [N, d]");
  check_dtype(kOp, "hidden", hidden, {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble});
  a.rows = hidden.size(0);
  a.hidden_size = hidden.size(1);
  check_dim(kOp, "lm_head_weight", lm_head_weight, {2}, "2-D [V, d]");
  a.vocab = lm_head_weight.size(0);
  TORCH_CHECK_VALUE(a.vocab >= 1, kOp, "(): 'lm_head_weight' must have at least one row (V >= 1)");
  check_matrix("lm_head_weight", lm_head_weight, hidden, a.vocab, a.hidden_size, "[V, d]");

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
    check_matrix("target_hidden", *target_hidden, hidden, a.rows, a.hidden_size, "[N, d]");
    a.target_hidden = *target_hidden;
  }
  TORCH_CHECK_VALUE(markov_latent.has_value() == markov_w2.has_value(), kOp,
                    "(): 'markov_latent' and 'markov_w2' must be given together (got ",
                    markov_latent.has_value() ? "markov_latent" : "markov_w2", " alone)");
  if (markov_latent.has_value()) {
    check_dim(kOp, "markov_latent", *markov_latent, {2}, "2-D [N, r]");
    a.rank = markov_latent->size(1);
    check_matrix("markov_latent", *markov_latent, hidden, a.rows, a.rank, "[N, r]");
    check_matrix("markov_w2", *markov_w2, hidden, a.vocab, a.rank, "[V, r]");
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
  a.chunk_rows =
      chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, default_scratch_bytes / per_row);
  a.chunk_rows = std::max<int64_t>(1, std::min(a.chunk_rows, a.rows));

  // The kernels guard out-of-range labels (their row's ce is NaN); the checks say so first.
  if (value_checks_enabled(labels)) {
    check_values_in_range(kOp, "labels", a.labels, 0, a.vocab - 1);
    check_finite_non_negative(kOp, "weights", a.weights);
  }
  return a;
}

namespace {
// acc (float32, float64 for float64 inputs) = or += a @ b. 16-bit products round once to their
// dtype before they are added.
void accumulate_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (a.scalar_type() == acc.scalar_type()) {
    if (first) {
      at::mm_out(acc, a, b);
    } else {
      acc.addmm_(a, b);
    }
  } else if (first) {
    acc.copy_(at::mm(a, b));
  } else {
    acc.add_(at::mm(a, b));
  }
}
}  // namespace

LossResult run_dspark_loss(const LossArgs& a, LossRowKernel kernel) {
  // Per-row results and gradient sums: float32, float64 for float64 inputs.
  const auto f32 = a.hidden.options().dtype(
      a.hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const bool has_t = a.target_hidden.defined(), has_u = a.markov_latent.defined();
  // With a cap the Markov bias is added after it, by the kernel: the bias has its own scratch,
  // and z keeps W h, whose tanh the cap's slope needs.
  const bool bias_apart = a.softcap > 0 && has_u;
  auto ce = at::empty({a.rows}, f32);
  auto l1 = at::empty({has_t ? a.rows : 0}, f32);
  // Outputs never alias: a gradient not computed is its own empty tensor.
  const auto none = [&] { return at::empty({0}, a.hidden.options()); };
  auto grad_hidden = a.grad ? at::empty({a.rows, a.hidden_size}, a.hidden.options()) : none();
  auto grad_latent = a.grad && has_u ? at::empty({a.rows, a.rank}, a.hidden.options()) : none();
  auto grad_w2 = a.grad && has_u ? at::empty({a.vocab, a.rank}, f32) : none();
  auto grad_lm_head = a.lm_head_grad ? at::empty({a.vocab, a.hidden_size}, f32) : none();

  const auto W = a.lm_head_weight;
  const int64_t C = a.chunk_rows;
  // Scratch of one chunk, reused: the only [rows, V] memory the op holds.
  auto z_buffer = at::empty({a.rows > 0 ? C : 0, a.vocab}, a.hidden.options());
  auto t_buffer = at::empty({has_t && a.rows > 0 ? C : 0, a.vocab}, a.hidden.options());
  auto bias_buffer = at::empty({bias_apart && a.rows > 0 ? C : 0, a.vocab}, a.hidden.options());
  for (int64_t start = 0; start < a.rows; start += C) {
    const int64_t n = std::min(C, a.rows - start);
    const bool first = start == 0;
    const auto h = a.hidden.narrow(0, start, n);
    LossChunk chunk;
    chunk.z = z_buffer.narrow(0, 0, n);
    at::mm_out(chunk.z, h, W.t());
    at::Tensor u;
    if (has_u) {
      u = a.markov_latent.narrow(0, start, n);
      if (bias_apart) {
        chunk.bias = bias_buffer.narrow(0, 0, n);
        at::mm_out(chunk.bias, u, a.markov_w2.t());
      } else {
        chunk.z.addmm_(u, a.markov_w2.t());
      }
    }
    at::Tensor g;
    if (has_t) {
      g = a.target_hidden.narrow(0, start, n);
      chunk.t = t_buffer.narrow(0, 0, n);
      at::mm_out(chunk.t, g, W.t());
      chunk.l1 = l1.narrow(0, start, n);
    }
    chunk.labels = a.labels.narrow(0, start, n);
    chunk.weights = a.weights.narrow(0, start, n);
    chunk.term_scale = a.term_scale;
    chunk.ce = ce.narrow(0, start, n);
    chunk.grad = a.grad;
    chunk.t_grad = a.lm_head_grad && has_t;
    chunk.softcap = a.softcap;
    kernel(chunk);
    if (!a.grad) continue;
    // z (and t) now hold the loss's gradients with respect to the LM head's products W h (and
    // W g): the logits' gradients, times the cap's slope with a cap. The Markov bias gets the
    // logits' own: bias holds them with a cap, z without one.
    auto gh = grad_hidden.narrow(0, start, n);
    at::mm_out(gh, chunk.z, W);
    if (has_u) {
      const auto& dz = bias_apart ? chunk.bias : chunk.z;
      auto gu = grad_latent.narrow(0, start, n);
      at::mm_out(gu, dz, a.markov_w2);
      accumulate_product(grad_w2, dz.t(), u, first);
    }
    if (a.lm_head_grad) {
      accumulate_product(grad_lm_head, chunk.z.t(), h, first);
      if (has_t) accumulate_product(grad_lm_head, chunk.t.t(), g, false);
    }
  }
  if (a.rows == 0) {
    // Nothing was accumulated: the gradients of an empty sum are zero.
    if (grad_w2.numel() > 0) grad_w2.zero_();
    if (grad_lm_head.numel() > 0) grad_lm_head.zero_();
  }
  auto per_row = ce * a.term_scale.select(0, 0);
  if (has_t) per_row = per_row + l1 * a.term_scale.select(0, 1);
  auto loss = (a.weights * per_row).sum();
  if (grad_w2.numel() > 0) grad_w2 = grad_w2.to(a.markov_w2.scalar_type());
  if (grad_lm_head.numel() > 0) grad_lm_head = grad_lm_head.to(W.scalar_type());
  return {loss, ce, l1, grad_hidden, grad_latent, grad_w2, grad_lm_head};
}

}  // namespace dspark_ops
