// CPU kernel of draft_confidence (docs/semantics.md §3.3): sigmoid((w . [h_j; W1[x_j]] + bias) /
// tau_j) per (request, slot) row, the dot product in float64 (draft_dots.h) as the reference
// computes it. Registered with the drafting ops in cpu/draft_cpu.cpp, after the entry's checks and
// output (args/draft_args.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "draft_dots.h"
#include "../args/draft_args.h"
#include "../common/dispatch.h"
#include "../kernels/draft_math.h"

namespace dspark_ops {

using draft_cpu::dot;
using draft_cpu::dot_widened2;
using draft_cpu::round_up;
using draft_cpu::VecD;

void draft_confidence_cpu(const ConfidenceArgs& a, at::Tensor& out) {
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
        const H* hidden = a.hidden.const_data_ptr<H>();
        const W* w1 = a.w1.const_data_ptr<W>();
        const float* tau = a.calib_temperature.defined() ? a.calib_temperature.const_data_ptr<float>() : nullptr;
        const int64_t h_stride0 = a.hidden.stride(0), h_stride1 = a.hidden.stride(1);
        const int64_t id_stride0 = ids.stride(0), id_stride1 = ids.stride(1);
        const int64_t w1_stride = a.w1.stride(0), vocab = a.w1.size(0);
        at::parallel_for(0, a.batch * a.block, 16, [&](int64_t begin, int64_t end) {
          // [h_j; W1[x_j]] through float32 (exact for every input dtype) with vector loads,
          // zero-padded to whole float64 vectors; widened to float64 inside the dot product.
          // Two rows at a time (see dot_widened2).
          std::vector<float> staged(2 * padded, 0.f);
          const auto stage = [&](int64_t i, float* dst) {
            const int64_t b = i / a.block, j = i % a.block;
            to_float(hidden + b * h_stride0 + j * h_stride1, a.hidden_size, dst);
            const int64_t id = read_id(ids, b * id_stride0 + j * id_stride1);
            if (id < 0 || id >= vocab) {
              std::fill(dst + a.hidden_size, dst + width, 0.f);
            } else {
              to_float(w1 + id * w1_stride, a.rank, dst + a.hidden_size);
            }
          };
          const auto finish = [&](int64_t i, double dot_value) {
            float logit = static_cast<float>(dot_value + b0);
            if (tau != nullptr) logit = logit / tau[i % a.block];
            confidence[i] = confidence_sigmoid(logit);
          };
          int64_t i = begin;
          for (; i + 2 <= end; i += 2) {
            stage(i, staged.data());
            stage(i + 1, staged.data() + padded);
            double dots[2];
            dot_widened2(staged.data(), staged.data() + padded, w.data(), padded, dots);
            finish(i, dots[0]);
            finish(i + 1, dots[1]);
          }
          if (i < end) {
            stage(i, staged.data());
            finish(i, dot(staged.data(), w.data(), padded));
          }
        });
      });
    });
  });
}

}  // namespace dspark_ops
