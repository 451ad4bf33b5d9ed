// The fused expert op's by-expert schedule (expert_mix.cpp picks it): at a few rows per expert, each
// thread runs whole experts, gate/up then down with no barrier in between (down needs only that
// expert's own intermediate rows), instead of every thread taking strips of every expert between
// five barriers. Each thread then streams its experts' weights front to back, one contiguous
// read; a thread done with its own takes the others' remaining strips from their back end (a core
// slowed by other work does not hold up the call). Each pair's output row goes to its own float32 row; a token's rows are summed at the end
// in the strip schedule's order (ascending expert, from zero): its outputs bit for bit.
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
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

// An expert's strips of one projection, shared: its owner takes runs from the front, a thread done
// with its own experts takes runs from the back (so a core slowed by other work does not hold up
// the call); `done` counts finished strips.
struct SharedStrips {
  std::atomic<uint64_t> ends{0};  // front << 32 | back: [front, back) not yet taken
  std::atomic<int64_t> done{0};

  void reset(int64_t n) {
    ends.store(static_cast<uint64_t>(n), std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
  }
  // Up to k strips from the front (or the back): {first, count}, count 0 when none are left.
  std::pair<int64_t, int64_t> take(int64_t k, bool back) {
    uint64_t v = ends.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xFFFFFFFFu);
      if (f >= b) return {0, 0};
      const int64_t n = std::min(k, b - f);
      const uint64_t to = back ? (static_cast<uint64_t>(f) << 32) | static_cast<uint64_t>(b - n)
                               : (static_cast<uint64_t>(f + n) << 32) | static_cast<uint64_t>(b);
      if (ends.compare_exchange_weak(v, to, std::memory_order_acq_rel)) return {back ? b - n : f, n};
    }
  }
  bool empty() const {
    const uint64_t v = ends.load(std::memory_order_relaxed);
    return static_cast<int64_t>(v >> 32) >= static_cast<int64_t>(v & 0xFFFFFFFFu);
  }
};

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

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
  const int64_t busy = static_cast<int64_t>(sp.busy.size());
  for (int64_t e : sp.busy) most = std::max(most, sp.count[e]);
  // per busy expert: gate/up and down strips, and whether its intermediate rows are quantized
  std::unique_ptr<SharedStrips[]> up(new SharedStrips[busy]), down(new SharedStrips[busy]);
  std::unique_ptr<std::atomic<int>[]> ready(new std::atomic<int>[busy]);
  for (int64_t u = 0; u < busy; ++u) {
    up[u].reset(p13.strips);
    down[u].reset(p2.strips);
    ready[u].store(0, std::memory_order_relaxed);
  }
  // runs a thread takes at once: 8 gate/up strips (128 KB of int4 at K = 1024), 2 down strips
  constexpr int64_t kRun13 = 8, kRun2 = 2;
#pragma omp parallel num_threads(nt)
  {
    const auto c = uninitialized<float>(most * kStrip);
    const auto row = uninitialized<uint16_t>(std::max(hp, fp));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {  // every pair's gate/up row, quantized where the expert reads it
      std::memcpy(row.get(), x + (sp.sorted[i] / top) * h, h * 2);  // padded to hp with zeros
      std::fill(row.get() + h, row.get() + hp, uint16_t{0});
      q13.quantize(row.get(), i);
    }
    // Expert u's strips from the front (its owner) or the back (a helper). Whoever finishes its last
    // gate/up strip quantizes the intermediate rows; down strips wait for that.
    const auto work = [&](int64_t u, bool back) {
      const int64_t e = sp.busy[u], n = sp.count[e], r0 = sp.first[e];
      const int64_t* pair = sp.sorted.data() + r0;
      const Rows block13{nullptr, hp, false}, block2{mid.get() + r0 * fp, fp, false};  // iqgemm reads no bf16 rows
      const QuantRows qa = q13.at(r0), qd = q2.at(r0);
      for (auto run = up[u].take(kRun13, back); run.second; run = up[u].take(kRun13, back)) {
        for (int64_t j = run.first; j < run.first + run.second; ++j) {
          strip_gemm(isa, block13, n, p13.strip(e, j), nullptr, &qa, nullptr, c.get());
          act_rows(isa, c.get(), n, b13 ? b13 + e * 2 * fp + j * 32 : nullptr, act, block2, j * 16);
        }
        if (up[u].done.fetch_add(run.second, std::memory_order_acq_rel) + run.second == p13.strips) {
          prefetch_head(p2.strip(e, back ? p2.strips - 1 : 0));  // read while the rows are quantized
          for (int64_t r = 0; r < n; ++r) q2.quantize(block2.get(r, row.get()), r0 + r);
          ready[u].store(1, std::memory_order_release);
        }
      }
      while (!down[u].empty() && !ready[u].load(std::memory_order_acquire)) spin_pause();
      for (auto run = down[u].take(kRun2, back); run.second; run = down[u].take(kRun2, back)) {
        for (int64_t j = run.first; j < run.first + run.second; ++j) {
          strip_gemm(isa, block2, n, p2.strip(e, j), nullptr, &qd, nullptr, c.get());
          put_down(c.get(), n, pair, w, b2 ? b2 + e * ldy + j * kStrip : nullptr, part.get() + r0 * ldy + j * kStrip,
                   ldy);
        }
      }
    };
    const int tid = omp_get_thread_num();
    for (int64_t u = tid; u < busy; u += nt) work(u, false);  // its own experts, front to back
    for (int64_t v = 1; v <= busy; ++v) work((tid + v) % busy, true);  // then the others' remaining strips
#pragma omp barrier
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
