// CPU kernels of the scheduling family (docs/semantics.md §3.4): schedule_verify,
// plan_verify_budget, allocate_verify and pack_verify_inputs. The ranking is a sort of one 64-bit key per eligible
// pair and the admission walks are sequential; the math is kernels/schedule_math.h, shared with
// the CUDA kernels, so both backends return identical lengths.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../args/schedule_args.h"
#include "../common/dispatch.h"
#include "../common/philox.h"
#include "../kernels/schedule_math.h"

namespace dspark_ops {
namespace {

// Keys of the eligible pairs (survival > 0, j < cap), in admission order.
std::vector<uint64_t> ranked_pairs(const at::Tensor& confidence, const at::Tensor& max_verify) {
  const auto c = confidence.contiguous();
  const float* data = c.const_data_ptr<float>();
  const int64_t batch = c.size(0), block = c.size(1);
  const int32_t* caps = max_verify.defined() ? max_verify.const_data_ptr<int32_t>() : nullptr;
  std::vector<uint64_t> keys;
  keys.reserve(batch * block);
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t cap = caps ? caps[r] : block;
    float a = 1.f;
    for (int64_t j = 0; j < std::min(cap, block); ++j) {
      a *= clamp_confidence(data[r * block + j]);
      const uint64_t key = pair_key(a, static_cast<uint32_t>(j * batch + r));
      if (key == kIneligible) break;  // survivals never grow again
      keys.push_back(key);
    }
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

// num_verify[r] = 1 + the largest position among the first `admitted` ranked pairs of request r.
void lengths_of(const std::vector<uint64_t>& keys, int64_t admitted, at::Tensor& out) {
  const int64_t batch = out.size(0);
  out.zero_();
  int32_t* lengths = out.data_ptr<int32_t>();
  for (int64_t k = 0; k < admitted; ++k) {
    const uint32_t index = key_index(keys[k]);
    const int32_t r = static_cast<int32_t>(index % batch), j = static_cast<int32_t>(index / batch);
    lengths[r] = std::max(lengths[r], j + 1);
  }
}

struct ScheduleVerifyCpu : CpuBackend {
  static void run(const ScheduleArgs& a, at::Tensor& num_verify);
};

struct PlanVerifyBudgetCpu : CpuBackend {
  static void run(const ScheduleArgs& a, at::Tensor& budget);
};

struct AllocateVerifyCpu : CpuBackend {
  static void run(const ScheduleArgs& a, at::Tensor& num_verify);
};

struct PackVerifyInputsCpu : CpuBackend {
  static void run(const PackArgs& a, std::tuple<at::Tensor, at::Tensor, at::Tensor>& outputs);
};

void ScheduleVerifyCpu::run(const ScheduleArgs& a, at::Tensor& num_verify) {
  const at::Tensor& confidence = a.confidence;
  const auto keys = ranked_pairs(confidence, a.max_verify);
  const auto rates = a.step_rate.contiguous();
  const float* rate = rates.const_data_ptr<float>();
  const int64_t batch = confidence.size(0), capacity = rates.size(0);
  int64_t tau = batch * static_cast<int64_t>(kSurvivalScale), admitted = 0;
  double best = theta(tau, rate, batch);
  for (const uint64_t key : keys) {
    const int64_t tokens = batch + admitted + 1;
    if (tokens >= capacity) break;
    const int64_t next = tau + fixed_survival(key_survival(key));
    const double value = theta(next, rate, tokens);
    if (!(value > best)) break;  // the early stop keeps the output distribution exact
    tau = next;
    best = value;
    ++admitted;
  }
  lengths_of(keys, admitted, num_verify);
}

void PlanVerifyBudgetCpu::run(const ScheduleArgs& a, at::Tensor& budget) {
  const at::Tensor& confidence = a.confidence;
  const auto keys = ranked_pairs(confidence, at::Tensor());
  const auto rates = a.step_rate.contiguous();
  const float* rate = rates.const_data_ptr<float>();
  const int64_t batch = confidence.size(0), capacity = rates.size(0);
  int64_t tau = batch * static_cast<int64_t>(kSurvivalScale), best_tokens = batch;
  double best = theta(tau, rate, batch);
  for (int64_t k = 0; k < static_cast<int64_t>(keys.size()) && batch + k + 1 < capacity; ++k) {
    tau += fixed_survival(key_survival(keys[k]));
    const double value = theta(tau, rate, batch + k + 1);
    if (value > best) {
      best = value;
      best_tokens = batch + k + 1;
    }
  }
  budget.fill_(best_tokens);
}

void AllocateVerifyCpu::run(const ScheduleArgs& a, at::Tensor& num_verify) {
  const auto keys = ranked_pairs(a.confidence, a.max_verify);
  const int64_t want = a.budget.item<int32_t>() - a.confidence.size(0);
  lengths_of(keys, std::clamp<int64_t>(want, 0, keys.size()), num_verify);
}

template <typename AnchorT, typename TokenT>
void pack_rows(const at::Tensor& anchor, const at::Tensor& draft_tokens, const int32_t* lengths,
               const int64_t* starts, int64_t* ids, int64_t* pos, int32_t* cu) {
  const int64_t batch = draft_tokens.size(0), block = draft_tokens.size(1);
  const AnchorT* anchors = anchor.const_data_ptr<AnchorT>();
  const TokenT* drafts = draft_tokens.const_data_ptr<TokenT>();
  const int64_t stride_b = draft_tokens.stride(0), stride_j = draft_tokens.stride(1);
  cu[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = std::clamp<int64_t>(lengths[b], 0, block), start = cu[b];
    ids[start] = anchors[b * anchor.stride(0)];
    for (int64_t j = 0; j < n; ++j) ids[start + 1 + j] = drafts[b * stride_b + j * stride_j];
    for (int64_t j = 0; j <= n; ++j) pos[start + j] = offset_position(starts[b], j);
    cu[b + 1] = static_cast<int32_t>(start + n + 1);
  }
}

void PackVerifyInputsCpu::run(const PackArgs& a,
                              std::tuple<at::Tensor, at::Tensor, at::Tensor>& outputs) {
  auto& [input_ids, positions, cu_seqlens] = outputs;
  const at::Tensor &anchor = a.anchor, &draft_tokens = a.draft_tokens, &lengths = a.num_verify,
                   &starts = a.position;
  // Rows past a request's last token stay zero.
  input_ids.zero_();
  positions.zero_();
  const auto pack = [&](auto anchor_tag, auto token_tag) {
    pack_rows<decltype(anchor_tag), decltype(token_tag)>(
        anchor, draft_tokens, lengths.const_data_ptr<int32_t>(), starts.const_data_ptr<int64_t>(),
        input_ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
        cu_seqlens.data_ptr<int32_t>());
  };
  dispatch_index_type(anchor.scalar_type(), [&](auto anchor_tag) {
    dispatch_index_type(draft_tokens.scalar_type(),
                        [&](auto token_tag) { pack(anchor_tag, token_tag); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dspark_ops, CPU, m) {
  m.impl("schedule_verify", &ops::schedule_verify<ScheduleVerifyCpu>);
  m.impl("plan_verify_budget", &ops::plan_verify_budget<PlanVerifyBudgetCpu>);
  m.impl("allocate_verify", &ops::allocate_verify<AllocateVerifyCpu>);
  m.impl("pack_verify_inputs", &ops::pack_verify_inputs<PackVerifyInputsCpu>);
}

}  // namespace dspark_ops
