// The fused expert op's by-expert schedule (expert_mix.cpp picks it): at a few rows per expert, each
// thread runs whole experts, gate/up then down with no barrier in between (down needs only that
// expert's own intermediate rows), instead of every thread taking strips of every expert between
// five barriers. Each thread then streams its experts' weights front to back, one contiguous
// read. Each pair's output row goes to its own float32 row; a token's rows are summed at the end
// in the strip schedule's order (ascending expert, from zero): its outputs bit for bit.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "expert_mix_parts.h"
#include "experts.h"
#include "row_quant.h"

namespace moelight {
namespace {

// The rule's row limit: experts of up to this many rows (decode batches), where the VNNI products
// stream the weights; above it a thread's share is compute, which strips balance better.
constexpr int64_t kByExpertRows = 10;

// Whether the by-expert schedule can run (every busy expert's rows on iqgemm, in both projections)
// and, unless `forced`, the rule takes it: at most kByExpertRows rows per expert and as many busy
// experts per thread (whole experts on uneven threads leave one idle for an expert's read).
bool by_expert(const ExpertIsa* isa, WFormat f13, WFormat f2, const std::vector<int64_t>& busy,
               const std::vector<int64_t>& count, int nt, bool forced) {
  if (!isa->iqgemm) return false;
  int64_t most = 0;
  for (int64_t e : busy) {
    if (!int_rows(isa, f13, count[e]) || !int_rows(isa, f2, count[e])) return false;
    most = std::max(most, count[e]);
  }
  return forced || (most <= kByExpertRows && static_cast<int64_t>(busy.size()) % nt == 0);
}

// Down's epilogue here: part[r][0, 32) = (c[r] + bias) * routing weight for an expert's n rows (pairs
// pair[0, n)), the product add_down adds.
void put_down(const float* c, int64_t n, const int64_t* pair, const float* weight, const float* bias, float* part,
              int64_t ldp) {
  for (int64_t r = 0; r < n; ++r) {
    const float w = weight[pair[r]];
    float* dst = part + r * ldp;
    const float* src = c + r * kStrip;
    if (bias) {
      for (int64_t q = 0; q < kStrip; ++q) dst[q] = (src[q] + bias[q]) * w;
    } else {
      for (int64_t q = 0; q < kStrip; ++q) dst[q] = src[q] * w;
    }
  }
}

// The call's pairs sorted by expert (expert_mix's step 1): sorted[first[e] + r] is expert e's r-th pair.
struct SortedPairs {
  const std::vector<int64_t>& sorted;
  const std::vector<int64_t>& first;
  const std::vector<int64_t>& count;
  const std::vector<int64_t>& busy;  // experts with pairs, most rows first
  int64_t tokens, top;
};

// out [T, h] (bf16) = the layer's experts on x [T, h] (bf16), by expert; w: the routing weights.
void mix_by_expert(const ExpertIsa* isa, const uint16_t* x, int64_t h, const float* w, const SortedPairs& sp,
                   const Packed& p13, const Packed& p2, const float* b13, const float* b2, Act act, int nt,
                   uint16_t* out) {
  using row_quant::RowQuant;
  using row_quant::uninitialized;
  const int64_t hp = p13.k, fp = p2.k, ldy = p2.strips * kStrip, pairs = sp.tokens * sp.top, top = sp.top;
  // an expert's rows at its pairs' sorted positions: intermediate (bf16), both int8 operands, outputs
  const auto mid = uninitialized<uint16_t>(pairs * fp);
  RowQuant q13(pairs, hp), q2(pairs, fp);
  const auto part = uninitialized<float>(pairs * ldy);
  std::vector<int64_t> of_token(pairs), filled(sp.tokens, 0);  // token t's pairs, ascending expert
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t t = sp.sorted[i] / top;
    of_token[t * top + filled[t]++] = i;
  }
  int64_t most = 0;
  for (int64_t e : sp.busy) most = std::max(most, sp.count[e]);
#pragma omp parallel num_threads(nt)
  {
    const auto c = uninitialized<float>(most * kStrip);
    const auto row = uninitialized<uint16_t>(std::max(hp, fp));
#pragma omp for schedule(static, 1)
    for (size_t u = 0; u < sp.busy.size(); ++u) {
      const int64_t e = sp.busy[u], n = sp.count[e], r0 = sp.first[e];
      const int64_t* pair = sp.sorted.data() + r0;
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(row.get(), x + (pair[r] / top) * h, h * 2);  // padded to hp with zeros
        std::fill(row.get() + h, row.get() + hp, uint16_t{0});
        q13.quantize(row.get(), r0 + r);
      }
      const Rows block13{nullptr, hp, false}, block2{mid.get() + r0 * fp, fp, false};  // iqgemm reads no bf16 rows
      const QuantRows qa = q13.at(r0), qd = q2.at(r0);
      for (int64_t j = 0; j < p13.strips; ++j) {
        strip_gemm(isa, block13, n, p13.strip(e, j), nullptr, &qa, nullptr, c.get());
        act_rows(isa, c.get(), n, b13 ? b13 + e * 2 * fp + j * 32 : nullptr, act, block2, j * 16);
      }
      prefetch_head(p2.strip(e, 0));  // read while the intermediate rows are quantized
      for (int64_t r = 0; r < n; ++r) q2.quantize(block2.get(r, row.get()), r0 + r);
      for (int64_t j = 0; j < p2.strips; ++j) {
        strip_gemm(isa, block2, n, p2.strip(e, j), nullptr, &qd, nullptr, c.get());
        put_down(c.get(), n, pair, w, b2 ? b2 + e * ldy + j * kStrip : nullptr, part.get() + r0 * ldy + j * kStrip,
                 ldy);
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < sp.tokens; ++t) {
      for (int64_t q = 0; q < h; ++q) {
        float sum = 0.0f;  // add_down's y, from zero
        for (int64_t s = 0; s < top; ++s) sum += part[of_token[t * top + s] * ldy + q];
        out[t * h + q] = to_bf16(sum);
      }
    }
  }
}

}  // namespace
}  // namespace moelight
