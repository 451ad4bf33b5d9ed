// AVX2's int8-activation products (expert_isa_avx2.cpp's iqgemm): int8 / uint4 / MXFP4 strips times rows
// quantized to int8 per block of 32 k, in integer multiply-adds summed per block, scaled in float32.
// Include only from that AVX2 + FMA unit (an anonymous namespace).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "code_prefetch.h"
#include "expert_iq4_tiles_avx2.h"
#include "experts.h"

namespace {

using moelight::Strip;
using moelight::WFormat;

// One block's int32 sums (k in [32 blk, 32 blk + 32), pair-rows 16 blk ..) for R activation rows:
// iacc[r][q] = columns 8q .. 8q + 7.

// int8 codes: each column block's 16 codes widened to int16 in pair order (column 8q + i: k even,
// k odd), multiplied by a broadcast pair of activations with _mm256_madd_epi16.
template <int R>
inline void i8_block(const moelight::QuantRows& a, const uint8_t* codes, int64_t blk, __m256i iacc[R][4]) {
  for (int64_t p = blk * 16; p < blk * 16 + 16; ++p) {
    __m256i ap[R];
    for (int r = 0; r < R; ++r) {
      int16_t pair[2] = {a.q[r * a.k + 2 * p], a.q[r * a.k + 2 * p + 1]};
      int32_t bits;
      std::memcpy(&bits, pair, 4);
      ap[r] = _mm256_set1_epi32(bits);
    }
    for (int q = 0; q < 4; ++q) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 64 + 16 * q)));
      for (int r = 0; r < R; ++r) iacc[r][q] = _mm256_add_epi32(iacc[r][q], _mm256_madd_epi16(w, ap[r]));
    }
  }
}

// Nibble codes (uint4, or MXFP4 as offset codes: fp4_offset_codes) in 8-bit multiply-adds:
// _mm256_maddubs_epi16 multiplies a pair-row's unsigned codes by the signed activations of its two
// k and adds each column's pair into one int16. The row's 32 bytes hold columns 0..15 in their low
// nibbles and 16..31 in their high ones, so two multiply-adds take the whole pair-row. kInt16Run<F>
// pair-rows sum in int16 without overflow (uint4: 8 x 2 x 15 x 127 = 30,480) before they are
// widened: the same integers as int16 products would give.
template <WFormat F, int R>
inline void nibble_block(const moelight::QuantRows& a, const uint8_t* codes, int64_t blk, __m256i iacc[R][4]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t p0 = blk * 16; p0 < blk * 16 + 16; p0 += kInt16Run<F>) {
    __m256i sacc[R][2];  // columns 0..15 and 16..31 in int16
    for (int r = 0; r < R; ++r) sacc[r][0] = sacc[r][1] = _mm256_setzero_si256();
    for (int64_t p = p0; p < p0 + kInt16Run<F>; ++p) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32));
      const __m256i lo = nibble_codes<F>(_mm256_and_si256(x, low));
      const __m256i hi = nibble_codes<F>(_mm256_and_si256(_mm256_srli_epi16(x, 4), low));
      for (int r = 0; r < R; ++r) {
        int16_t pair;
        std::memcpy(&pair, a.q + r * a.k + 2 * p, 2);
        const __m256i ap = _mm256_set1_epi16(pair);
        sacc[r][0] = _mm256_add_epi16(sacc[r][0], _mm256_maddubs_epi16(lo, ap));
        sacc[r][1] = _mm256_add_epi16(sacc[r][1], _mm256_maddubs_epi16(hi, ap));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m128i lo8 = _mm256_castsi256_si128(sacc[r][h]), hi8 = _mm256_extracti128_si256(sacc[r][h], 1);
        iacc[r][2 * h] = _mm256_add_epi32(iacc[r][2 * h], _mm256_cvtepi16_epi32(lo8));
        iacc[r][2 * h + 1] = _mm256_add_epi32(iacc[r][2 * h + 1], _mm256_cvtepi16_epi32(hi8));
      }
  }
}

// R rows of c = a x the strip (`ahead`: prefetching it, on the first pass over it).
template <WFormat F, int R>
void iqgemm_rows(const moelight::QuantRows& a, const Strip& st, float* c, int64_t ldc, bool ahead) {
  __m256 acc[R][4];  // the sum over finished groups
  for (int r = 0; r < R; ++r)
    for (auto& x : acc[r]) x = _mm256_setzero_ps();
  const int64_t blocks_per_group = st.group / 32;
  for (int64_t g = 0; g < st.k / st.group; ++g) {
    __m256 gacc[R][4];  // this group's sum of c * a (a = scale * q per block)
    float asum[R];      // and of a, for the bias
    for (int r = 0; r < R; ++r) {
      asum[r] = 0.0f;
      for (auto& x : gacc[r]) x = _mm256_setzero_ps();
    }
    if (ahead) prefetch_group_scales(st, g);
    for (int64_t blk = g * blocks_per_group; blk < (g + 1) * blocks_per_group; ++blk) {
      __m256i iacc[R][4];
      for (int r = 0; r < R; ++r)
        for (auto& x : iacc[r]) x = _mm256_setzero_si256();
      if (ahead) prefetch_block_codes<F>(st.codes, blk);
      if constexpr (F == WFormat::I8) i8_block<R>(a, st.codes, blk, iacc);
      else nibble_block<F, R>(a, st.codes, blk, iacc);
      for (int r = 0; r < R; ++r) {
        const float sa = a.scale[r * (a.k / 32) + blk];
        asum[r] = fma_ss(sa, static_cast<float>(a.sum[r * (a.k / 32) + blk]), asum[r]);
        const __m256 sv = _mm256_set1_ps(sa);
        for (int q = 0; q < 4; ++q) gacc[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][q]), sv, gacc[r][q]);
      }
    }
    for (int q = 0; q < 4; ++q) {
      const __m256 s = _mm256_loadu_ps(st.scales + g * 32 + 8 * q);
      const __m256 b = st.bias ? _mm256_loadu_ps(st.bias + g * 32 + 8 * q) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r)
        acc[r][q] = _mm256_fmadd_ps(b, _mm256_set1_ps(asum[r]), _mm256_fmadd_ps(gacc[r][q], s, acc[r][q]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + r * ldc + 8 * q, acc[r][q]);
}

// R rows of c = a x an MXFP4 strip (`ahead`: prefetching it): fp4_block_step a block at a time.
template <int R>
void fp4_iqgemm_rows(const moelight::QuantRows& a, const Strip& st, float* c, int64_t ldc, bool ahead) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& x : acc[r]) x = _mm256_setzero_ps();
  const int64_t nb = a.k / 32;
  for (int64_t blk = 0; blk < nb; ++blk) {
    if (ahead) {
      prefetch_group_scales(st, blk);
      prefetch_block_codes<WFormat::FP4>(st.codes, blk);
    }
    __m256i iacc[R][4];
    for (int r = 0; r < R; ++r)
      for (auto& x : iacc[r]) x = _mm256_setzero_si256();
    nibble_block<WFormat::FP4, R>(a, st.codes, blk, iacc);
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q)
        acc[r][q] = fp4_block_step(iacc[r][q], a.sum[r * nb + blk], a.scale[r * nb + blk], st.scales + blk * 32 + 8 * q,
                                   acc[r][q]);
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + r * ldc + 8 * q, acc[r][q]);
}

template <WFormat F>
void iqgemm_format(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  const auto rows = [&](int64_t r0) {
    return moelight::QuantRows{a.q + r0 * a.k, a.scale + r0 * (a.k / 32), a.sum + r0 * (a.k / 32), a.k};
  };
  const auto run = [&](int64_t r, auto two) {
    constexpr int R = decltype(two)::value ? 2 : 1;
    if constexpr (F == WFormat::FP4) fp4_iqgemm_rows<R>(rows(r), st, c + r * ldc, ldc, r == 0);
    else iqgemm_rows<F, R>(rows(r), st, c + r * ldc, ldc, r == 0);
  };
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) run(r, std::true_type{});
  if (r < m) run(r, std::false_type{});
}

// Rows per expert from which nibble strips are unpacked once per k-block for all rows (iq4_many_rows).
// On strips read from DRAM (2 threads, GPT-OSS's, Qwen3's and Mixtral-like K) the few-row kernel, which
// prefetches its first pass and re-reads the strip from L2 for each further pair of rows, took 0.55-0.93x
// the tiles' time at 2-7 rows; from 8-10 rows the tiles win (benchmarks/expert_iq4_rows_crossover.cpp).
constexpr int64_t kIq4ManyRows = 8;

template <WFormat F>
void nibble_iqgemm(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  if (m >= kIq4ManyRows) return iq4_many_rows<F>(a, m, st, c, ldc);
  iqgemm_format<F>(a, m, st, c, ldc);
}

void iqgemm(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  switch (st.fmt) {
    case WFormat::I8: return iqgemm_format<WFormat::I8>(a, m, st, c, ldc);
    case WFormat::U4: return nibble_iqgemm<WFormat::U4>(a, m, st, c, ldc);
    case WFormat::FP4: return nibble_iqgemm<WFormat::FP4>(a, m, st, c, ldc);
    default: return;  // int_rows sends no other format here
  }
}

}  // namespace
