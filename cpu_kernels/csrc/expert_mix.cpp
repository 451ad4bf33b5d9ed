// All of a layer's routed experts in one call (torch.ops.moelight.expert_mix).
//
// 1. The (token, slot) pairs are sorted by expert (counting sort) and each expert's input rows
//    gathered into a bf16 block padded to 16 rows (an AMX tile's height): rows one after another,
//    or, where the ISA has a tile GEMM (AMX), its tiles (experts.h).
// 2. Gate/up: one work item per (expert, strip of 16 gate + 16 up columns). A quantized strip is
//    dequantised in registers for an expert's few rows (decode), else once into the thread's
//    scratch and reused by all of the expert's rows. Where the ISA has it (AVX2, AVX512-VNNI, AMX
//    through VNNI), int8 and uint4 strips (up to its row limits) meet the expert's rows quantized
//    to int8 per block of 32 (RowQuant) in integer multiply-adds instead, exactly its rows (not a
//    tile's 16), unless the caller asks for the bf16 path's numbers. The epilogue adds the biases,
//    applies the activation and writes 16 bf16 intermediate columns in the same layout.
// 3. Down: one work item per run of consecutive strips of 32 output columns, over every expert in
//    ascending order (the order the reference sums them in), an expert's strips of the run one
//    after another (its weights contiguous, its rows kept in cache); the epilogue adds the bias,
//    scales by the pair's routing weight and accumulates into the token's float32 row, rounded
//    once at the end.
// The tile GEMM and AVX512-BF16's gemm are told the next strip their thread multiplies, and read its
// codes ahead (a quantized strip's too: they are then in L2 when it is dequantised); the down pass
// also reads the head of the next expert's run ahead (prefetch_head) for the other ISAs.
// At a few rows per expert on int8-activation products, whole experts per thread instead
// (expert_by_expert.h; set_expert_schedule overrides the rule for tests and benchmarks).
// Gate/up items are ordered by their expert's row count, largest first, and down items each
// span all experts; threads take items dynamically (gate/up in short runs of one expert's
// consecutive strips; RunQueue, so each strip knows the thread's next one), so experts with uneven
// token counts keep every thread busy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "experts.h"
#include "expert_by_expert.h"
#include "expert_mix_parts.h"
#include "row_quant.h"

namespace moelight {
namespace {

using row_quant::RowQuant;
using row_quant::uninitialized;

// Down's epilogue: y[token][0, 32) += (c[r] + bias) * routing weight for an expert's n rows, whose
// pairs are pair[0, n).
void add_down(const float* c, int64_t n, const int64_t* pair, int64_t top, const float* weight, const float* bias,
              float* y, int64_t ldy) {
  for (int64_t r = 0; r < n; ++r) {
    const float w = weight[pair[r]];
    float* dst = y + (pair[r] / top) * ldy;
    const float* src = c + r * kStrip;
    if (bias) {
      for (int64_t q = 0; q < kStrip; ++q) dst[q] += (src[q] + bias[q]) * w;
    } else {
      for (int64_t q = 0; q < kStrip; ++q) dst[q] += src[q] * w;
    }
  }
}

struct Item {
  int64_t expert, strip;
};

// The schedule (set_expert_schedule): 0 the rule (by_expert), 1 strips, 2 by expert wherever it can run.
int g_schedule = 0;

}  // namespace

const char* set_expert_schedule(const char* name) {
  const std::string s(name);
  TORCH_CHECK(s == "auto" || s == "strips" || s == "experts", "moelight: set_expert_schedule takes 'auto', "
              "'strips' or 'experts', got '", s, "' (the schedule is unchanged)");
  g_schedule = s == "strips" ? 1 : s == "experts" ? 2 : 0;
  return g_schedule == 1 ? "strips" : g_schedule == 2 ? "experts" : "auto";
}

at::Tensor expert_mix(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const c10::optional<at::Tensor>& s13,
                      const c10::optional<at::Tensor>& z13, const at::Tensor& w2,
                      const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& z2,
                      const c10::optional<at::Tensor>& bias13, const c10::optional<at::Tensor>& bias2,
                      int64_t fmt13, int64_t group13, int64_t fmt2, int64_t group2, int64_t act_kind, double limit,
                      double alpha, bool int8_activations) {
  const ExpertIsa* base = expert_isa();
  TORCH_CHECK(base != nullptr, "moelight: expert_mix needs AVX2 or newer");
  ExpertIsa table = *base;
  if (!int8_activations) table.iqgemm = nullptr;  // the caller wants the bf16 path's numbers
  const ExpertIsa* isa = &table;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "moelight: expert_mix wants contiguous bf16 x [T, h]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "moelight: expert ids must be contiguous int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moelight: routing weights must be contiguous float32 [T, k]");
  const int64_t T = x.size(0), h = x.size(1), top = ids.size(1), E = w13.size(0);
  const int64_t hp = (h + 31) / 32 * 32;
  const int64_t fp = w13.size(1) * 16;  // intermediate columns (padded): 16 per gate/up strip
  const Packed p13 = packed_of(w13, s13, z13, fmt13, group13, hp, E, "gate_up");
  const Packed p2 = packed_of(w2, s2, z2, fmt2, group2, fp, E, "down");
  TORCH_CHECK(p2.strips * kStrip >= h, "moelight: down strips cover ", p2.strips * kStrip, " < h = ", h);
  const float* b13 = opt_f32(bias13, E * 2 * fp, "gate_up bias");
  const float* b2 = opt_f32(bias2, E * p2.strips * kStrip, "down bias");
  const Act act{static_cast<int>(act_kind), static_cast<float>(limit), static_cast<float>(alpha)};

  auto out = at::empty({T, h}, x.options());
  if (T == 0) return out;
  // 1. pairs sorted by expert (stable: token order within an expert)
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t pairs = T * top;
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "moelight: expert id ", idp[i], " out of range [0, ", E, ")");
    ++count[idp[i]];
  }
  std::vector<int64_t> first(E + 1, 0), row0(E + 1, 0);  // first sorted pair; first padded row
  for (int64_t e = 0; e < E; ++e) {
    first[e + 1] = first[e] + count[e];
    row0[e + 1] = row0[e] + (count[e] + kRowPad - 1) / kRowPad * kRowPad;
  }
  std::vector<int64_t> sorted(pairs);
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t at = next[idp[i]]++;
      sorted[at] = i;
    }
  }
  const int64_t rows = row0[E];
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) busy.push_back(e);
  const std::vector<int64_t> ascending = busy;  // down's order
  std::stable_sort(busy.begin(), busy.end(), [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  const int nt = at::get_num_threads();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* wp = weights.data_ptr<float>();
  if (g_schedule != 1 && by_expert(isa, p13.fmt, p2.fmt, busy, count, nt, g_schedule == 2)) {
    mix_by_expert(isa, xp, h, wp, SortedPairs{sorted, first, count, busy, T, top}, p13, p2, b13, b2, act, nt,
                  reinterpret_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
  std::vector<Item> items13;
  for (int64_t e : busy)
    for (int64_t j = 0; j < p13.strips; ++j) items13.push_back({e, j});
  int64_t max_rows = 0;
  for (int64_t e : busy) max_rows = std::max(max_rows, row0[e + 1] - row0[e]);

  // Buffers every read of which is written first (gather, act, RowQuant): left uninitialised, as
  // zero-filling them cost a decode call more than its gather.
  const auto a13 = uninitialized<uint16_t>(rows * hp), a2 = uninitialized<uint16_t>(rows * fp);
  // int8 activations of the experts whose few rows take iqgemm (none: empty)
  bool any13 = false, any2 = false;
  for (int64_t e : busy) {
    any13 = any13 || int_rows(isa, p13.fmt, count[e]);
    any2 = any2 || int_rows(isa, p2.fmt, count[e]);
  }
  RowQuant q13(any13 ? rows : 0, hp), q2(any2 ? rows : 0, fp);
  // A token's gate/up row is the same for each of its top-k experts: quantized once (qx, those
  // tokens routed to an iqgemm expert), then copied into each expert's rows by the gather.
  RowQuant qx(any13 ? T : 0, hp);
  std::vector<char> to_quantize(any13 ? T : 0, 0);
  if (any13) {
    for (int64_t i = 0; i < pairs; ++i)
      if (int_rows(isa, p13.fmt, count[idp[i]])) to_quantize[i / top] = 1;
  }
  const int64_t ldy = p2.strips * kStrip;
  std::vector<float> y(T * ldy, 0.0f);  // float32 sums of each token's pairs
  // Gate/up items go to threads in runs of up to 8 consecutive strips of an expert (contiguous in
  // memory): one run is one stream for the hardware prefetcher, which items taken one by one, the
  // threads' strips interleaved, restarted at every 16 KB int4 strip. At least 8 runs per thread.
  const int64_t run13 = std::max<int64_t>(1, std::min<int64_t>(8, static_cast<int64_t>(items13.size()) / (8 * nt)));
  // Down items: runs of consecutive strips, two per thread.
  const int64_t run2 = std::max<int64_t>(1, p2.strips / (2 * nt));
  const int64_t n13 = static_cast<int64_t>(items13.size()), runs2 = (p2.strips + run2 - 1) / run2;
  RunQueue queue13(n13, run13), queue2(runs2, 1);
  const bool tiles = isa->tile_gemm != nullptr;
  const auto block13 = [&](int64_t e) { return Rows{a13.get() + row0[e] * hp, hp, tiles}; };
  const auto block2 = [&](int64_t e) { return Rows{a2.get() + row0[e] * fp, fp, tiles}; };

#pragma omp parallel num_threads(nt)
  {
    const auto bscratch = uninitialized<uint16_t>(std::max(hp, fp) * kStrip);
    const auto c = uninitialized<float>(max_rows * kStrip);
    const auto row = uninitialized<uint16_t>(std::max(hp, fp));
    if (any13) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        if (!to_quantize[t]) continue;
        std::memcpy(row.get(), xp + t * h, h * 2);  // the row padded to hp with zeros
        std::fill(row.get() + h, row.get() + hp, uint16_t{0});
        qx.quantize(row.get(), t);
      }
    }
    // gather: row r of expert e is token sorted[first[e] + r] / top; padding rows (those its gate/up
    // strips read: none on iqgemm) and columns zero
#pragma omp for schedule(static)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = count[e];
      const bool quantized = any13 && int_rows(isa, p13.fmt, n);  // its n rows go to iqgemm
      const Rows block = block13(e);
      for (int64_t r = 0; r < rows_of(isa, p13.fmt, n); ++r) {
        if (r < n) {
          std::memcpy(row.get(), xp + (sorted[first[e] + r] / top) * h, h * 2);
          std::fill(row.get() + h, row.get() + hp, uint16_t{0});
        } else if (r == n) {
          std::fill(row.get(), row.get() + hp, uint16_t{0});
        }
        block.put(r, row.get());
        if (quantized && r < n) q13.copy_row(qx, sorted[first[e] + r] / top, row0[e] + r);
      }
    }
    if (isa->begin) isa->begin();
    queue13.each([&](int64_t i, int64_t after) {
      const int64_t e = items13[i].expert, j = items13[i].strip, m = rows_of(isa, p13.fmt, count[e]);
      const QuantRows qa = any13 ? q13.at(row0[e]) : QuantRows{};
      const uint8_t* next = after < n13 ? p13.strip(items13[after].expert, items13[after].strip).codes : nullptr;
      strip_gemm(isa, block13(e), m, p13.strip(e, j), next, any13 ? &qa : nullptr, bscratch.get(), c.get());
      act_rows(isa, c.get(), m, b13 ? b13 + e * 2 * fp + j * 32 : nullptr, act, block2(e), j * 16);
    });
#pragma omp barrier
    if (any2) {
#pragma omp for schedule(static)
      for (int64_t e = 0; e < E; ++e) {
        if (!count[e] || !int_rows(isa, p2.fmt, count[e])) continue;
        for (int64_t r = 0; r < count[e]; ++r) q2.quantize(block2(e).get(r, row.get()), row0[e] + r);
      }
    }
    queue2.each([&](int64_t run, int64_t after) {  // a run of output strips: every expert, ascending
      const int64_t j0 = run * run2, j1 = std::min(p2.strips, j0 + run2);
      for (size_t u = 0; u < ascending.size(); ++u) {
        const int64_t e = ascending[u], m = rows_of(isa, p2.fmt, count[e]);
        if (u + 1 < ascending.size()) prefetch_head(p2.strip(ascending[u + 1], j0));
        const QuantRows qa = any2 ? q2.at(row0[e]) : QuantRows{};
        for (int64_t j = j0; j < j1; ++j) {
          const uint8_t* next = j + 1 < j1                   ? p2.strip(e, j + 1).codes
                                : u + 1 < ascending.size() ? p2.strip(ascending[u + 1], j0).codes
                                : after < runs2            ? p2.strip(ascending[0], after * run2).codes
                                                           : nullptr;
          strip_gemm(isa, block2(e), m, p2.strip(e, j), next, any2 ? &qa : nullptr, bscratch.get(), c.get());
          add_down(c.get(), count[e], sorted.data() + first[e], top, wp, b2 ? b2 + e * ldy + j * kStrip : nullptr,
                   y.data() + j * kStrip, ldy);
        }
      }
    });
#pragma omp barrier
    if (isa->end) isa->end();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t q = 0; q < h; ++q) op[t * h + q] = to_bf16(y[t * ldy + q]);
    }
  }
  return out;
}

// RowQuant's quantize of bf16 rows x [T, k] (k a multiple of 32) -> (codes [T, k] int8, scales and code sums
// [T, k / 32]) by the named loop ("scalar", "avx2", "avx512"; refused where the CPU lacks it): for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_quant_int8(const at::Tensor& x, const std::string& loop_name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 32 == 0,
              "moelight: row_quant_int8 wants bf16 rows [T, k], k a multiple of 32");
  using row_quant::QuantizeLoop;
  const QuantizeLoop loop = loop_name == "avx512" ? QuantizeLoop::kAvx512
                            : loop_name == "avx2" ? QuantizeLoop::kAvx2
                                                  : QuantizeLoop::kScalar;
  TORCH_CHECK(loop_name == "scalar" || loop_name == "avx2" || loop_name == "avx512",
              "moelight: row_quant_int8: loop is scalar, avx2 or avx512, not ", loop_name);
  TORCH_CHECK(loop <= row_quant::best_quantize_loop(), "moelight: row_quant_int8: this CPU cannot run ", loop_name);
  const at::Tensor xc = x.contiguous();
  const int64_t T = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({T, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({T, k / 32}, x.options().dtype(at::kFloat));
  at::Tensor sum = at::empty({T, k / 32}, x.options().dtype(at::kInt));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    row_quant::quantize_row(xp + t * k, k, q.data_ptr<int8_t>() + t * k, scale.data_ptr<float>() + t * (k / 32),
                            sum.data_ptr<int32_t>() + t * (k / 32), loop);
  return {q, scale, sum};
}

}  // namespace moelight
