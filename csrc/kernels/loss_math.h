// Scalar math of dspark_loss, shared by the CPU and CUDA kernels (torch-free).
//
// Per row i (docs/semantics.md §3.7): z the draft logits, t the target logits, y the label,
// p = softmax(z), q = softmax(t), s_v = sign(p_v - q_v) (0 at a tie, as torch.abs's gradient),
//   ce = lse(z) - z_y,   l1 = sum_v |p_v - q_v|,   <s,p> = sum_v s_v p_v,   <s,q> = sum_v s_v q_v
// and, with a = w_i * ce_scale and b = w_i * l1_scale (the row's coefficients in the loss),
//   d loss / d z_v = a (p_v - [v = y]) + b p_v (s_v - <s,p>)
//   d loss / d t_v = -b q_v (s_v - <s,q>)
// (d l1 / d z_v = sum_k s_k p_k (delta_kv - p_v); the target side is the same with q and a minus
// sign). The two logsumexps are accumulated online: (max, sum of exp(x - max)) pairs that merge
// in any order.
//
// With a logit soft cap s (Gemma4's final_logit_softcapping), the LM head's products x = W h and
// W g become cap(x) = s tanh(x / s) before the Markov bias is added, z = cap(W h) + W2 u,
// t = cap(W g); the products' gradients are the logits' times cap'(x) = 1 - tanh^2(x / s), and
// the bias's are the logits' own.
#pragma once

#include <math.h>

#include <cmath>
#include <limits>

#include "../common/philox.h"  // DSPARK_HOST_DEVICE

namespace dspark_ops {

struct LogSumExp {
  float max;  // -inf while nothing was added
  float sum;  // sum of exp(x - max)
};

DSPARK_HOST_DEVICE float loss_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}

// Adds x to a record: exp(-inf) = 0 adds nothing, a tie with the maximum adds exp(0) = 1 (also
// at +inf, where x - max would be NaN: the logsumexp is then +inf, as torch.logsumexp gives), and
// a NaN (x, or the record's) makes the record NaN for good: a NaN sum under a -inf maximum would
// be merged away as an empty record when the NaN is all a thread saw.
DSPARK_HOST_DEVICE LogSumExp lse_add(LogSumExp a, float x) {
  if (x > a.max) return LogSumExp{x, a.sum * loss_exp(a.max - x) + 1.f};  // a.max = -inf: 0
  if (x < a.max) return LogSumExp{a.max, a.sum + loss_exp(x - a.max)};
  if (x == a.max) return x == -INFINITY ? a : LogSumExp{a.max, a.sum + 1.f};
  return LogSumExp{NAN, NAN};
}

DSPARK_HOST_DEVICE LogSumExp lse_merge(LogSumExp a, LogSumExp b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  if (a.max == b.max) return LogSumExp{a.max, a.sum + b.sum};  // +inf ties too
  return a.max > b.max ? LogSumExp{a.max, a.sum + b.sum * loss_exp(b.max - a.max)}
                       : LogSumExp{b.max, b.sum + a.sum * loss_exp(a.max - b.max)};
}

DSPARK_HOST_DEVICE float lse_value(LogSumExp a) {
#if defined(__CUDA_ARCH__)
  return a.max + logf(a.sum);
#else
  return a.max + std::log(a.sum);
#endif
}

DSPARK_HOST_DEVICE float loss_tanh(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

DSPARK_HOST_DEVICE double loss_tanh(double x) {
#if defined(__CUDA_ARCH__)
  return tanh(x);
#else
  return std::tanh(x);
#endif
}

// cap(x) = s tanh(x / s) and its slope 1 - tanh^2(x / s), as autograd of torch.tanh has it (the
// slope from the rounded tanh: exactly 0 where tanh rounds to +-1). x / s is taken as x times
// inv_s = 1 / s (soft_cap_inverse): a multiply per element where an IEEE division would cost a
// dozen instructions and a slow-path branch on the GPU; it differs from x / s by at most an ulp.
template <typename F>
struct SoftCapped {
  F value;
  F slope;
};

template <typename F>
DSPARK_HOST_DEVICE SoftCapped<F> soft_cap(F x, F s, F inv_s) {
  const F th = loss_tanh(x * inv_s);
  return SoftCapped<F>{s * th, F(1) - th * th};
}

// 1 / s in F, at most F's largest finite value: for a subnormal float32 s the products then
// overflow to +-inf (tanh +-1, as x / s would) instead of giving 0 * inf = NaN at x = 0.
template <typename F>
inline F soft_cap_inverse(double s) {
  const double inv = 1.0 / s;
  const double largest = static_cast<double>(std::numeric_limits<F>::max());
  return static_cast<F>(inv < largest ? inv : largest);
}

// sign(p - q): +1, -1, or 0 at a tie. (Templates: the CPU kernel also runs float64 inputs in
// float64.)
template <typename F>
DSPARK_HOST_DEVICE F l1_sign(F p, F q) {
  return p > q ? F(1) : (p < q ? F(-1) : F(0));
}

// Running sums of the second pass over a row.
template <typename F>
struct L1SumsOf {
  F l1;  // sum |p - q|
  F sp;  // <s, p>
  F sq;  // <s, q>
};
using L1Sums = L1SumsOf<float>;

template <typename F>
DSPARK_HOST_DEVICE L1SumsOf<F> l1_merge(L1SumsOf<F> a, L1SumsOf<F> b) {
  return L1SumsOf<F>{a.l1 + b.l1, a.sp + b.sp, a.sq + b.sq};
}

template <typename F>
DSPARK_HOST_DEVICE F draft_logit_grad(F p, F s, bool is_label, F a, F b, F sp) {
  return a * (p - (is_label ? F(1) : F(0))) + b * p * (s - sp);
}

template <typename F>
DSPARK_HOST_DEVICE F target_logit_grad(F q, F s, F b, F sq) {
  return -b * q * (s - sq);
}

}  // namespace dspark_ops
