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
#pragma once

#include <math.h>

#include <cmath>

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
