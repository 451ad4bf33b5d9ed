// The fused expert op's shared pieces (expert_mix.cpp, expert_by_expert.h): the packed weights'
// strips, an expert's block of rows, one strip's GEMM and the gate/up epilogue. Included by
// expert_mix.cpp only (an anonymous namespace).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "experts.h"
#include "row_quant.h"

namespace moelight {
namespace {


using row_quant::RowQuant;
using row_quant::uninitialized;

constexpr int64_t kStrip = 32;
constexpr int64_t kRowPad = 16;

int64_t strip_bytes(WFormat f, int64_t k) {
  switch (f) {
    case WFormat::BF16: return k * kStrip * 2;
    case WFormat::I8:
    case WFormat::F8: return k * kStrip;
    default: return k * kStrip / 2;
  }
}

struct Packed {
  const uint8_t* codes;
  const float* scales;
  const float* bias;
  int64_t strips, k, group;
  WFormat fmt;

  Strip strip(int64_t e, int64_t j) const {
    const int64_t s = e * strips + j;
    const int64_t per_strip = (k / group) * kStrip;
    return Strip{codes + s * strip_bytes(fmt, k), scales ? scales + s * per_strip : nullptr,
                 bias ? bias + s * per_strip : nullptr, k, group, fmt};
  }
};

Packed packed_of(const at::Tensor& codes, const c10::optional<at::Tensor>& scales,
                 const c10::optional<at::Tensor>& bias, int64_t fmt, int64_t group, int64_t k, int64_t experts,
                 const char* what) {
  TORCH_CHECK(fmt >= 0 && fmt <= 4, "moelight: unknown weight format ", fmt, " of ", what);
  const WFormat f = static_cast<WFormat>(fmt);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == experts,
              "moelight: ", what, " codes must be contiguous [E, strips, bytes]");
  TORCH_CHECK(k % 32 == 0 && codes.size(2) * codes.element_size() == strip_bytes(f, k),
              "moelight: ", what, " strips do not hold K = ", k, " in format ", fmt);
  Packed p{static_cast<const uint8_t*>(codes.data_ptr()), nullptr, nullptr, codes.size(1), k, k, f};
  if (f != WFormat::BF16) {
    TORCH_CHECK(group > 0 && group % 32 == 0 && k % group == 0, "moelight: group ", group, " of ", what,
                " must be a multiple of 32 dividing K = ", k);
    p.group = group;
    TORCH_CHECK(f != WFormat::FP4 || group == 32, "moelight: MXFP4 ", what, " has a scale per 32 k (group 32), not ",
                group);
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                    scales->numel() == experts * p.strips * (k / group) * kStrip,
                "moelight: ", what, " needs float32 scales [E, strips, K / group, 32]");
    p.scales = scales->data_ptr<float>();
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->sizes() == scales->sizes() && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                  "moelight: ", what, " bias must match its scales");
      p.bias = bias->data_ptr<float>();
    }
  }
  return p;
}

const float* opt_f32(const c10::optional<at::Tensor>& t, int64_t numel, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, "moelight: ", what,
              " must be contiguous float32 of ", numel, " values");
  return t->data_ptr<float>();
}

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The rows the GEMM runs for an expert with n tokens: n rounded up to the ISA's row step (within
// the block's 16-row padding, whose extra rows are zero).
int64_t rows_for(const ExpertIsa* isa, int64_t n) { return (n + isa->row_step - 1) / isa->row_step * isa->row_step; }

// An expert's block of rows of k values: rows of stride k, or the tile GEMM's tiles (experts.h).
struct Rows {
  uint16_t* p;
  int64_t k;
  bool tiles;

  void put(int64_t r, const uint16_t* src) const {
    if (!tiles) return static_cast<void>(std::memcpy(p + r * k, src, k * 2));
    for (int64_t b = 0; b < k; b += 32) std::memcpy(p + tiled_offset(r, b, k), src + b, 64);
  }
  // Row r as a contiguous row: in place, or copied into `row`.
  const uint16_t* get(int64_t r, uint16_t* row) const {
    if (!tiles) return p + r * k;
    for (int64_t b = 0; b < k; b += 32) std::memcpy(row + b, p + tiled_offset(r, b, k), 64);
    return row;
  }
};

// Whether an expert with n tokens multiplies `fmt` strips on int8 activations (iqgemm).
bool int_rows(const ExpertIsa* isa, WFormat fmt, int64_t n) {
  if (!isa->iqgemm) return false;
  switch (fmt) {
    case WFormat::I8: return n <= isa->iqgemm_rows_i8;
    case WFormat::U4: return n <= isa->iqgemm_rows_u4;
    case WFormat::FP4: return n <= isa->iqgemm_rows_fp4;
    default: return false;
  }
}

// The rows an expert with n tokens runs on `fmt` strips: iqgemm takes exactly its n (a decode token
// is one row, not an AMX tile's 16); gemm n rounded up to the ISA's row step. Rows past n of the
// gate/up output (a2) are then unspecified where only the down strips run whole tiles: their
// products land in rows of c that nothing reads (a tile's row depends on its own A row only).
int64_t rows_of(const ExpertIsa* isa, WFormat fmt, int64_t n) { return int_rows(isa, fmt, n) ? n : rows_for(isa, n); }

// c[0, m) = a[0, m) x the strip: bf16 strips directly; int8 / uint4 / MXFP4 ones (int_rows) on the int8
// activations `qa` (when given); other quantized ones dequantised in registers for a few rows, or
// once into `scratch` and shared by all of them. `next`: the codes of the strip the thread
// multiplies next (nullptr: unknown), which the tile GEMM and AVX512-BF16's gemm read ahead.
void strip_gemm(const ExpertIsa* isa, const Rows& a, int64_t m, const Strip& st, const uint8_t* next,
                const QuantRows* qa, uint16_t* scratch, float* c) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(st.codes);
  const int64_t next_bytes = strip_bytes(st.fmt, st.k);  // a strip of the same pack
  if (st.fmt != WFormat::BF16) {
    if (qa && int_rows(isa, st.fmt, m)) return isa->iqgemm(*qa, m, st, c, kStrip);
    if (!a.tiles && isa->qgemm && m <= isa->qgemm_rows) return isa->qgemm(a.p, a.k, m, st, c, kStrip);
    if (a.tiles && isa->tile_qgemm)
      return isa->tile_qgemm(a.p, m, st, scratch, next, next_bytes, c, kStrip);
    isa->dequant(st, scratch);
    b = scratch;
  }
  if (a.tiles) return isa->tile_gemm(a.p, m, b, st.k, next, next_bytes, c, kStrip);
  isa->gemm(a.p, a.k, m, b, st.k, next, next_bytes, c, kStrip);
}

// The gate/up epilogue of m rows of c into columns [col, col + 16) of `out` (a tiled block: per tile
// of 16 rows, whose rows are 32 values apart).
void act_rows(const ExpertIsa* isa, const float* c, int64_t m, const float* bias, Act act, const Rows& out,
              int64_t col) {
  if (!out.tiles) return isa->act(c, kStrip, m, bias, act, out.p + col, out.k);
  for (int64_t r = 0; r < m; r += 16)
    isa->act(c + r * kStrip, kStrip, std::min<int64_t>(16, m - r), bias, act, out.p + tiled_offset(r, col, out.k), 32);
}

// Runs of `run` consecutive items [0, n) handed out to threads as they ask, each thread claiming
// its next run when it starts one: the last item of a run then knows the item its thread runs
// after it, whose strip the tile GEMM reads ahead. (With omp's dynamic schedule it read strip j + 1
// of the expert, at a run's end the other thread's strip: 1/8 of the weights read twice, and each
// run then started on cold weights; bench-1b T = 256 bf16, results/expert_amx_bf16_t256.md.)
struct RunQueue {
  std::atomic<int64_t> taken{0};
  int64_t n, run;

  RunQueue(int64_t items, int64_t run_length) : n(items), run(run_length) {}
  int64_t claim() { return taken.fetch_add(run, std::memory_order_relaxed); }

  // f(item, after) for each item this thread claims, `after` the item it runs next (>= n: none).
  template <class F>
  void each(F f) {
    for (int64_t cur = claim(), nxt; cur < n; cur = nxt) {
      nxt = claim();
      const int64_t end = std::min(n, cur + run);
      for (int64_t i = cur; i < end; ++i) f(i, i + 1 < end ? i + 1 : nxt);
    }
  }
};

// Prefetch of a strip's first 4 KB of codes and of its scales and bias (up to 1 KB each), issued
// while the strip before it runs: the down pass reads one short strip per expert (3.5 KB of int4 at
// Qwen3-style widths), each a new stream the hardware prefetcher has not seen.
void prefetch_head(const Strip& st) {
  const int64_t bytes = std::min<int64_t>(4096, strip_bytes(st.fmt, st.k));
  const char* codes = reinterpret_cast<const char*>(st.codes);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(codes + o, 0, 3);
  const int64_t sbytes = std::min<int64_t>(1024, (st.k / st.group) * kStrip * 4);
  for (const float* v : {st.scales, st.bias}) {
    if (!v) continue;
    for (int64_t o = 0; o < sbytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(v) + o, 0, 3);
  }
}

}  // namespace
}  // namespace moelight
