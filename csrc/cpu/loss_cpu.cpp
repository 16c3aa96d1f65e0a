// CPU kernel of dspark_loss (docs/semantics.md §3.7): the row-chunk loop of args/loss_args.cpp
// with this file's vocabulary pass.
//
// Each row of a chunk is one task. Its draft and target logits are copied once into two scratch
// rows of the thread (float32, or float64 for float64 inputs; they stay in L2 for vocabularies up
// to ~64k), then vectorised loops run over the cached rows: the maxima, exp(x - max) with the two
// sums (so the logsumexps, ce, p and q), the L1 sums |p - q|, <s,p>, <s,q>, and, for training, the
// logits' gradients (kernels/loss_math.h), written back over the chunk's logits. Sums are kept per
// vector lane and added lane by lane at the end: a row's results do not depend on the thread count.
// With a logit soft cap the scratch rows are capped as they are loaded (the Markov bias added
// after the cap) and keep the cap's slope beside them for the gradients.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../args/loss_args.h"
#include "../common/dispatch.h"
#include "../kernels/loss_math.h"
#include "convert.h"

namespace dspark_ops {
namespace {

// The arithmetic type of a row: float32, float64 for float64 inputs.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename F>
F reduce_lanes(const at::vec::Vectorized<F>& v) {
  F lanes[at::vec::Vectorized<F>::size()];
  v.store(lanes);
  F out = 0;
  for (F lane : lanes) out += lane;
  return out;
}

// dst = src as F: float64 rows as they are, the others through convert.h to_float.
template <typename T, typename F>
void load_row(const T* src, int64_t n, F* dst) {
  if constexpr (std::is_same_v<T, double>) {
    std::copy(src, src + n, dst);
  } else {
    to_float(src, n, dst);
  }
}

template <typename F, typename T>
void store_row(const F* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, F>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename F>
F row_max(const F* x, int64_t n) {
  using Vec = at::vec::Vectorized<F>;
  Vec m(-std::numeric_limits<F>::infinity());
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) m = at::vec::maximum(m, Vec::loadu(x + v));
  F lanes[Vec::size()];
  m.store(lanes);
  F out = -std::numeric_limits<F>::infinity();
  for (F lane : lanes) out = std::max(out, lane);
  for (; v < n; ++v) out = std::max(out, x[v]);
  return out;
}

// x = exp(x - max) in place; returns the sum.
template <typename F>
F exp_shifted(F* x, int64_t n, F max) {
  using Vec = at::vec::Vectorized<F>;
  const Vec shift(max);
  Vec sum(F(0));
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) {
    const Vec e = (Vec::loadu(x + v) - shift).exp();
    e.store(x + v);
    sum = sum + e;
  }
  F out = reduce_lanes(sum);
  for (; v < n; ++v) {
    x[v] = std::exp(x[v] - max);
    out += x[v];
  }
  return out;
}

template <typename F>
void scale_row(F* x, int64_t n, F factor) {
  using Vec = at::vec::Vectorized<F>;
  const Vec f(factor);
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) (Vec::loadu(x + v) * f).store(x + v);
  for (; v < n; ++v) x[v] *= factor;
}

template <typename F>
L1SumsOf<F> l1_sums(const F* p, const F* q, int64_t n) {
  using Vec = at::vec::Vectorized<F>;
  Vec l1(F(0)), sp(F(0)), sq(F(0));
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) {
    const Vec pv = Vec::loadu(p + v), qv = Vec::loadu(q + v);
    const Vec s = pv.gt(qv) - pv.lt(qv);
    l1 = l1 + (pv - qv).abs();
    sp = sp + s * pv;
    sq = sq + s * qv;
  }
  L1SumsOf<F> out{reduce_lanes(l1), reduce_lanes(sp), reduce_lanes(sq)};
  for (; v < n; ++v) {
    const F s = l1_sign(p[v], q[v]);
    out = l1_merge(out, L1SumsOf<F>{std::abs(p[v] - q[v]), s * p[v], s * q[v]});
  }
  return out;
}

// x = s tanh(x / s) + bias (bias may be nullptr) in place, and slope = 1 - tanh^2(x / s) where
// slope is not nullptr (kernels/loss_math.h: x / s as x * inv_s).
template <typename F>
void soft_cap_row(F* x, int64_t n, F s, F inv_s, const F* bias, F* slope) {
  using Vec = at::vec::Vectorized<F>;
  const Vec cap(s), inv(inv_s), one(F(1));
  int64_t v = 0;
  for (; v + Vec::size() <= n; v += Vec::size()) {
    const Vec th = (Vec::loadu(x + v) * inv).tanh();
    Vec out = cap * th;
    if (bias != nullptr) out = out + Vec::loadu(bias + v);
    out.store(x + v);
    if (slope != nullptr) (one - th * th).store(slope + v);
  }
  for (; v < n; ++v) {
    const SoftCapped<F> c = soft_cap(x[v], s, inv_s);
    x[v] = bias != nullptr ? c.value + bias[v] : c.value;
    if (slope != nullptr) slope[v] = c.slope;
  }
}

// p = softmax(x) in place; returns logsumexp(x).
template <typename F>
F softmax_row(F* x, int64_t n) {
  const F max = row_max(x, n);
  const F sum = exp_shifted(x, n, max);
  scale_row(x, n, F(1) / sum);
  return max + std::log(sum);
}

template <typename T>
void loss_rows(const LossChunk& c) {
  using F = Acc<T>;
  const int64_t rows = c.z.size(0), vocab = c.z.size(1);
  const bool has_t = c.t.defined(), capped = c.softcap > 0;
  const F cap = static_cast<F>(c.softcap);
  const F inv_cap = capped ? soft_cap_inverse<F>(c.softcap) : F(0);
  T* z_all = c.z.data_ptr<T>();
  T* t_all = has_t ? c.t.data_ptr<T>() : nullptr;
  T* bias_all = c.bias.defined() ? c.bias.data_ptr<T>() : nullptr;
  const int64_t* labels = c.labels.const_data_ptr<int64_t>();
  const float* weights = c.weights.const_data_ptr<float>();
  const F* term_scale = c.term_scale.const_data_ptr<F>();
  F* ce = c.ce.data_ptr<F>();
  F* l1 = has_t ? c.l1.data_ptr<F>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<F> p(vocab), q(has_t ? vocab : 0), g(c.grad ? vocab : 0);
    // With a cap: the Markov bias row, and the cap's slopes where gradients need them.
    std::vector<F> bias(bias_all != nullptr ? vocab : 0);
    std::vector<F> slope_z(capped && c.grad ? vocab : 0), slope_t(capped && c.t_grad ? vocab : 0);
    for (int64_t i = begin; i < end; ++i) {
      T* z = z_all + i * vocab;
      load_row(z, vocab, p.data());
      if (capped) {
        if (bias_all != nullptr) load_row(bias_all + i * vocab, vocab, bias.data());
        soft_cap_row(p.data(), vocab, cap, inv_cap, bias_all != nullptr ? bias.data() : nullptr,
                     c.grad ? slope_z.data() : nullptr);
      }
      const int64_t y = labels[i];
      // Labels are range-checked on CPU; an unchecked one never becomes an index.
      const F z_y = y >= 0 && y < vocab ? p[y] : std::numeric_limits<F>::quiet_NaN();
      ce[i] = softmax_row(p.data(), vocab) - z_y;
      L1SumsOf<F> sums{0, 0, 0};
      if (has_t) {
        load_row(t_all + i * vocab, vocab, q.data());
        if (capped) {
          soft_cap_row(q.data(), vocab, cap, inv_cap, static_cast<const F*>(nullptr),
                       c.t_grad ? slope_t.data() : nullptr);
        }
        softmax_row(q.data(), vocab);
        sums = l1_sums(p.data(), q.data(), vocab);
        l1[i] = sums.l1;
      }
      if (!c.grad) continue;
      const F a = F(weights[i]) * term_scale[0];
      const F b = has_t ? F(weights[i]) * term_scale[1] : F(0);
      for (int64_t v = 0; v < vocab; ++v) {
        const F s = has_t ? l1_sign(p[v], q[v]) : F(0);
        g[v] = draft_logit_grad(p[v], s, v == y, a, b, sums.sp);
      }
      if (capped) {
        // The bias gets d loss / d z itself, the product W h it times the cap's slope.
        if (bias_all != nullptr) store_row(g.data(), vocab, bias_all + i * vocab);
        for (int64_t v = 0; v < vocab; ++v) g[v] *= slope_z[v];
      }
      store_row(g.data(), vocab, z);
      if (c.t_grad) {
        for (int64_t v = 0; v < vocab; ++v) {
          g[v] = target_logit_grad(q[v], l1_sign(p[v], q[v]), b, sums.sq);
        }
        if (capped) {
          for (int64_t v = 0; v < vocab; ++v) g[v] *= slope_t[v];
        }
        store_row(g.data(), vocab, t_all + i * vocab);
      }
    }
  });
}

struct DsparkLossCpu : CpuBackend {
  static constexpr bool kTakesFloat64 = true;
  static constexpr int64_t kScratchBytes = kLossScratchBytesCpu;
  // The vocabulary pass of one chunk of rows.
  static void run(const LossChunk& chunk) {
    const auto dtype = chunk.z.scalar_type();
    if (dtype == at::kDouble) {
      loss_rows<double>(chunk);
    } else {
      dispatch_logit_type(dtype, [&](auto tag) { loss_rows<decltype(tag)>(chunk); });
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("dspark_loss", &ops::dspark_loss<DsparkLossCpu>);
}

}  // namespace dspark_ops
