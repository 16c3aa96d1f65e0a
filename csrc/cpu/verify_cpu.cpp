// CPU kernel of verify (docs/semantics.md §3.1).
//
// One request per task (at::parallel_for over the batch). A request walks its rows in order and
// stops at the first rejection, so rows after it are never read. Each row is first copied into a
// float32 scratch row (non-finite logits become -inf, the tail is padded with -inf to a whole number
// of vectors) so every later pass is a branch-free vectorised loop over cached data: max, argmax
// and sum of weights for the acceptance test, then, for the one row that emits a token, the
// exponential race over r = max(p - q, 0) with Philox noise. The scalar math is the shared
// kernels/verify_math.h, so CPU and CUDA apply the same rule with the same random numbers.
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
#include "../kernels/verify_math.h"
#include "../ops.h"

namespace dspark_ops {
namespace {

using Vec = at::vec::Vectorized<float>;
// Rows are padded to whole lane groups: whole Philox blocks (4 words) and two whole vectors.
constexpr int64_t kLanes = 32;
static_assert(kLanes % 4 == 0 && kLanes % (2 * Vec::size()) == 0, "lane group too small");

// Elements per float32 partial sum of a row's weights (a multiple of kLanes).
constexpr int64_t kSumBlock = 1024;
static_assert(kSumBlock % kLanes == 0, "sum blocks must hold whole lane groups");

int64_t padded_length(int64_t vocab) { return (vocab + kLanes - 1) / kLanes * kLanes; }

// Copies a logit row to float32, non-finite values as -inf, padded with -inf.
template <typename T>
void load_row(const T* src, int64_t vocab, float* dst) {
  for (int64_t x = 0; x < vocab; ++x) {
    const float v = static_cast<float>(src[x]);
    dst[x] = v - v == 0.f ? v : -INFINITY;  // false for +-inf and NaN
  }
  for (int64_t x = vocab; x < padded_length(vocab); ++x) dst[x] = -INFINITY;
}

// Drops the tokens whose bit in the allowed-token bitmask row is clear.
void drop_disallowed(const int32_t* mask_row, int64_t vocab, float* row) {
  for (int64_t x = 0; x < vocab; ++x) {
    if (!((static_cast<uint32_t>(mask_row[x >> 5]) >> (x & 31)) & 1u)) row[x] = -INFINITY;
  }
}

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

// Max and first argmax; the sum of weights only for sampled rows (inv_temperature > 0).
SoftmaxStats row_stats(const float* row, int64_t vocab, bool with_sum, float inv_temperature) {
  const int64_t padded = padded_length(vocab);
  Vec m(-INFINITY);
  for (int64_t x = 0; x < padded; x += Vec::size()) m = at::vec::maximum(m, Vec::loadu(row + x));
  SoftmaxStats stats{horizontal_max(m), 0.f, -1};
  if (stats.max == -INFINITY) return stats;
  for (int64_t x = 0; x < vocab; ++x) {
    if (row[x] == stats.max) {
      stats.argmax = static_cast<int32_t>(x);
      break;
    }
  }
  if (with_sum) {
    // float32 lanes within blocks of kSumBlock elements, the blocks added in float64: a single
    // float32 accumulation over V = 151,936 drifts by ~1e-4 relative, visible in the logprobs.
    const Vec max_v(stats.max), inv_t(inv_temperature);
    double total = 0.0;
    for (int64_t x0 = 0; x0 < padded; x0 += kSumBlock) {
      const int64_t x1 = std::min(padded, x0 + kSumBlock);
      Vec s0(0.f), s1(0.f);
      for (int64_t x = x0; x < x1; x += 2 * Vec::size()) {
        s0 += ((Vec::loadu(row + x) - max_v) * inv_t).exp();
        s1 += ((Vec::loadu(row + x + Vec::size()) - max_v) * inv_t).exp();
      }
      total += horizontal_sum(s0 + s1);
    }
    stats.sum = static_cast<float>(total);
  }
  return stats;
}

// What the emitted token is drawn against: r = max(p - q, 0) with q one of these.
struct Proposal {
  enum Kind { kNone, kOneHot, kDistribution } kind = kNone;
  int64_t token = -1;                 // kOneHot
  const float* row = nullptr;         // kDistribution: padded float32 draft row
  SoftmaxStats stats{};               // kDistribution
  float inv_temperature = 1.f;        // kDistribution
};

// Exponential race over r = max(p - q, 0): returns the winner, and the residual mass through
// `mass`. With q = none, r = p.
int64_t race(const float* target, int64_t vocab, const SoftmaxStats& t, float inv_t,
             const Proposal& q, int64_t seed, int64_t position, float* mass) {
  const int64_t padded = padded_length(vocab);
  const Vec t_max(t.max), t_inv_t(inv_t), t_inv_sum(1.f / t.sum), zero(0.f);
  const Vec q_max(q.stats.max), q_inv_t(q.inv_temperature), q_inv_sum(1.f / q.stats.sum);
  Vec mass_v(0.f);
  RaceCandidate best = empty_candidate();
  alignas(64) float u[kLanes], r[kLanes], key[kLanes];
  for (int64_t x0 = 0; x0 < padded; x0 += kLanes) {
    for (int64_t g = 0; g < kLanes / 4; ++g) {
      const auto block = philox_block(seed, position, kPurposeResample,
                                      static_cast<uint32_t>((x0 >> 2) + g));
      for (int k = 0; k < 4; ++k) u[4 * g + k] = uniform_from_bits(block.x[k]);
    }
    for (int64_t i = 0; i < kLanes; i += Vec::size()) {
      const Vec p = ((Vec::loadu(target + x0 + i) - t_max) * t_inv_t).exp() * t_inv_sum;
      Vec ri = p;
      if (q.kind == Proposal::kDistribution) {
        const Vec qd = ((Vec::loadu(q.row + x0 + i) - q_max) * q_inv_t).exp() * q_inv_sum;
        ri = at::vec::maximum(p - qd, zero);
      }
      ri.store(r + i);
    }
    if (q.kind == Proposal::kOneHot && q.token >= x0 && q.token < x0 + kLanes) {
      r[q.token - x0] = 0.f;  // max(p - 1, 0), as p <= 1
    }
    for (int64_t i = 0; i < kLanes; i += Vec::size()) {
      const Vec ri = Vec::loadu(r + i);
      mass_v += ri;
      (ri / -(-Vec::loadu(u + i)).log1p()).store(key + i);
    }
    for (int64_t i = 0; i < kLanes; ++i) {
      if (r[i] > 0.f) best = better_candidate(best, RaceCandidate{key[i], static_cast<int32_t>(x0 + i)});
    }
  }
  *mass = horizontal_sum(mass_v);
  return best.index;
}

template <typename TargetT, typename DraftT>
struct RequestVerifier {
  const VerifyArgs& a;
  const TargetT* target;
  const DraftT* draft;  // null: one-hot drafts
  int64_t* tokens;
  int32_t* num_accepted;
  bool* valid;
  float* logprobs;  // null unless asked for
  std::vector<float> target_row, draft_row, weights;
  std::vector<uint32_t> keys;

  int64_t draft_token(int64_t b, int64_t j) const {
    const auto& t = a.draft_tokens;
    const int64_t offset = b * t.stride(0) + j * t.stride(1);
    return t.scalar_type() == at::kInt ? t.const_data_ptr<int32_t>()[offset]
                                       : t.const_data_ptr<int64_t>()[offset];
  }

  // Applies the request's filters to the scratch target row; t.sum becomes the kept weight.
  void filter_target_row(const FilterSpec& spec, float inv_t, SoftmaxStats& t) {
    if (keys.empty()) {
      keys.resize(a.vocab);
      weights.resize(a.vocab);
    }
    t.sum = filter_row(target_row.data(), a.vocab, t.max, inv_t, spec, keys.data(), weights.data())
                .kept_sum;
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

    // Walk the rows; stop at the first rejection (j == n is the bonus row).
    int64_t j = 0;
    bool target_invalid = false, draft_invalid = false;
    SoftmaxStats t{}, d{};
    for (;; ++j) {
      const int64_t row = start + j;
      target_invalid = row < 0 || row >= a.rows;  // only on inputs the value checks reject
      if (target_invalid) break;
      load_row(target + row * a.target.stride(0), vocab, target_row.data());
      if (a.allowed_token_mask.defined()) {
        const int64_t words = a.allowed_token_mask.size(1);
        drop_disallowed(a.allowed_token_mask.const_data_ptr<int32_t>() + row * words, vocab,
                        target_row.data());
      }
      t = row_stats(target_row.data(), vocab, need_distribution, inv_t);
      target_invalid = t.max == -INFINITY;
      if (!target_invalid && need_distribution && spec.active()) filter_target_row(spec, inv_t, t);
      if (target_invalid || j == n) break;
      const int64_t x = draft_token(b, j);
      if (use_draft) {
        const auto* src = draft + b * a.draft_logits.stride(0) + j * a.draft_logits.stride(1);
        load_row(src, vocab, draft_row.data());
        d = row_stats(draft_row.data(), vocab, !draft_greedy, inv_td);
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
        accept = accept_draft(philox_uniform(seed, position + 1 + j, kPurposeAccept, 0), p_x, q_x);
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
      const int64_t pos = position + 1 + j;
      float mass = 0.f;
      token = race(target_row.data(), vocab, t, inv_t, q, seed, pos, &mass);
      if (!(mass > kMinResidualMass)) {
        token = race(target_row.data(), vocab, t, inv_t, Proposal{}, seed, pos, &mass);
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
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    RequestVerifier<TargetT, DraftT> verifier{a,
                                              target,
                                              draft,
                                              tokens.data_ptr<int64_t>(),
                                              num_accepted.data_ptr<int32_t>(),
                                              valid.data_ptr<bool>(),
                                              a.return_logprobs ? logprobs.data_ptr<float>() : nullptr,
                                              std::vector<float>(padded_length(a.vocab)),
                                              std::vector<float>(draft ? padded_length(a.vocab) : 0),
                                              {},
                                              {}};
    for (int64_t b = begin; b < end; ++b) verifier(b);
  });
}

}  // namespace

VerifyResult verify_cpu(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                        const at::Tensor& num_draft, const at::Tensor& temperature,
                        const at::Tensor& seed, const at::Tensor& position,
                        const std::optional<at::Tensor>& draft_logits,
                        const std::optional<at::Tensor>& target_start,
                        const std::optional<at::Tensor>& draft_temperature,
                        const std::optional<at::Tensor>& top_k,
                        const std::optional<at::Tensor>& top_p,
                        const std::optional<at::Tensor>& min_p,
                        const std::optional<at::Tensor>& allowed_token_mask,
                        bool return_logprobs) {
  const auto a = check_verify_args(target_logits, draft_tokens, num_draft, temperature, seed,
                                   position, draft_logits, target_start, draft_temperature, top_k,
                                   top_p, min_p, allowed_token_mask, return_logprobs);
  auto [tokens, num_accepted, valid, logprobs] = allocate_verify_outputs(a);
  const auto draft_dtype = a.draft_logits.defined() ? a.draft_logits.scalar_type() : at::kFloat;
  dispatch_logit_type(a.target.scalar_type(), [&](auto target_tag) {
    dispatch_logit_type(draft_dtype, [&](auto draft_tag) {
      verify_batch<decltype(target_tag), decltype(draft_tag)>(a, tokens, num_accepted, valid,
                                                              logprobs);
    });
  });
  return {tokens, num_accepted, valid, logprobs};
}

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) { m.impl("verify", &verify_cpu); }

}  // namespace dspark_ops
