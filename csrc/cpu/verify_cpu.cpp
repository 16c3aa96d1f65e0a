// CPU kernel of verify (docs/semantics.md §3.1).
//
// A request walks its rows in order and stops at the first rejection, so rows after it are never
// read. Each row is first copied into a float32 scratch row (non-finite logits become -inf, the
// tail is padded with -inf to a whole number of lane groups) so every later pass is a branch-free
// vectorised loop over cached data: max and first argmax while copying, the sum of weights for the
// acceptance test, then, for the one row that emits a token, the exponential race over
// r = max(p - q, 0) with Philox noise. The scalar math is the shared kernels/sampling_math.h, so CPU
// and CUDA apply the same rule with the same random numbers.
//
// Every pass works block by block (kBlock elements) and keeps each block's partial result (max,
// float32 sum, race winner), merged in block order, so nothing depends on how the blocks are
// spread over threads. A batch that keeps every thread busy runs one request per task; a smaller
// one walks its requests in turn and spreads each pass's blocks over the threads instead (one
// level of parallelism either way: at::parallel_for inside a task runs inline).
//
// Sampling filters (kernels/filter_math.h): a disallowed token is dropped as the row is copied; a
// row whose request has top-k / top-p / min-p gets its thresholds from the serial radix descent
// and the dropped tokens set to -inf in the scratch row, with the kept weight as the new sum, so
// the acceptance test, the race and the logprobs run unchanged on the processed distribution.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <vector>

#include "../args/verify_args.h"
#include "../common/dispatch.h"
#include "../kernels/filter_math.h"
#include "../kernels/sampling_math.h"
#include "convert.h"
#include "philox_lanes.h"

namespace dspark_ops {
namespace {

using Vec = at::vec::Vectorized<float>;
// Rows are padded to whole lane groups: whole Philox blocks (4 words) and two whole vectors.
constexpr int64_t kLanes = 32;
static_assert(kLanes % (2 * Vec::size()) == 0, "lane group too small");

// Elements per block: the unit of work of a pass and of a float32 partial sum.
constexpr int64_t kBlock = 1024;
static_assert(kBlock % kLanes == 0, "blocks must hold whole lane groups");

int64_t padded_length(int64_t vocab) { return (vocab + kLanes - 1) / kLanes * kLanes; }
int64_t block_count(int64_t vocab) { return (padded_length(vocab) + kBlock - 1) / kBlock; }

// A batch smaller than this many requests per thread spreads each row's blocks over the threads,
// if rows are long enough for a pass to outlast a fork/join many times over.
constexpr int64_t kRequestsPerThread = 4;
constexpr int64_t kMinSplitVocab = 32768;

float horizontal_max(Vec v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int i = 1; i < Vec::size(); ++i) m = std::max(m, lanes[i]);
  return m;
}

float horizontal_sum(Vec v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += lanes[i];
  return s;
}

// What the emitted token is drawn against: r = max(p - q, 0) with q one of these.
struct Proposal {
  enum Kind { kNone, kOneHot, kDistribution } kind = kNone;
  int64_t token = -1;                 // kOneHot
  const float* row = nullptr;         // kDistribution: padded float32 draft row
  SoftmaxStats stats{};               // kDistribution
  float inv_temperature = 1.f;        // kDistribution
};

// One request's passes over a row, block by block, over the threads when `split`.
class RowPasses {
 public:
  RowPasses(int64_t vocab, bool split)
      : vocab_(vocab), blocks_(block_count(vocab)), split_(split), block_max_(blocks_),
        block_sum_(blocks_), block_mass_(blocks_), block_best_(blocks_) {}

  // Copies a logit row into `dst` as float32 (non-finite values and the padding as -inf, tokens
  // whose bit in `mask_row` is clear too) and returns its max and first argmax.
  template <typename T>
  SoftmaxStats load(const T* src, const int32_t* mask_row, float* dst) {
    for_each_block([&](int64_t k, int64_t x0, int64_t x1) {
      const int64_t end = std::min(x1, vocab_);
      for (int64_t x = x0; x < end; ++x) {
        const float v = static_cast<float>(src[x]);
        dst[x] = v - v == 0.f ? v : -INFINITY;  // false for +-inf and NaN
      }
      for (int64_t x = std::max(x0, end); x < x1; ++x) dst[x] = -INFINITY;
      if (mask_row != nullptr) {
        for (int64_t x = x0; x < end; ++x) {
          if (!((static_cast<uint32_t>(mask_row[x >> 5]) >> (x & 31)) & 1u)) dst[x] = -INFINITY;
        }
      }
      Vec m(-INFINITY);
      for (int64_t x = x0; x < x1; x += Vec::size()) m = at::vec::maximum(m, Vec::loadu(dst + x));
      block_max_[k] = horizontal_max(m);
    });
    SoftmaxStats stats{-INFINITY, 0.f, -1};
    int64_t first = 0;
    for (int64_t k = 0; k < blocks_; ++k) {
      if (block_max_[k] > stats.max) {
        stats.max = block_max_[k];
        first = k;
      }
    }
    if (stats.max == -INFINITY) return stats;
    for (int64_t x = first * kBlock;; ++x) {  // the first block attaining the max holds the argmax
      if (dst[x] == stats.max) {
        stats.argmax = static_cast<int32_t>(x);
        break;
      }
    }
    return stats;
  }

  // Sum of weights exp((z - max) / T): float32 lanes within each block, the blocks added in order
  // in float64 (a single float32 accumulation over V = 151,936 drifts by ~1e-4 relative, visible
  // in the logprobs).
  float weight_sum(const float* row, float row_max, float inv_temperature) {
    const Vec max_v(row_max), inv_t(inv_temperature);
    for_each_block([&](int64_t k, int64_t x0, int64_t x1) {
      Vec s0(0.f), s1(0.f);
      for (int64_t x = x0; x < x1; x += 2 * Vec::size()) {
        s0 += ((Vec::loadu(row + x) - max_v) * inv_t).exp();
        s1 += ((Vec::loadu(row + x + Vec::size()) - max_v) * inv_t).exp();
      }
      block_sum_[k] = horizontal_sum(s0 + s1);
    });
    double total = 0.0;
    for (int64_t k = 0; k < blocks_; ++k) total += block_sum_[k];
    return static_cast<float>(total);
  }

  // The filters' inputs (kernels/filter_math.h): order-preserving keys and weights of a row.
  void filter_inputs(const float* row, float row_max, float inv_temperature, uint32_t* keys,
                     float* weights) {
    const Vec max_v(row_max), inv_t(inv_temperature);
    const int64_t vocab = vocab_;
    for_each_block([&](int64_t, int64_t x0, int64_t x1) {
      const int64_t end = std::min(x1, vocab);
      for (int64_t x = x0; x < end; ++x) keys[x] = row[x] == -INFINITY ? kNoCandidate : logit_key(row[x]);
      int64_t x = x0;
      for (; x + Vec::size() <= end; x += Vec::size()) {
        ((Vec::loadu(row + x) - max_v) * inv_t).exp().store(weights + x);  // exp(-inf) = 0
      }
      for (; x < end; ++x) weights[x] = row[x] == -INFINITY ? 0.f : softmax_weight(row[x], row_max, inv_temperature);
    });
  }

  // Exponential race over r = max(p - q, 0): returns the winner, and the residual mass through
  // `mass`. With q = none, r = p.
  int64_t race(const float* target, const SoftmaxStats& t, float inv_t, const Proposal& q,
               int64_t seed, int64_t position, float* mass) {
    const Vec t_max(t.max), t_inv_t(inv_t), t_inv_sum(1.f / t.sum), zero(0.f);
    const Vec q_max(q.stats.max), q_inv_t(q.inv_temperature), q_inv_sum(1.f / q.stats.sum);
    for_each_block([&](int64_t k, int64_t x0, int64_t x1) {
      Vec mass_v(0.f);
      RaceCandidate best = empty_candidate();
      alignas(64) float u[kLanes], key[kLanes];
      for (int64_t g0 = x0; g0 < x1; g0 += kLanes) {
        // A group whose target logits are all -inf (dropped by a filter, or padding) has r = 0.
        Vec z[kLanes / Vec::size()];
        Vec z_max(-INFINITY);
        for (int64_t v = 0; v < kLanes / Vec::size(); ++v) {
          z[v] = Vec::loadu(target + g0 + v * Vec::size());
          z_max = at::vec::maximum(z_max, z[v]);
        }
        if ((z_max == Vec(-INFINITY)).zero_mask() == 0) continue;
        philox_uniforms32(seed, position, kPurposeResample, static_cast<uint32_t>(g0 >> 2), u);
        Vec group_max(-INFINITY);
        for (int64_t i = 0; i < kLanes; i += Vec::size()) {
          const Vec p = ((z[i / Vec::size()] - t_max) * t_inv_t).exp() * t_inv_sum;
          Vec r = p;
          if (q.kind == Proposal::kDistribution) {
            const Vec qd = ((Vec::loadu(q.row + g0 + i) - q_max) * q_inv_t).exp() * q_inv_sum;
            r = at::vec::maximum(p - qd, zero);
          } else if (q.kind == Proposal::kOneHot && q.token >= g0 + i &&
                     q.token < g0 + i + Vec::size()) {
            alignas(64) float lanes[Vec::size()];
            r.store(lanes);
            lanes[q.token - g0 - i] = 0.f;  // max(p - 1, 0), as p <= 1
            r = Vec::loadu(lanes);
          }
          mass_v += r;
          // Only r > 0 competes: the others' keys are -inf.
          const Vec k_i = Vec::blendv(Vec(-INFINITY), r / -(-Vec::loadu(u + i)).log1p(), r > zero);
          k_i.store(key + i);
          group_max = at::vec::maximum(group_max, k_i);
        }
        // Ties go to the lower index: a group only takes over with a strictly larger key, and
        // then with its first lane holding it.
        const float top = horizontal_max(group_max);
        if (top > best.key) {
          int64_t i = 0;
          while (key[i] != top) ++i;
          best = RaceCandidate{top, static_cast<int32_t>(g0 + i)};
        }
      }
      block_mass_[k] = horizontal_sum(mass_v);
      block_best_[k] = best;
    });
    RaceCandidate best = empty_candidate();
    double total = 0.0;
    for (int64_t k = 0; k < blocks_; ++k) {
      best = better_candidate(best, block_best_[k]);
      total += block_mass_[k];
    }
    *mass = static_cast<float>(total);
    return best.index;
  }

 private:
  // Runs body(block, x0, x1) on every block [x0, x1) of the padded row.
  template <typename F>
  void for_each_block(const F& body) {
    const int64_t padded = padded_length(vocab_);
    const auto run = [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        body(k, k * kBlock, std::min(padded, (k + 1) * kBlock));
      }
    };
    if (split_) {
      at::parallel_for(0, blocks_, 1, run);
    } else {
      run(0, blocks_);
    }
  }

  int64_t vocab_, blocks_;
  bool split_;
  std::vector<float> block_max_, block_sum_, block_mass_;
  std::vector<RaceCandidate> block_best_;
};

template <typename TargetT, typename DraftT>
struct RequestVerifier {
  const VerifyArgs& a;
  const TargetT* target;
  const DraftT* draft;  // null: one-hot drafts
  int64_t* tokens;
  int32_t* num_accepted;
  bool* valid;
  float* logprobs;  // null unless asked for
  RowPasses passes;
  std::vector<float> target_row, draft_row, weights;
  std::vector<uint32_t> keys;

  RequestVerifier(const VerifyArgs& args, const TargetT* target_logits, const DraftT* draft_logits,
                  at::Tensor& tokens_out, at::Tensor& num_accepted_out, at::Tensor& valid_out,
                  at::Tensor& logprobs_out, bool split)
      : a(args), target(target_logits), draft(draft_logits),
        tokens(tokens_out.data_ptr<int64_t>()), num_accepted(num_accepted_out.data_ptr<int32_t>()),
        valid(valid_out.data_ptr<bool>()),
        logprobs(args.return_logprobs ? logprobs_out.data_ptr<float>() : nullptr),
        passes(args.vocab, split), target_row(padded_length(args.vocab)),
        draft_row(draft_logits ? padded_length(args.vocab) : 0) {}

  int64_t draft_token(int64_t b, int64_t j) const {
    const auto& t = a.draft_tokens;
    return read_id(t, b * t.stride(0) + j * t.stride(1));
  }

  // Applies the request's filters to the scratch target row; t.sum becomes the kept weight.
  void filter_target_row(const FilterSpec& spec, float inv_t, SoftmaxStats& t) {
    if (keys.empty()) {
      keys.resize(a.vocab);
      weights.resize(a.vocab);
    }
    passes.filter_inputs(target_row.data(), t.max, inv_t, keys.data(), weights.data());
    t.sum = filter_prepared_row(target_row.data(), a.vocab, spec, keys.data(), weights.data()).kept_sum;
  }

  void operator()(int64_t b) {
    const int64_t n = std::min<int64_t>(std::max(a.num_draft.const_data_ptr<int32_t>()[b], 0), a.block);
    const float temperature = a.temperature.const_data_ptr<float>()[b];
    const bool greedy = is_greedy(temperature);
    const float inv_t = greedy ? 1.f : 1.f / temperature;
    const float draft_temperature = a.draft_temperature.defined()
                                        ? a.draft_temperature.const_data_ptr<float>()[b]
                                        : temperature;
    const bool use_draft = draft != nullptr && !greedy;
    const bool draft_greedy = is_greedy(draft_temperature);
    const float inv_td = draft_greedy ? 1.f : 1.f / draft_temperature;
    const int64_t seed = a.seed.const_data_ptr<int64_t>()[b];
    const int64_t position = a.position.const_data_ptr<int64_t>()[b];
    const int64_t start = a.target_start.defined() ? a.target_start.const_data_ptr<int32_t>()[b]
                                                   : b * (a.block + 1);
    const int64_t vocab = a.vocab;
    const auto& f = a.filters;
    const FilterSpec spec =
        make_filter_spec(f.top_k_data(), f.top_p_data(), f.min_p_data(), b, vocab);
    const bool with_logprobs = logprobs != nullptr;
    // Greedy rows need the distribution only for logprobs (at T = 1).
    const bool need_distribution = !greedy || with_logprobs;
    float* row_logprobs = with_logprobs ? logprobs + b * (a.block + 1) : nullptr;
    const auto log_prob = [&](const SoftmaxStats& s, int64_t x) {
      return logf(softmax_prob(target_row[x], s.max, 1.f / s.sum, inv_t));
    };
    const int64_t mask_words = a.allowed_token_mask.defined() ? a.allowed_token_mask.size(1) : 0;

    // Walk the rows; stop at the first rejection (j == n is the bonus row).
    int64_t j = 0;
    bool target_invalid = false, draft_invalid = false;
    SoftmaxStats t{}, d{};
    for (;; ++j) {
      const int64_t row = start + j;
      target_invalid = row < 0 || row >= a.rows;  // only on inputs the value checks reject
      if (target_invalid) break;
      const int32_t* mask_row =
          mask_words ? a.allowed_token_mask.const_data_ptr<int32_t>() + row * mask_words : nullptr;
      t = passes.load(target + row * a.target.stride(0), mask_row, target_row.data());
      target_invalid = t.max == -INFINITY;
      if (!target_invalid && need_distribution) {
        if (spec.active()) {
          filter_target_row(spec, inv_t, t);  // the kept weight is the sum
        } else {
          t.sum = passes.weight_sum(target_row.data(), t.max, inv_t);
        }
      }
      if (target_invalid || j == n) break;
      const int64_t x = draft_token(b, j);
      if (use_draft) {
        const auto* src = draft + b * a.draft_logits.stride(0) + j * a.draft_logits.stride(1);
        d = passes.load(src, nullptr, draft_row.data());
        if (d.max != -INFINITY && !draft_greedy) {
          d.sum = passes.weight_sum(draft_row.data(), d.max, inv_td);
        }
      }
      draft_invalid = x < 0 || x >= vocab || (use_draft && d.max == -INFINITY);
      if (draft_invalid) break;
      bool accept;
      if (greedy) {
        accept = x == t.argmax;
      } else {
        const float p_x = softmax_prob(target_row[x], t.max, 1.f / t.sum, inv_t);
        float q_x = 1.f;
        if (use_draft) {
          q_x = draft_greedy ? (x == d.argmax ? 1.f : 0.f)
                             : softmax_prob(draft_row[x], d.max, 1.f / d.sum, inv_td);
        }
        const int64_t draw_at = offset_position(position, 1 + j);
        accept = accept_draft(philox_uniform(seed, draw_at, kPurposeAccept, 0), p_x, q_x);
      }
      if (!accept) break;
      if (with_logprobs) row_logprobs[j] = log_prob(t, x);
    }

    // Emit the correction (or the bonus token) at row j.
    int64_t token = 0;
    if (!target_invalid && greedy) {
      token = t.argmax;
    } else if (!target_invalid) {
      Proposal q;  // what the rejected draft was proposed from; nothing for the bonus row
      const int64_t x = j < n ? draft_token(b, j) : -1;
      if (j < n && use_draft && d.max != -INFINITY) {
        q.kind = draft_greedy ? Proposal::kOneHot : Proposal::kDistribution;
        q.token = d.argmax;
        q.row = draft_row.data();
        q.stats = d;
        q.inv_temperature = inv_td;
      } else if (j < n && !use_draft && x >= 0 && x < vocab) {
        q.kind = Proposal::kOneHot;
        q.token = x;
      }
      const int64_t pos = offset_position(position, 1 + j);
      float mass = 0.f;
      token = passes.race(target_row.data(), t, inv_t, q, seed, pos, &mass);
      if (!(mass > kMinResidualMass)) {
        token = passes.race(target_row.data(), t, inv_t, Proposal{}, seed, pos, &mass);
      }
    }

    int64_t* out = tokens + b * (a.block + 1);
    for (int64_t k = 0; k <= a.block; ++k) out[k] = k < j ? draft_token(b, k) : -1;
    out[j] = token;
    num_accepted[b] = static_cast<int32_t>(j);
    valid[b] = !(target_invalid || draft_invalid);
    if (with_logprobs) {
      row_logprobs[j] = target_invalid ? -INFINITY : log_prob(t, token);
      for (int64_t k = j + 1; k <= a.block; ++k) row_logprobs[k] = -INFINITY;
    }
  }
};

template <typename TargetT, typename DraftT>
void verify_batch(const VerifyArgs& a, at::Tensor& tokens, at::Tensor& num_accepted,
                  at::Tensor& valid, at::Tensor& logprobs) {
  const auto* target = a.target.const_data_ptr<TargetT>();
  const auto* draft = a.draft_logits.defined() ? a.draft_logits.const_data_ptr<DraftT>() : nullptr;
  const bool split = a.batch < kRequestsPerThread * at::get_num_threads() &&
                     a.vocab >= kMinSplitVocab && at::get_num_threads() > 1;
  if (split) {
    RequestVerifier<TargetT, DraftT> verifier(a, target, draft, tokens, num_accepted, valid,
                                              logprobs, /*split=*/true);
    for (int64_t b = 0; b < a.batch; ++b) verifier(b);
    return;
  }
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    RequestVerifier<TargetT, DraftT> verifier(a, target, draft, tokens, num_accepted, valid,
                                              logprobs, /*split=*/false);
    for (int64_t b = begin; b < end; ++b) verifier(b);
  });
}

struct VerifyCpu : CpuBackend {
  static constexpr bool kKeepPaddedTarget = false;
  static void run(const VerifyArgs& a, VerifyResult& outputs);
};

void VerifyCpu::run(const VerifyArgs& a, VerifyResult& outputs) {
  auto& [tokens, num_accepted, valid, logprobs] = outputs;
  const auto draft_dtype = a.draft_logits.defined() ? a.draft_logits.scalar_type() : at::kFloat;
  dispatch_logit_type(a.target.scalar_type(), [&](auto target_tag) {
    dispatch_logit_type(draft_dtype, [&](auto draft_tag) {
      verify_batch<decltype(target_tag), decltype(draft_tag)>(a, tokens, num_accepted, valid,
                                                              logprobs);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) { m.impl("verify", &ops::verify<VerifyCpu>); }

}  // namespace dspark_ops
