// CPU kernels of the drafting family (docs/semantics.md §3.2, §3.3): markov_draft, rnn_draft,
// draft_confidence.
//
// A block is walked slot by slot; each slot is one pass over the vocabulary, split into chunks
// that at::parallel_for spreads over the threads. A chunk converts four W2 rows at a time to
// float64 and takes their dot products with every request's bias input (W1[x_j] or tanh(o_j),
// float64), so W2 is read once per slot for the whole batch; z = float32(dot + base) is stored as
// draft_logits, then the chunk's Gumbel-max keys z / T - log(-log1p(-u)) are computed with the
// vectorised float32 functions the reference's torch ops use, and each request keeps its chunk's
// best key. Chunks merge in vocabulary order (ties to the lower id), so the result does not depend
// on the thread count. The head's float64 arithmetic makes z exact whenever the dot product is
// (always for 16-bit weights), so tokens and draft_logits match dspark_ops/reference.py bit for bit.
// A request with sampling filters (kernels/filter_math.h) is sampled after the whole slot's z is
// known: its row is filtered in place (dropped tokens -inf, the stored draft_logits) and its keys
// taken over the filtered row.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../args/draft_args.h"
#include "../common/dispatch.h"
#include "../kernels/draft_math.h"
#include "../kernels/filter_math.h"
#include "../kernels/verify_math.h"
#include "../ops.h"

namespace dspark_ops {
namespace {

using VecF = at::vec::Vectorized<float>;
using VecD = at::vec::Vectorized<double>;
// Vocabulary rows per parallel task: whole Philox blocks, whole float vectors.
constexpr int64_t kChunk = 2048;
constexpr int kRowsPerGroup = 8;  // W2 rows converted and dotted together

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
double load_double(const T* p, int64_t i) {
  return static_cast<double>(static_cast<float>(p[i]));
}

// out[i] = sum_k a[k] * rows[i][k] for kRows zero-padded float64 rows of `padded` elements: one
// accumulator chain per row, so the fused multiply-adds overlap instead of waiting on each other.
// Every row's sum is taken in the same order (lane-wise, then across lanes).
template <int kRows>
void dot_rows(const double* a, const double* rows, int64_t padded, double* out) {
  VecD acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = VecD(0.0);
  for (int64_t k = 0; k < padded; k += VecD::size()) {
    const VecD x = VecD::loadu(a + k);
    for (int i = 0; i < kRows; ++i) acc[i] = at::vec::fmadd(x, VecD::loadu(rows + i * padded + k), acc[i]);
  }
  for (int i = 0; i < kRows; ++i) {
    double lanes[VecD::size()];
    acc[i].store(lanes);
    double s = 0.0;
    for (int l = 0; l < VecD::size(); ++l) s += lanes[l];
    out[i] = s;
  }
}

// sum_k a[k] * b[k] for one long pair of rows (the RNN joint layer, the confidence head): four
// accumulator chains over interleaved vectors, then added in a fixed order.
double dot(const double* a, const double* b, int64_t padded) {
  constexpr int64_t kChains = 4;
  VecD acc[kChains] = {VecD(0.0), VecD(0.0), VecD(0.0), VecD(0.0)};
  int64_t k = 0;
  for (; k + kChains * VecD::size() <= padded; k += kChains * VecD::size()) {
    for (int64_t c = 0; c < kChains; ++c) {
      const int64_t at = k + c * VecD::size();
      acc[c] = at::vec::fmadd(VecD::loadu(a + at), VecD::loadu(b + at), acc[c]);
    }
  }
  for (; k < padded; k += VecD::size()) {
    acc[0] = at::vec::fmadd(VecD::loadu(a + k), VecD::loadu(b + k), acc[0]);
  }
  double lanes[VecD::size()];
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
  double s = 0.0;
  for (int i = 0; i < VecD::size(); ++i) s += lanes[i];
  return s;
}

// Per-request sampling constants of one slot.
struct SlotSampling {
  std::vector<float> inv_temperature;  // 1/T, or 1 for greedy requests
  std::vector<char> greedy;
  std::vector<int64_t> seed, position;  // position of this slot's draw: p0 + 1 + j
  std::vector<FilterSpec> filter;
};

// Request b's best Gumbel-max candidate over z[x0, x1) (x0 a multiple of 32), 32 keys at a time
// (whole Philox blocks; the tail past x1 is masked).
RaceCandidate best_key(const float* z, int64_t x0, int64_t x1, const SlotSampling& s, int64_t b) {
  RaceCandidate best = empty_candidate();
  alignas(64) float u[32], key[32], zs[32];
  for (int64_t x = x0; x < x1; x += 32) {
    const int64_t n = std::min<int64_t>(32, x1 - x);
    for (int64_t i = 0; i < 32; ++i) zs[i] = i < n ? z[x + i] : -INFINITY;
    if (s.greedy[b]) {
      for (int64_t i = 0; i < 32; ++i) key[i] = zs[i];
    } else {
      for (int g = 0; g < 8; ++g) {
        const auto block = philox_block(s.seed[b], s.position[b], kPurposeDraft,
                                        static_cast<uint32_t>((x >> 2) + g));
        for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
      }
      const VecF inv_t(s.inv_temperature[b]);
      for (int64_t i = 0; i < 32; i += VecF::size()) {
        const VecF log_e = (-(-VecF::loadu(u + i)).log1p()).log();
        (VecF::loadu(zs + i) * inv_t - log_e).store(key + i);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      // Non-finite z, and keys that are -inf (z / T overflowing) or NaN, never win.
      if (std::isfinite(zs[i]) && key[i] > -INFINITY) {
        best = better_candidate(best, RaceCandidate{key[i], static_cast<int32_t>(x + i)});
      }
    }
  }
  return best;
}

// Filters request b's row z[0, vocab) in place (non-finite and dropped tokens -inf, as the filtered
// draft_logits are stored) and returns its token.
int64_t filtered_token(float* z, int64_t vocab, const SlotSampling& s, int64_t b) {
  float row_max = -INFINITY;
  for (int64_t x = 0; x < vocab; ++x) {
    if (!std::isfinite(z[x])) z[x] = -INFINITY;
    row_max = std::max(row_max, z[x]);
  }
  if (row_max == -INFINITY) return 0;
  std::vector<float> weights(vocab);
  std::vector<uint32_t> keys(vocab);
  filter_row(z, vocab, row_max, s.inv_temperature[b], s.filter[b], keys.data(), weights.data());
  const RaceCandidate best = best_key(z, 0, vocab, s, b);
  return best.index < 0 ? 0 : best.index;
}

// One slot over the whole vocabulary: z = float32(W2 . input[b] + base[b]) into `z_out` (row b at
// z_out + b * z_stride), and the sampled token of each request into `token`.
template <typename W, typename BaseT>
void draft_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank,
                const std::vector<double>& input, int64_t batch, const BaseT* base,
                int64_t base_stride, float* z_out, int64_t z_stride, const SlotSampling& s,
                int64_t* token, int64_t token_stride) {
  const int64_t padded_rank = round_up(rank, VecD::size());
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<RaceCandidate> best(chunks * batch, empty_candidate());
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> rows(kRowsPerGroup * padded_rank, 0.0);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t x0 = c * kChunk, x1 = std::min(x0 + kChunk, vocab);
      for (int64_t v = x0; v < x1; v += kRowsPerGroup) {
        const int64_t n = std::min<int64_t>(kRowsPerGroup, x1 - v);
        for (int64_t i = 0; i < n; ++i) {
          const W* src = w2 + (v + i) * w2_stride;
          for (int64_t k = 0; k < rank; ++k) rows[i * padded_rank + k] = load_double(src, k);
        }
        for (int64_t b = 0; b < batch; ++b) {
          double bias[kRowsPerGroup];
          dot_rows<kRowsPerGroup>(input.data() + b * padded_rank, rows.data(), padded_rank, bias);
          const BaseT* base_row = base + b * base_stride;
          for (int64_t i = 0; i < n; ++i) {
            z_out[b * z_stride + v + i] = static_cast<float>(bias[i] + load_double(base_row, v + i));
          }
        }
      }
      // Keys over the chunk; filtered requests wait for their whole row.
      for (int64_t b = 0; b < batch; ++b) {
        if (!s.filter[b].active()) best[c * batch + b] = best_key(z_out + b * z_stride, x0, x1, s, b);
      }
    }
  });
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (s.filter[b].active()) {
        token[b * token_stride] = filtered_token(z_out + b * z_stride, vocab, s, b);
        continue;
      }
      RaceCandidate m = empty_candidate();
      for (int64_t c = 0; c < chunks; ++c) m = better_candidate(m, best[c * batch + b]);
      token[b * token_stride] = m.index < 0 ? 0 : m.index;
    }
  });
}

SlotSampling slot_sampling(const DraftArgs& a, int64_t j) {
  SlotSampling s;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float t = a.temperature.const_data_ptr<float>()[b];
    s.greedy.push_back(is_greedy(t));
    s.inv_temperature.push_back(is_greedy(t) ? 1.f : 1.f / t);
    s.seed.push_back(a.seed.const_data_ptr<int64_t>()[b]);
    s.position.push_back(a.position.const_data_ptr<int64_t>()[b] + 1 + j);
    const auto& f = a.filters;
    s.filter.push_back(
        make_filter_spec(f.top_k_data(), f.top_p_data(), f.min_p_data(), b, a.vocab));
  }
  return s;
}

int64_t read_id(const at::Tensor& ids, int64_t offset) {
  return ids.scalar_type() == at::kInt ? ids.const_data_ptr<int32_t>()[offset]
                                       : ids.const_data_ptr<int64_t>()[offset];
}

// W1[id] as float64 into dst[0, rank); a zero row for ids outside [0, V).
template <typename W>
void embed(const at::Tensor& w1, int64_t id, double* dst) {
  const int64_t rank = w1.size(1);
  if (id < 0 || id >= w1.size(0)) {
    std::fill(dst, dst + rank, 0.0);
    return;
  }
  const W* row = w1.const_data_ptr<W>() + id * w1.stride(0);
  for (int64_t k = 0; k < rank; ++k) dst[k] = load_double(row, k);
}

// The sequential walk of both heads. `next_input(j, prev, input)` fills the [B, padded r] float64
// bias inputs of slot j from the previous tokens.
template <typename W, typename BaseT, typename NextInput>
void draft_block(const DraftArgs& a, at::Tensor& tokens, at::Tensor& draft_logits,
                 NextInput&& next_input) {
  const int64_t padded_rank = round_up(a.rank, VecD::size());
  std::vector<double> input(a.batch * padded_rank, 0.0);
  std::vector<int64_t> prev(a.batch);
  for (int64_t b = 0; b < a.batch; ++b) prev[b] = read_id(a.anchor, b);
  auto* out_tokens = tokens.data_ptr<int64_t>();
  auto* z = draft_logits.data_ptr<float>();
  const auto* base = a.base.const_data_ptr<BaseT>();
  for (int64_t j = 0; j < a.block; ++j) {
    next_input(j, prev, input, padded_rank);
    draft_slot<W, BaseT>(a.w2.const_data_ptr<W>(), a.w2.stride(0), a.vocab, a.rank, input,
                         a.batch, base + j * a.base.stride(1), a.base.stride(0),
                         z + j * a.vocab, a.block * a.vocab, slot_sampling(a, j),
                         out_tokens + j, a.block);
    for (int64_t b = 0; b < a.batch; ++b) prev[b] = out_tokens[b * a.block + j];
  }
}

template <typename F>
void dispatch_draft_types(const DraftArgs& a, F&& f) {
  dispatch_logit_type(a.w1.scalar_type(), [&](auto w_tag) {
    dispatch_logit_type(a.base.scalar_type(), [&](auto base_tag) {
      f(decltype(w_tag){}, decltype(base_tag){});
    });
  });
}

}  // namespace

DraftResult markov_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                             const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& temperature, const at::Tensor& seed,
                             const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p,
                             const std::optional<at::Tensor>& min_p) {
  const auto a = check_markov_draft_args(base_logits, anchor, w1, w2, temperature, seed, position,
                                         top_k, top_p, min_p);
  auto [tokens, draft_logits] = allocate_draft_outputs(a);
  dispatch_draft_types(a, [&](auto w_tag, auto base_tag) {
    using W = decltype(w_tag);
    draft_block<W, decltype(base_tag)>(
        a, tokens, draft_logits,
        [&](int64_t, const std::vector<int64_t>& prev, std::vector<double>& input, int64_t padded) {
          for (int64_t b = 0; b < a.batch; ++b) embed<W>(a.w1, prev[b], input.data() + b * padded);
        });
  });
  return {tokens, draft_logits};
}

DraftResult rnn_draft_cpu(const at::Tensor& base_logits, const at::Tensor& anchor,
                          const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& joint_weight, const at::Tensor& joint_bias,
                          const at::Tensor& temperature, const at::Tensor& seed,
                          const at::Tensor& position, const std::optional<at::Tensor>& top_k,
                          const std::optional<at::Tensor>& top_p,
                          const std::optional<at::Tensor>& min_p) {
  const auto a = check_rnn_draft_args(base_logits, anchor, hidden, w1, w2, joint_weight,
                                      joint_bias, temperature, seed, position, top_k, top_p, min_p);
  auto [tokens, draft_logits] = allocate_draft_outputs(a);
  const int64_t rank = a.rank, width = 2 * a.rank + a.hidden_size;
  const int64_t padded_width = round_up(width, VecD::size());
  dispatch_draft_types(a, [&](auto w_tag, auto base_tag) {
    using W = decltype(w_tag);
    std::vector<double> state(a.batch * rank, 0.0);
    std::vector<double> u(a.batch * padded_width, 0.0), pre(a.batch * 3 * rank);
    draft_block<W, decltype(base_tag)>(
        a, tokens, draft_logits,
        [&](int64_t j, const std::vector<int64_t>& prev, std::vector<double>& input, int64_t padded) {
          // u = [s_j; W1[x_j]; h_j] per request.
          dispatch_logit_type(a.hidden.scalar_type(), [&](auto h_tag) {
            using H = decltype(h_tag);
            for (int64_t b = 0; b < a.batch; ++b) {
              double* ub = u.data() + b * padded_width;
              std::copy(state.begin() + b * rank, state.begin() + (b + 1) * rank, ub);
              embed<W>(a.w1, prev[b], ub + rank);
              const H* h = a.hidden.const_data_ptr<H>() + b * a.hidden.stride(0) + j * a.hidden.stride(1);
              for (int64_t k = 0; k < a.hidden_size; ++k) ub[2 * rank + k] = load_double(h, k);
            }
          });
          // [g; c; o] = J u + bias: each row of J converted once, dotted with every request.
          at::parallel_for(0, 3 * rank, 16, [&](int64_t begin, int64_t end) {
            std::vector<double> row(padded_width, 0.0);
            for (int64_t i = begin; i < end; ++i) {
              const W* src = a.joint_weight.const_data_ptr<W>() + i * a.joint_weight.stride(0);
              for (int64_t k = 0; k < width; ++k) row[k] = load_double(src, k);
              const double bias = load_double(a.joint_bias.const_data_ptr<W>(), i);
              for (int64_t b = 0; b < a.batch; ++b) {
                pre[b * 3 * rank + i] = dot(u.data() + b * padded_width, row.data(), padded_width) + bias;
              }
            }
          });
          for (int64_t b = 0; b < a.batch; ++b) {
            const double* p = pre.data() + b * 3 * rank;
            for (int64_t k = 0; k < rank; ++k) {
              input[b * padded + k] = std::tanh(p[2 * rank + k]);
              const double gate = rnn_sigmoid(p[k]);
              double& s = state[b * rank + k];
              s = gate * s + (1.0 - gate) * std::tanh(p[rank + k]);
            }
          }
        });
  });
  return {tokens, draft_logits};
}

at::Tensor draft_confidence_cpu(const at::Tensor& hidden, const at::Tensor& prev_tokens,
                                const at::Tensor& w1, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& calib_temperature) {
  const auto a = check_confidence_args(hidden, prev_tokens, w1, weight, bias, calib_temperature);
  auto out = at::empty({a.batch, a.block}, a.hidden.options().dtype(at::kFloat));
  const int64_t width = a.hidden_size + a.rank, padded = round_up(width, VecD::size());
  float* confidence = out.data_ptr<float>();
  dispatch_logit_type(a.w1.scalar_type(), [&](auto w_tag) {
    dispatch_logit_type(a.hidden.scalar_type(), [&](auto h_tag) {
      dispatch_logit_type(a.weight.scalar_type(), [&](auto p_tag) {
        using W = decltype(w_tag);
        using H = decltype(h_tag);
        using P = decltype(p_tag);
        std::vector<double> w(padded, 0.0);
        for (int64_t k = 0; k < width; ++k) w[k] = load_double(a.weight.const_data_ptr<P>(), k);
        double b0 = 0.0;
        if (a.bias.defined()) {
          dispatch_logit_type(a.bias.scalar_type(), [&](auto b_tag) {
            b0 = load_double(a.bias.const_data_ptr<decltype(b_tag)>(), 0);
          });
        }
        const auto& ids = a.prev_tokens;
        at::parallel_for(0, a.batch * a.block, 16, [&](int64_t begin, int64_t end) {
          std::vector<double> feature(padded, 0.0);
          for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / a.block, j = i % a.block;
            const H* h = a.hidden.const_data_ptr<H>() + b * a.hidden.stride(0) + j * a.hidden.stride(1);
            for (int64_t k = 0; k < a.hidden_size; ++k) feature[k] = load_double(h, k);
            embed<W>(a.w1, read_id(ids, b * ids.stride(0) + j * ids.stride(1)),
                     feature.data() + a.hidden_size);
            float logit = static_cast<float>(dot(feature.data(), w.data(), padded) + b0);
            if (a.calib_temperature.defined()) {
              logit = logit / a.calib_temperature.const_data_ptr<float>()[j];
            }
            confidence[i] = confidence_sigmoid(logit);
          }
        });
      });
    });
  });
  return out;
}

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("markov_draft", &markov_draft_cpu);
  m.impl("rnn_draft", &rnn_draft_cpu);
  m.impl("draft_confidence", &draft_confidence_cpu);
}

}  // namespace dspark_ops
