// Building blocks of the attention kernel for one block of kKeyBlock keys: KV element
// loads, cache-line touching, P.V accumulation, widening a block into L1 and the bf16
// even/odd element order. Include after `#pragma GCC target` in an ISA TU.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace {

constexpr int kKeyBlock = 16;
constexpr float kRescaleSlack = 8.0f;  // see softmax_block_row
constexpr int kMaxRows = 64;  // rows per pass; more rows re-read K/V (never in practice)
// Rows per pass for head dim D: keeps the stack scratch of one call under ~150 KB.
template <int D> constexpr int rows_per_pass() { return D > 128 ? kMaxRows / 2 : kMaxRows; }

template <class T> struct KvLoad;
template <> struct KvLoad<float> {
  template <class V> static typename V::R load(const float* p) { return V::load(p); }
};
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
template <> struct KvLoad<Bf16> {
  template <class V> static typename V::R load(const Bf16* p) {
    return V::load(reinterpret_cast<const uint16_t*>(p), true);
  }
};
template <> struct KvLoad<F16> {
  template <class V> static typename V::R load(const F16* p) {
    return V::load(reinterpret_cast<const uint16_t*>(p), false);
  }
};

// Demand-touch the cache lines of one row that this pass of a multi-pass loop does not
// read (bytes [from, to)). The passes below read every row in chunks, so DRAM sees each
// row's lines in two visits; touching the rest in the first visit keeps the stream
// sequential for the hardware prefetcher (software prefetch hurt on the machines we tried).
inline void touch_rest(const void* row, int from, int to) {
  const volatile char* c = static_cast<const volatile char*>(row);
  for (int b = from; b < to; b += 64) (void)c[b];
}

// V rows of the block touched while K rows are scored, so the misses of K and V are in
// flight together instead of in alternating bursts (every path except the bf16-dot scores
// with float32 P, which measured faster without it). Empty (p == nullptr) for all but the
// first row group.
struct RowTouch {
  const char* p = nullptr;
  int64_t stride = 0;  // bytes between rows
  int nbytes = 0;
  int rows = 0;  // rows that exist (a tail block has fewer)
  void row(int t) const {
    if (p != nullptr && t < rows) touch_rest(p + t * stride, 0, nbytes);
  }
};

// f(std::integral_constant<int, NR>{}, r) for row groups [r, r + NR) of 8, 4, 2 and 1 rows
// covering [0, nr): the P.V kernels keep NR rows of accumulators in registers.
template <class F>
inline void for_row_groups(int nr, F&& f) {
  int r = 0;
  for (; r + 8 <= nr; r += 8) f(std::integral_constant<int, 8>{}, r);
  if (nr - r >= 4) { f(std::integral_constant<int, 4>{}, r); r += 4; }
  if (nr - r >= 2) { f(std::integral_constant<int, 2>{}, r); r += 2; }
  if (nr - r >= 1) f(std::integral_constant<int, 1>{}, r);
}

// acc rows [0, NR) += P[r][t] * v_t for t < nk, with v already float32 in L1. NR rows x CG
// chunks of accumulators stay in registers; each broadcast P[r][t] serves CG chunks.
template <class V, int D, int NR>
inline void accumulate_pv(float* acc, const float* P, const float* vf, int64_t vst, int nk) {
  using R = typename V::R;
  constexpr int NCH = D / V::W;
  constexpr int CG = NR >= 8 ? 2 : (NR >= 4 ? 4 : 8);
  for (int c0 = 0; c0 < NCH; c0 += CG) {
    R a[NR][CG];
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) a[r][cc] = V::load(acc + r * D + (c0 + cc) * V::W);
    for (int t = 0; t < nk; ++t) {
      if (c0 == 0 && CG < NCH) touch_rest(vf + t * vst, CG * V::W * 4, D * 4);
      R vv[CG];
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) vv[cc] = V::load(vf + t * vst + (c0 + cc) * V::W);
      for (int r = 0; r < NR; ++r) {
        const R p = V::set1(P[r * kKeyBlock + t]);
        for (int cc = 0; cc < CG; ++cc)
          if (c0 + cc < NCH) a[r][cc] = V::fma(p, vv[cc], a[r][cc]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) V::store(acc + r * D + (c0 + cc) * V::W, a[r][cc]);
  }
}

// Same as accumulate_pv, reading bf16 V rows in place: each 2W-element chunk converts to
// an even and an odd vector (the kPerm order of acc) with two integer ops, no scratch copy.
template <class V, int D, int NR>
inline void accumulate_pv_bf16(float* acc, const float* P, const uint16_t* v, int64_t vst, int nk) {
  using R = typename V::R;
  constexpr int NP = D / (2 * V::W);  // bf16 chunks per row
  constexpr int CP = NR >= 8 ? 1 : (NR >= 4 ? 2 : 4);
  for (int c0 = 0; c0 < NP; c0 += CP) {
    R a[NR][2 * CP];
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) a[r][cc] = V::load(acc + r * D + c0 * 2 * V::W + cc * V::W);
    for (int t = 0; t < nk; ++t) {
      if (c0 == 0 && CP < NP) touch_rest(v + t * vst, CP * 2 * V::W * 2, D * 2);
      R vv[2 * CP];
      for (int cc = 0; cc < CP; ++cc)
        if (c0 + cc < NP) V::load_bf16_pair(v + t * vst + (c0 + cc) * 2 * V::W, vv[2 * cc], vv[2 * cc + 1]);
      for (int r = 0; r < NR; ++r) {
        const R p = V::set1(P[r * kKeyBlock + t]);
        for (int cc = 0; cc < 2 * CP; ++cc)
          if (c0 + cc / 2 < NP) a[r][cc] = V::fma(p, vv[cc], a[r][cc]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) V::store(acc + r * D + c0 * 2 * V::W + cc * V::W, a[r][cc]);
  }
}

// bf16 cache with AVX512-BF16: acc += P.V as bf16 dot products over pairs of keys. Rows t
// and t+1 are paired column by column (two unpacks per 32 columns), so one instruction adds
// p_t v_t + p_t+1 v_t+1: half the FMA-port work of widening V. P must already be bf16 values
// (the softmax rounds it, so its row sums match). acc holds each 32-column chunk in the dot
// order of pair_rows.
template <class V, int D, int NR>
inline void accumulate_pv_dot(float* acc, const float* P, const uint16_t* v, int64_t vst, int nk) {
  using R = typename V::R;
  constexpr int NP = D / (2 * V::W);  // bf16 chunks per row
  constexpr int CP = NR >= 8 ? 1 : (NR >= 4 ? 2 : 4);
  alignas(64) uint32_t pp[NR][kKeyBlock / 2];
  for (int r = 0; r < NR; ++r) V::pack_pairs(P + r * kKeyBlock, pp[r]);
  for (int c0 = 0; c0 < NP; c0 += CP) {
    R a[NR][2 * CP];
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) a[r][cc] = V::load(acc + r * D + c0 * 2 * V::W + cc * V::W);
    for (int t = 0; t < nk; t += 2) {
      const uint16_t* v0 = v + t * vst;
      const uint16_t* v1 = t + 1 < nk ? v0 + vst : nullptr;  // odd tail: p_t+1 is 0
      if (c0 == 0 && CP < NP) {
        touch_rest(v0, CP * 2 * V::W * 2, D * 2);
        if (v1 != nullptr) touch_rest(v1, CP * 2 * V::W * 2, D * 2);
      }
      R lo[CP], hi[CP];
      for (int cc = 0; cc < CP; ++cc) {
        if (c0 + cc < NP) {
          const int off = (c0 + cc) * 2 * V::W;
          V::pair_rows(V::load_raw(v0 + off), v1 != nullptr ? V::load_raw(v1 + off) : V::zero(), lo[cc], hi[cc]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        const R p = V::set1_pair(pp[r][t / 2]);
        for (int cc = 0; cc < CP; ++cc) {
          if (c0 + cc < NP) {
            a[r][2 * cc] = V::dot_bf16(a[r][2 * cc], lo[cc], p);
            a[r][2 * cc + 1] = V::dot_bf16(a[r][2 * cc + 1], hi[cc], p);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) V::store(acc + r * D + c0 * 2 * V::W + cc * V::W, a[r][cc]);
  }
}

// Block of nk rows (stride st) -> float32 rows in L1, zero-padded to kKeyBlock rows so the
// vector loops never read outside the cache tensor. Sequential, so the prefetcher keeps up.
// With kPerm (bf16, D a multiple of 2W) each 2W chunk is stored even elements first, then
// odd ones: the conversion needs no shuffles, and q / the output use the same order.
template <class V, class T, int D, bool kPerm>
inline void load_block(float* dst, const T* src, int64_t st, int nk) {
  for (int t = 0; t < kKeyBlock; ++t) {
    if constexpr (kPerm) {
      for (int c = 0; c < D; c += 2 * V::W) {
        typename V::R ev = V::zero(), od = V::zero();
        if (t < nk) V::load_bf16_pair(reinterpret_cast<const uint16_t*>(src + t * st + c), ev, od);
        V::store(dst + t * D + c, ev);
        V::store(dst + t * D + c + V::W, od);
      }
    } else {
      for (int c = 0; c < D; c += V::W) {
        V::store(dst + t * D + c, t < nk ? KvLoad<T>::template load<V>(src + t * st + c) : V::zero());
      }
    }
  }
}

// One row's online softmax over a block of kKeyBlock scores at pr (the first `valid` real), with lazy
// rescaling: the reference max m only moves when a score exceeds it by more than kRescaleSlack, so
// p = exp(s - m) <= e^8 cannot overflow, while most blocks skip the horizontal max, the scalar exp
// and the rescale of the row's D accumulators. Probabilities replace the scores in pr (rounded to
// bf16 when round_p: P.V then takes P in bf16, and the sum must add what it uses); lv holds the
// row's lane-wise sum.
template <class V, int D>
inline void softmax_block_row(float* pr, int valid, float& m, float* lv, float* acc, bool round_p) {
  using R = typename V::R;
  constexpr int NV = kKeyBlock / V::W;
  R s[NV];
  for (int h = 0; h < NV; ++h) s[h] = V::load(pr + h * V::W);
  for (int h = 0; h < NV; ++h) {
    if (valid < kKeyBlock) s[h] = V::keep_first(s[h], valid - h * V::W, -__builtin_inff());
  }
  bool grow = false;
  for (int h = 0; h < NV; ++h) grow |= V::any_gt(s[h], m + kRescaleSlack);
  R lsum = V::load(lv);
  if (grow) {
    R mx = s[0];
    for (int h = 1; h < NV; ++h) mx = V::max(mx, s[h]);
    const float bm = V::hmax(mx);
    const float m_new = m > bm ? m : bm;
    if (m != -__builtin_inff()) {  // on the first block acc and lsum are still zero
      const R av = V::set1(__builtin_expf(m - m_new));
      lsum = V::mul(lsum, av);
      for (int c = 0; c < D; c += V::W) V::store(acc + c, V::mul(av, V::load(acc + c)));
    }
    m = m_new;
  }
  const R mv = V::set1(m);
  for (int h = 0; h < NV; ++h) {
    R p = V::exp(V::sub(s[h], mv));
    if (valid < kKeyBlock) p = V::keep_first(p, valid - h * V::W, 0.0f);
    if constexpr (V::kBf16Dot) {
      if (round_p) p = V::round_bf16(p);
    }
    V::store(pr + h * V::W, p);
    lsum = V::add(lsum, p);
  }
  V::store(lv, lsum);
}

// Position in the even/odd chunk order of natural element c (see load_block).
template <int W>
inline int perm_index(int c) {
  const int base = c - c % (2 * W), w = c % (2 * W);
  return base + (w % 2) * W + w / 2;
}

}  // namespace
