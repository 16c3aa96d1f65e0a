#include "loss_args.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>

#include "../common/checks.h"

namespace dspark_ops {

void check_loss_matrix(const char* name, const at::Tensor& t, const at::Tensor& hidden,
                       int64_t rows, int64_t cols, const char* expected) {
  constexpr const char* kOp = "dspark_loss";
  check_dim(kOp, name, t, {2}, expected);
  check_device(kOp, name, t, hidden, "hidden");
  TORCH_CHECK_TYPE(t.scalar_type() == hidden.scalar_type(), kOp, "(): '", name,
                   "' must have hidden's dtype ", hidden.scalar_type(), ", got ", t.scalar_type());
  check_shape(kOp, name, t, {rows, cols}, expected);
}

namespace {
// acc (float32) = or += a @ b for 16-bit CUDA factors, from cuBLAS's float32 output: the sum is
// read and written once, in the product's epilogue. False where this build or PyTorch has no
// such product: aten::mm.dtype and addmm.dtype exist from PyTorch 2.8, for CUDA tensors only.
bool float32_output_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                            bool first) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (!a.is_cuda() || acc.scalar_type() != at::kFloat) return false;
  if (first) {
    at::mm_out(acc, a, b, at::kFloat);
    return true;
  }
  // Whether addmm.dtype takes a float32 `self` (the sum it adds to) with 16-bit factors: PyTorch
  // 2.14 does; the first versions with the overload refused it, in their argument checks before
  // any work. Asked once per process, of an empty product on the device (nothing is read).
  static const bool float32_sum_accepted = [&] {
    auto sum = at::empty({1, 1}, acc.options());
    const auto m = at::empty({1, 0}, a.options());
    try {
      at::addmm_out(sum, sum, m, m.t(), at::kFloat, /*beta=*/0);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  if (!float32_sum_accepted) return false;
  at::addmm_out(acc, acc, a, b, at::kFloat);
  return true;
#else
  (void)acc, (void)a, (void)b, (void)first;
  return false;
#endif
}

// acc (float32, float64 for float64 inputs) = or += a @ b. A 16-bit product without a float32
// output (on the CPU) rounds once to its dtype and an element-wise kernel adds it: one more pass
// over the sum, and one more rounding.
void accumulate_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (a.scalar_type() == acc.scalar_type()) {
    if (first) {
      at::mm_out(acc, a, b);
    } else {
      acc.addmm_(a, b);
    }
    return;
  }
  if (float32_output_product(acc, a, b, first)) return;
  if (first) {
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
    at::Tensor u;
    if (has_u) u = a.markov_latent.narrow(0, start, n);
    if (has_u && !bias_apart) {
      // The bias first, then W h added to it by the head's product (beta = 1): the same bytes
      // as adding the bias afterwards, but z's second read and write fall in the epilogue of
      // the compute-bound product instead of making the small one memory-bound.
      at::mm_out(chunk.z, u, a.markov_w2.t());
      chunk.z.addmm_(h, W.t());
    } else {
      at::mm_out(chunk.z, h, W.t());
      if (bias_apart) {
        chunk.bias = bias_buffer.narrow(0, 0, n);
        at::mm_out(chunk.bias, u, a.markov_w2.t());
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
