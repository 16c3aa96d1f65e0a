// CPU kernels of markov_draft and rnn_draft (docs/semantics.md §3.2), and the drafting family's
// CPU registrations (draft_confidence's kernel is cpu/draft_confidence_cpu.cpp).
//
// A block is walked slot by slot; each slot is one pass over the vocabulary, split into chunks
// that at::parallel_for spreads over the threads (one level of parallelism: the micro-kernels
// inside a task are single-threaded). Each slot first runs a fast float32 head: a chunk converts
// eight W2 rows at a time to float32 and takes their dot products with every request's bias
// input, so W2 is read once per slot for the whole batch; z = float32(dot + base) is stored as
// draft_logits and each request keeps its chunk's two best Gumbel-max keys
// z / T - log(-log1p(-u)) (vectorised float32 functions, as the reference's torch ops). Chunks
// merge in vocabulary order (ties to the lower id), so nothing depends on the thread count.
//
// Tokens must be those of the float64 head of dspark_ops/reference.py. The float32 head is off by
// at most a proven bound (draft_certificate.h); where the winner's key is not ahead of the runner-up
// by more than twice that bound, or a filter decision (top-k, top-p, min-p) lies within it, the
// request's whole row is redone in float64 exactly as the reference (the exact head), which then
// also stores that row's draft_logits bit for bit. Elsewhere draft_logits are the float32 head's,
// within that bound of the reference, and the token is still the Gumbel-max of the stored row.
// With bfloat16 draft_logits both heads sample z rounded to bfloat16; the few elements whose float32
// z lies within the bound of a rounding midpoint are recomputed in float64 (fix_rounding), so the
// stored rows are the exact head's on every row and the tokens need no margin.
//
// This file walks the slots and runs both heads; their parts live beside it: draft_fast_dots.h
// (the float32 head's micro-kernels, AVX2), draft_dots.h (float64 dot products), draft_keys.h
// (Gumbel-max keys over a row, filtered draws), draft_certificate.h (the float32 head's bound),
// draft_bf16_rounding.h (bfloat16 draft_logits).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "draft_bf16_rounding.h"
#include "draft_certificate.h"
#include "draft_dots.h"
#include "draft_fast_dots.h"
#include "draft_keys.h"
#include "../args/draft_args.h"
#include "../common/dispatch.h"
#include "../kernels/draft_math.h"

namespace dspark_ops {
namespace draft_cpu {
namespace {

// Vocabulary rows per parallel task: whole Philox blocks, whole float vectors.
constexpr int64_t kChunk = 2048;

// The fast float32 head of one slot: z_f rows into z_out, each unfiltered request's chunk keys
// into stats[c * batch + b] and, when `measure`, each chunk's largest W2 row norm into w_max[c].
template <typename W, typename BaseT>
void fast_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank, const float* input,
               int64_t padded, int64_t batch, const BaseT* base, int64_t base_stride,
               float* z_out, int64_t z_stride, const SlotSampling& s,
               std::vector<ChunkStats>& stats, bool measure, std::vector<float>& w_max) {
  constexpr int kRows = 8;
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kRows * padded, 0.f);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t x0 = c * kChunk, x1 = std::min(x0 + kChunk, vocab);
      float norm2 = 0.f;
      for (int64_t v = x0; v < x1; v += kRows) {
        const int64_t n = std::min<int64_t>(kRows, x1 - v);
        for (int64_t i = 0; i < kRows; ++i) {
          float* dst = rows.data() + i * padded;
          if (i >= n) {
            std::fill(dst, dst + rank, 0.f);
            continue;
          }
          to_float(w2 + (v + i) * w2_stride, rank, dst);
          if (v + kRows + i < x1) {
            // The next group's row i: past this 4 KB page, where the hardware prefetchers stop.
            const char* next = reinterpret_cast<const char*>(w2 + (v + kRows + i) * w2_stride);
            for (int64_t byte = 0; byte < rank * int64_t{sizeof(W)}; byte += 64) {
              __builtin_prefetch(next + byte);
            }
          }
          if (measure) {
            const float sq = squared_norm(dst, padded);
            if (!(sq <= norm2)) norm2 = std::isnan(sq) ? INFINITY : sq;
          }
        }
        int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
        if constexpr (kRows == 8 && VecF::size() == 8) {
          for (; b + 2 <= batch; b += 2) {
            float dots[2][kRows];
            fast_dot_pair(input + b * padded, input + (b + 1) * padded, rows.data(), padded,
                          dots[0], dots[1]);
            for (int64_t j = 0; j < 2; ++j) {
              store_logits(dots[j], base + (b + j) * base_stride + v, n,
                           z_out + (b + j) * z_stride + v, stats[c * batch + b + j]);
            }
          }
        }
#endif
        for (; b < batch; ++b) {
          float dots[kRows];
          fast_dot<kRows>(input + b * padded, rows.data(), padded, dots);
          store_logits(dots, base + b * base_stride + v, n, z_out + b * z_stride + v,
                       stats[c * batch + b]);
        }
      }
      if (measure) w_max[c] = std::sqrt(norm2);
      for (int64_t b = 0; b < batch; ++b) {
        if (!s.filter[b].active()) stats[c * batch + b].top = best_key(z_out + b * z_stride, x0, x1, s, b);
      }
    }
  });
}

// The exact float64 head for the requests in `redo`: z = float32(W2 . input[b] + base[b]) into
// their rows of z_out (the reference's arithmetic, bit for bit) and their tokens.
template <typename W, typename BaseT>
void exact_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank,
                const std::vector<double>& input, const std::vector<int64_t>& redo,
                const BaseT* base, int64_t base_stride, float* z_out, int64_t z_stride,
                const SlotSampling& s, int64_t* token, int64_t token_stride) {
  const int64_t padded_rank = round_up(rank, VecD::size());
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
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
        for (const int64_t b : redo) {
          double bias[kRowsPerGroup];
          dot_rows<kRowsPerGroup>(input.data() + b * padded_rank, rows.data(), padded_rank, bias);
          const BaseT* base_row = base + b * base_stride;
          for (int64_t i = 0; i < n; ++i) {
            z_out[b * z_stride + v + i] = static_cast<float>(bias[i] + load_double(base_row, v + i));
          }
        }
      }
    }
  });
  at::parallel_for(0, static_cast<int64_t>(redo.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = redo[i];
      float* zb = z_out + b * z_stride;
      if (s.filter[b].active()) {
        if (s.round_bf16) {
          for (int64_t x = 0; x < vocab; ++x) zb[x] = round_bf16(zb[x]);
        }
        token[b * token_stride] = filtered_token(zb, vocab, s, b);
      } else {
        const RaceCandidate m = best_key(zb, 0, vocab, s, b).best;
        token[b * token_stride] = m.index < 0 ? 0 : m.index;
      }
    }
  });
}

// One slot over the whole vocabulary: the fast head for every request, the exact head for the
// requests it cannot certify. z rows at z_out + b * z_stride, tokens at token[b * token_stride].
template <typename W, typename BaseT>
void draft_slot(const W* w2, int64_t w2_stride, int64_t vocab, int64_t rank,
                const std::vector<double>& input, int64_t batch, const BaseT* base,
                int64_t base_stride, float* z_out, int64_t z_stride, const SlotSampling& s,
                int64_t* token, int64_t token_stride, double& w_max) {
  const int64_t padded_rank = round_up(rank, VecD::size());
  const int64_t padded = round_up(rank, VecF::size());
  std::vector<float> input_f(batch * padded, 0.f);
  std::vector<double> x_norm(batch);
  for (int64_t b = 0; b < batch; ++b) {
    double sq = 0.0;
    for (int64_t k = 0; k < rank; ++k) {
      const double x = input[b * padded_rank + k];
      input_f[b * padded + k] = static_cast<float>(x);
      sq += x * x;
    }
    x_norm[b] = std::sqrt(sq) * (1.0 + 0x1p-40);
  }
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<ChunkStats> stats(chunks * batch);
  const bool measure = w_max < 0;  // W2's row norms are measured once per call, in slot 0
  std::vector<float> w_chunk(chunks, 0.f);
  fast_slot<W, BaseT>(w2, w2_stride, vocab, rank, input_f.data(), padded, batch, base, base_stride,
                      z_out, z_stride, s, stats, measure, w_chunk);
  if (measure) {
    w_max = 0.0;
    for (const float w : w_chunk) w_max = std::max(w_max, static_cast<double>(w));
  }
  const double scale = bound_scale();
  std::vector<ChunkStats> row(batch);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t c = 0; c < chunks; ++c) {
      const ChunkStats& st = stats[c * batch + b];
      row[b].top = merge(row[b].top, st.top);
      row[b].z_max = std::max(row[b].z_max, st.z_max);
      row[b].dot_max = std::max(row[b].dot_max, st.dot_max);
    }
  }
  std::vector<char> redo_flag(batch, 0);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> fix_rows(s.round_bf16 ? kRowsPerGroup * padded_rank : 0, 0.0);
    std::vector<float> fix_staged(s.round_bf16 ? rank : 0);
    for (int64_t b = begin; b < end; ++b) {
      const double dot_err = dot_bound(rank, x_norm[b], w_max);
      const double inv_t = s.inv_temperature[b];
      float* zb = z_out + b * z_stride;
      if (s.round_bf16) {
        const double dz = logit_bound(dot_err, row[b].z_max, row[b].dot_max, inv_t);
        if (dz < 0) {
          redo_flag[b] = 1;
          continue;
        }
        const std::vector<int64_t> changed =
            fix_rounding<W, BaseT>(zb, vocab, dz * scale, w2, w2_stride, rank, padded_rank,
                                   input.data() + b * padded_rank, base + b * base_stride,
                                   fix_rows, fix_staged);
        if (s.filter[b].active()) {
          for (int64_t x = 0; x < vocab; ++x) zb[x] = round_bf16(zb[x]);
          token[b * token_stride] = filtered_token(zb, vocab, s, b);
        } else {
          token[b * token_stride] = rounded_token(zb, vocab, s, b, row[b].top.best, changed);
        }
        continue;
      }
      if (s.filter[b].active()) {
        const int64_t t = certified_filtered_token(zb, vocab, s, b, dot_err, row[b].dot_max,
                                                   scale);
        if (t < 0) redo_flag[b] = 1;
        else token[b * token_stride] = t;
        continue;
      }
      const double dz = logit_bound(dot_err, row[b].z_max, row[b].dot_max, inv_t);
      if (!certify_gap(row[b].top, dz, row[b].z_max, s.greedy[b], inv_t, scale)) {
        redo_flag[b] = 1;
        continue;
      }
      token[b * token_stride] = row[b].top.best.index < 0 ? 0 : row[b].top.best.index;
    }
  });
  std::vector<int64_t> redo;
  for (int64_t b = 0; b < batch; ++b) {
    if (redo_flag[b]) redo.push_back(b);
  }
  if (!redo.empty()) {
    exact_slot<W, BaseT>(w2, w2_stride, vocab, rank, input, redo, base, base_stride, z_out,
                         z_stride, s, token, token_stride);
  }
}

SlotSampling slot_sampling(const DraftArgs& a, int64_t j) {
  SlotSampling s;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float t = a.temperature.const_data_ptr<float>()[b];
    s.greedy.push_back(is_greedy(t));
    s.inv_temperature.push_back(is_greedy(t) ? 1.f : 1.f / t);
    s.seed.push_back(a.seed.const_data_ptr<int64_t>()[b]);
    s.position.push_back(offset_position(a.position.const_data_ptr<int64_t>()[b], 1 + j));
    const auto& f = a.filters;
    s.filter.push_back(
        make_filter_spec(f.top_k_data(), f.top_p_data(), f.min_p_data(), b, a.vocab));
  }
  s.round_bf16 = a.logits_bf16;
  return s;
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
  // bfloat16 logits: each slot's float32 rows (z_f, or z_e where recomputed, rounded in place
  // where filtered) are staged, then rounded into draft_logits.
  std::vector<float> staged(a.logits_bf16 ? a.batch * a.vocab : 0);
  const auto* base = a.base.const_data_ptr<BaseT>();
  double w_max = -1.0;  // the largest W2 row norm, once measured
  for (int64_t j = 0; j < a.block; ++j) {
    next_input(j, prev, input, padded_rank);
    float* z = a.logits_bf16 ? staged.data() : draft_logits.data_ptr<float>() + j * a.vocab;
    const int64_t z_stride = a.logits_bf16 ? a.vocab : a.block * a.vocab;
    draft_slot<W, BaseT>(a.w2.const_data_ptr<W>(), a.w2.stride(0), a.vocab, a.rank, input,
                         a.batch, base + j * a.base.stride(1), a.base.stride(0), z, z_stride,
                         slot_sampling(a, j), out_tokens + j, a.block, w_max);
    if (a.logits_bf16) {
      auto* out = draft_logits.data_ptr<at::BFloat16>() + j * a.vocab;
      at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const float* src = z + b * a.vocab;
          at::BFloat16* dst = out + b * a.block * a.vocab;
          for (int64_t x = 0; x < a.vocab; ++x) dst[x] = c10::BFloat16(src[x]);
        }
      });
    }
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
}  // namespace draft_cpu

using draft_cpu::draft_block;
using draft_cpu::dispatch_draft_types;
using draft_cpu::dot;
using draft_cpu::embed;
using draft_cpu::round_up;
using draft_cpu::VecD;

void draft_confidence_cpu(const ConfidenceArgs& a, at::Tensor& out);  // draft_confidence_cpu.cpp

namespace {

struct MarkovDraftCpu : CpuBackend {
  static void run(const DraftArgs& a, DraftResult& outputs);
};

struct RnnDraftCpu : CpuBackend {
  static void run(const DraftArgs& a, DraftResult& outputs);
};

struct DraftConfidenceCpu : CpuBackend {
  static void run(const ConfidenceArgs& a, at::Tensor& out) { draft_confidence_cpu(a, out); }
};

void MarkovDraftCpu::run(const DraftArgs& a, DraftResult& outputs) {
  auto& [tokens, draft_logits] = outputs;
  dispatch_draft_types(a, [&](auto w_tag, auto base_tag) {
    using W = decltype(w_tag);
    draft_block<W, decltype(base_tag)>(
        a, tokens, draft_logits,
        [&](int64_t, const std::vector<int64_t>& prev, std::vector<double>& input, int64_t padded) {
          for (int64_t b = 0; b < a.batch; ++b) embed<W>(a.w1, prev[b], input.data() + b * padded);
        });
  });
}

void RnnDraftCpu::run(const DraftArgs& a, DraftResult& outputs) {
  auto& [tokens, draft_logits] = outputs;
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
            std::vector<float> staged(width);
            for (int64_t i = begin; i < end; ++i) {
              const W* src = a.joint_weight.const_data_ptr<W>() + i * a.joint_weight.stride(0);
              to_float(src, width, staged.data());  // exact, with vector loads
              for (int64_t k = 0; k < width; ++k) row[k] = staged[k];
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
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("markov_draft", &ops::markov_draft<MarkovDraftCpu>);
  m.impl("rnn_draft", &ops::rnn_draft<RnnDraftCpu>);
  m.impl("draft_confidence", &ops::draft_confidence<DraftConfidenceCpu>);
}

}  // namespace dspark_ops
