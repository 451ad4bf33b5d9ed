// AVX2 + FMA pieces of the fused expert op (CPUs without AVX512-BF16): bf16 pairs widened to
// float32 by shifts (even k) and masks (odd k), FMAs over 2 rows x 32 columns; dequantisation of
// the quantized formats to bf16 pairs, into scratch or in registers for an expert's 1-2 decode rows;
// int8 / uint4 codes times int8 activations in integer multiply-adds; the gate/up epilogue.
// Reached only after the CPU check.
#include <cstdint>
#include <cstring>

#include "experts.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace {

using moelight::Strip;
using moelight::WFormat;

const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline __m256 nibble_lut(__m256i idx, __m256 lo8, __m256 hi8) {
  const __m256 a = _mm256_permutevar8x32_ps(lo8, idx), b = _mm256_permutevar8x32_ps(hi8, idx);
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> sign bit
  return _mm256_blendv_ps(a, b, high);
}

inline __m256 fp8_to_f32(__m128i bytes8) {
  const __m256i x = _mm256_cvtepu8_epi32(bytes8);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, mag)), _mm256_set1_ps(1.329227995784916e36f));
}

// Element e of a 64-element row (8 per vector) is column e / 2: its scale and bias.
inline void group_vectors(const Strip& st, int64_t g, __m256 s[8], __m256 b[8]) {
  const __m256i dup[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
  for (int q = 0; q < 4; ++q) {  // columns 8q .. 8q + 7
    const __m256 sv = _mm256_loadu_ps(st.scales + g * 32 + 8 * q);
    const __m256 bv = st.bias ? _mm256_loadu_ps(st.bias + g * 32 + 8 * q) : _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      s[2 * q + h] = _mm256_permutevar8x32_ps(sv, dup[h]);
      b[2 * q + h] = _mm256_permutevar8x32_ps(bv, dup[h]);
    }
  }
}

void dequant(const Strip& st, uint16_t* out) {
  const int64_t rows = st.k / 2, rows_per_group = st.group / 2;
  const bool nibbles = st.fmt == WFormat::U4 || st.fmt == WFormat::FP4;
  float lut[16];
  for (int i = 0; i < 16; ++i) lut[i] = st.fmt == WFormat::FP4 ? kE2M1[i] : static_cast<float>(i);
  const __m256 lo8 = _mm256_loadu_ps(lut), hi8 = _mm256_loadu_ps(lut + 8);
  __m256 s[8], b[8];
  for (int64_t r = 0; r < rows; ++r) {
    if (r % rows_per_group == 0) group_vectors(st, r / rows_per_group, s, b);
    __m256 v[8];
    if (nibbles) {
      const uint8_t* p = st.codes + r * 32;
      for (int q = 0; q < 4; ++q) {  // bytes 8q.. hold elements 8q.. (low) and 32 + 8q.. (high)
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * q)));
        v[q] = nibble_lut(_mm256_and_si256(x, _mm256_set1_epi32(0x0F)), lo8, hi8);
        v[4 + q] = nibble_lut(_mm256_srli_epi32(x, 4), lo8, hi8);
      }
    } else {
      const uint8_t* p = st.codes + r * 64;
      for (int q = 0; q < 8; ++q) {
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * q));
        v[q] = st.fmt == WFormat::I8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)) : fp8_to_f32(x);
      }
    }
    for (int q = 0; q < 8; ++q) VecAvx2::store_half(out + r * 64 + 8 * q, _mm256_fmadd_ps(v[q], s[q], b[q]), true);
  }
}

// Rows r < R of a at pair p (k = 2p, 2p + 1), each k broadcast as float32: even k in ae, odd in ao.
template <int R>
inline void pair_activations(const uint16_t* a, int64_t lda, int64_t p, __m256 ae[R], __m256 ao[R]) {
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int r = 0; r < R; ++r) {
    uint32_t pair;
    std::memcpy(&pair, a + r * lda + 2 * p, 4);
    const __m256i av = _mm256_set1_epi32(static_cast<int>(pair));
    ae[r] = _mm256_castsi256_ps(_mm256_slli_epi32(av, 16));
    ao[r] = _mm256_castsi256_ps(_mm256_and_si256(av, hi_mask));
  }
}

template <int R>
inline void gemm_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, float* c, int64_t ldc) {
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& x : acc[r]) x = _mm256_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m256 ae[R], ao[R];
    pair_activations<R>(a, lda, p, ae, ao);
    for (int q = 0; q < 4; ++q) {  // columns 8q .. 8q + 7
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * 64 + 16 * q));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
      for (int r = 0; r < R; ++r) acc[r][q] = _mm256_fmadd_ps(wo, ao[r], _mm256_fmadd_ps(we, ae[r], acc[r][q]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + r * ldc + 8 * q, acc[r][q]);
}

void gemm(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t k, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) gemm_rows<2>(a + r * lda, lda, b, k, c + r * ldc, ldc);
  if (r < m) gemm_rows<1>(a + r * lda, lda, b, k, c + r * ldc, ldc);  // an odd row (decode: often the only one)
}

// --- gemm on quantized strips, dequantised in registers -----------------------------------------

// Pair-row bytes of column block q (columns 8q .. 8q + 7), split by k parity: the even k's 8 codes
// in the low half, the odd k's in the high half. Byte formats hold 16 pair elements per block;
// nibble formats hold elements 0..31 in the low nibbles of the row's 32 bytes, 32..63 in the high.
template <WFormat F>
inline __m128i block_codes(const uint8_t* row, int q) {
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m128i x;
  if constexpr (F == WFormat::I8 || F == WFormat::F8) {
    x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * q));
  } else {
    x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * (q & 1)));
    x = _mm_and_si128(q < 2 ? x : _mm_srli_epi16(x, 4), _mm_set1_epi8(0x0F));
    // FP4: e2m1 values times two are small integers (the scales are halved to match)
    if constexpr (F == WFormat::FP4)
      x = _mm_shuffle_epi8(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), x);
  }
  return _mm_shuffle_epi8(x, split);
}

// The low 8 codes as float32 values before scaling.
template <WFormat F>
inline __m256 code_values(__m128i x) {
  if constexpr (F == WFormat::I8 || F == WFormat::FP4) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  else if constexpr (F == WFormat::U4) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
  else return fp8_to_f32(x);
}

// float32 -> the nearest bf16 (ties to even), kept as a float32 with zero low bits: what dequant
// stores and gemm widens back. Veltkamp's split at 16 bits (three float ops, no integer ones) is
// that rounding for every finite value of magnitude in [2^-126, 2^110], checked exhaustively over
// the mantissas; it differs only in giving +0 for -0, which no sum here can tell apart.
inline __m256 round_bf16(__m256 v) {
  __m256 g = _mm256_mul_ps(v, _mm256_set1_ps(65537.0f));
  asm("" : "+x"(g));  // g rounded as a product: no contraction of v - g into an fma
  return _mm256_add_ps(g, _mm256_sub_ps(v, g));
}

template <WFormat F, int R>
void qgemm_rows(const uint16_t* a, int64_t lda, const Strip& st, float* c, int64_t ldc) {
  constexpr bool kNibbles = F == WFormat::U4 || F == WFormat::FP4;
  constexpr int64_t kRowBytes = kNibbles ? 32 : 64;
  const __m256 half = _mm256_set1_ps(F == WFormat::FP4 ? 0.5f : 1.0f);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& x : acc[r]) x = _mm256_setzero_ps();
  const int64_t rows_per_group = st.group / 2;
  for (int64_t g = 0; g < st.k / st.group; ++g) {
    __m256 s[4], b[4];
    for (int q = 0; q < 4; ++q) {
      s[q] = _mm256_mul_ps(_mm256_loadu_ps(st.scales + g * 32 + 8 * q), half);
      b[q] = st.bias ? _mm256_loadu_ps(st.bias + g * 32 + 8 * q) : _mm256_setzero_ps();
    }
    for (int64_t p = g * rows_per_group; p < (g + 1) * rows_per_group; ++p) {
      __m256 ae[R], ao[R];
      pair_activations<R>(a, lda, p, ae, ao);
      const uint8_t* row = st.codes + p * kRowBytes;
      for (int q = 0; q < 4; ++q) {
        const __m128i x = block_codes<F>(row, q);
        const __m256 we = round_bf16(_mm256_fmadd_ps(code_values<F>(x), s[q], b[q]));
        const __m256 wo = round_bf16(_mm256_fmadd_ps(code_values<F>(_mm_srli_si128(x, 8)), s[q], b[q]));
        for (int r = 0; r < R; ++r) acc[r][q] = _mm256_fmadd_ps(wo, ao[r], _mm256_fmadd_ps(we, ae[r], acc[r][q]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + r * ldc + 8 * q, acc[r][q]);
}

template <WFormat F>
void qgemm_format(const uint16_t* a, int64_t lda, int64_t m, const Strip& st, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) qgemm_rows<F, 2>(a + r * lda, lda, st, c + r * ldc, ldc);
  if (r < m) qgemm_rows<F, 1>(a + r * lda, lda, st, c + r * ldc, ldc);
}

void qgemm(const uint16_t* a, int64_t lda, int64_t m, const Strip& st, float* c, int64_t ldc) {
  switch (st.fmt) {
    case WFormat::I8: return qgemm_format<WFormat::I8>(a, lda, m, st, c, ldc);
    case WFormat::F8: return qgemm_format<WFormat::F8>(a, lda, m, st, c, ldc);
    case WFormat::U4: return qgemm_format<WFormat::U4>(a, lda, m, st, c, ldc);
    case WFormat::FP4: return qgemm_format<WFormat::FP4>(a, lda, m, st, c, ldc);
    default: return;  // BF16 strips never come here
  }
}

// --- int8 / uint4 strips times int8 activations -------------------------------------------------

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

// uint4 codes in 8-bit multiply-adds: _mm256_maddubs_epi16 multiplies a pair-row's unsigned codes
// by the signed activations of its two k and adds each column's pair into one int16. The row's 32
// bytes hold columns 0..15 in their low nibbles and 16..31 in their high ones, so two multiply-adds
// take the whole pair-row. A pair is at most 2 x 15 x 127 = 3810 in magnitude, so 8 pair-rows sum
// in int16 without overflow before they are widened: the same integers as int16 products would give.
template <int R>
inline void u4_block(const moelight::QuantRows& a, const uint8_t* codes, int64_t blk, __m256i iacc[R][4]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t p0 = blk * 16; p0 < blk * 16 + 16; p0 += 8) {
    __m256i sacc[R][2];  // columns 0..15 and 16..31 in int16
    for (int r = 0; r < R; ++r) sacc[r][0] = sacc[r][1] = _mm256_setzero_si256();
    for (int64_t p = p0; p < p0 + 8; ++p) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32));
      const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
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

template <WFormat F, int R>
void iqgemm_rows(const moelight::QuantRows& a, const Strip& st, float* c, int64_t ldc) {
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
    for (int64_t blk = g * blocks_per_group; blk < (g + 1) * blocks_per_group; ++blk) {
      __m256i iacc[R][4];
      for (int r = 0; r < R; ++r)
        for (auto& x : iacc[r]) x = _mm256_setzero_si256();
      if constexpr (F == WFormat::I8) i8_block<R>(a, st.codes, blk, iacc);
      else u4_block<R>(a, st.codes, blk, iacc);
      for (int r = 0; r < R; ++r) {
        const float sa = a.scale[r * (a.k / 32) + blk];
        asum[r] += sa * static_cast<float>(a.sum[r * (a.k / 32) + blk]);
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

template <WFormat F>
void iqgemm_format(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  const auto rows = [&](int64_t r0) {
    return moelight::QuantRows{a.q + r0 * a.k, a.scale + r0 * (a.k / 32), a.sum + r0 * (a.k / 32), a.k};
  };
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) iqgemm_rows<F, 2>(rows(r), st, c + r * ldc, ldc);
  if (r < m) iqgemm_rows<F, 1>(rows(r), st, c + r * ldc, ldc);
}

void iqgemm(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  if (st.fmt == WFormat::I8) return iqgemm_format<WFormat::I8>(a, m, st, c, ldc);
  if (st.fmt == WFormat::U4) return iqgemm_format<WFormat::U4>(a, m, st, c, ldc);
}

void act(const float* c, int64_t ldc, int64_t m, const float* bias, moelight::Act fn, uint16_t* out, int64_t ldo) {
  const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(fn.limit), nlim = _mm256_set1_ps(-fn.limit);
  const __m256 nalpha = _mm256_set1_ps(fn.kind == 1 ? -fn.alpha : -1.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 g = _mm256_loadu_ps(c + r * ldc + 8 * h), u = _mm256_loadu_ps(c + r * ldc + 16 + 8 * h);
      if (bias) {
        g = _mm256_add_ps(g, _mm256_loadu_ps(bias + 8 * h));
        u = _mm256_add_ps(u, _mm256_loadu_ps(bias + 16 + 8 * h));
      }
      if (fn.kind == 1) {
        g = _mm256_min_ps(g, lim);
        u = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(u, lim), nlim), one);
      }
      const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, VecAvx2::exp(_mm256_mul_ps(g, nalpha))));
      VecAvx2::store_half(out + r * ldo + 8 * h, _mm256_mul_ps(sig, u), true);
    }
  }
}

// qgemm for up to 2 rows per expert: at 4 it ties with dequantising once (bench-1b's experts, fp8 / MXFP4 here).
// iqgemm: int8 strips up to 16 rows (at 32-64 rows dequantising once and the bf16 kernel win on
// some shapes); uint4 strips at every row count, where two 8-bit multiply-adds per pair-row beat
// expanding the codes at 1 to 256 tokens on every family's shape (benchmarks/bench_expert_kernels.py).
constexpr int64_t kAllRows = int64_t{1} << 40;
const moelight::ExpertIsa kIsa{dequant, gemm, act, qgemm, 2, iqgemm, 16, kAllRows, nullptr, nullptr, 1};

}  // namespace
#pragma GCC pop_options

const moelight::ExpertIsa* moelight::avx2_expert_isa() { return &kIsa; }
#else
const moelight::ExpertIsa* moelight::avx2_expert_isa() { return nullptr; }
#endif
