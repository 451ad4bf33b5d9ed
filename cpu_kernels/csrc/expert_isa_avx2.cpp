// AVX2 + FMA pieces of the fused expert op (CPUs without AVX512-BF16): bf16 pairs widened to
// float32 by shifts (even k) and masks (odd k), FMAs over 2 rows x 32 columns, or at 3 rows and more
// over 3 rows on a k-block widened once into L1; dequantisation of the quantized formats to bf16
// values, in registers for an expert's 1-2 decode rows, else a k-block at a time into float32; int8 /
// uint4 / MXFP4 codes times int8 activations (expert_iq_avx2.h); the gate/up epilogue.
// Reached only after the CPU check.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "experts.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "expert_iq_avx2.h"

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

// gemm_rows over pair rows [p0, p0 + n) on widened weights, R rows at once (3: 12 accumulators, each a
// chain of two FMAs a pair row, 24 FMAs to hide their latency), c's partial sums carried between
// calls (`first`: from zero): the same sums in the same order as gemm_rows.
template <int R>
inline void fgemm_rows(const uint16_t* a, int64_t lda, const float* wf, int64_t p0, int64_t n, bool first, float* c,
                       int64_t ldc) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8 * q);
  for (int64_t p = 0; p < n; ++p) {
    const float* w = wf + p * 64;
    for (int r = 0; r < R; ++r) {
      __m256 ae[1], ao[1];
      pair_activations<1>(a + r * lda, lda, p0 + p, ae, ao);
      for (int q = 0; q < 4; ++q)
        acc[r][q] = _mm256_fmadd_ps(_mm256_load_ps(w + 16 * q + 8), ao[0],
                                    _mm256_fmadd_ps(_mm256_load_ps(w + 16 * q), ae[0], acc[r][q]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + r * ldc + 8 * q, acc[r][q]);
}

// Pair rows a gemm of many rows widens at once: 16 KB of float32, in L1 while every row block reads it.
constexpr int64_t kWidePairs = 64;

// c[0, m) = a[0, m) x a strip of depth k whose pair rows widen(p0, n, wf) puts in float32, a block
// of kWidePairs at a time, for 3 rows and more.
template <class Widen>
void wide_gemm(const uint16_t* a, int64_t lda, int64_t m, int64_t k, float* c, int64_t ldc, Widen widen) {
  alignas(32) float wf[kWidePairs * 64];
  for (int64_t p0 = 0; p0 < k / 2; p0 += kWidePairs) {
    const int64_t n = std::min<int64_t>(kWidePairs, k / 2 - p0);
    widen(p0, n, wf);
    int64_t r = 0;
    for (; r + 3 <= m; r += 3) fgemm_rows<3>(a + r * lda, lda, wf, p0, n, p0 == 0, c + r * ldc, ldc);
    if (m - r == 2) fgemm_rows<2>(a + r * lda, lda, wf, p0, n, p0 == 0, c + r * ldc, ldc);
    if (m - r == 1) fgemm_rows<1>(a + r * lda, lda, wf, p0, n, p0 == 0, c + r * ldc, ldc);
  }
}

// No read-ahead of the next strip: bf16 products on float32 FMAs are compute-bound at the rows where
// it would pay (not measured on an AVX2-only host).
void gemm(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t k, const uint8_t*, int64_t, float* c,
          int64_t ldc) {
  int64_t r = 0;
  if (m < 3) {  // decode rows: widened in registers, as many rows were before the k-blocks
    for (; r + 2 <= m; r += 2) gemm_rows<2>(a + r * lda, lda, b, k, c + r * ldc, ldc);
    if (r < m) gemm_rows<1>(a + r * lda, lda, b, k, c + r * ldc, ldc);  // an odd row (decode: often the only one)
    return;
  }
  wide_gemm(a, lda, m, k, c, ldc, [&](int64_t p0, int64_t n, float* wf) { widen_pair_rows(b, p0, n, wf); });
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

// Pair rows [p0, p0 + n) of a quantized strip dequantised as qgemm_rows does (the bf16 values dequant
// stores) into widen_pair_rows' float32 layout: no bf16 scratch to write and widen again.
template <WFormat F>
void dequant_pairs(const Strip& st, int64_t p0, int64_t n, float* wf) {
  constexpr int64_t kRowBytes = F == WFormat::U4 || F == WFormat::FP4 ? 32 : 64;
  const __m256 half = _mm256_set1_ps(F == WFormat::FP4 ? 0.5f : 1.0f);
  const int64_t rows_per_group = st.group / 2;
  __m256 s[4] = {}, b[4] = {};  // set at p0
  for (int64_t p = p0; p < p0 + n; ++p) {
    if (p == p0 || p % rows_per_group == 0) {
      const int64_t g = p / rows_per_group;
      for (int q = 0; q < 4; ++q) {
        s[q] = _mm256_mul_ps(_mm256_loadu_ps(st.scales + g * 32 + 8 * q), half);
        b[q] = st.bias ? _mm256_loadu_ps(st.bias + g * 32 + 8 * q) : _mm256_setzero_ps();
      }
    }
    const uint8_t* row = st.codes + p * kRowBytes;
    float* w = wf + (p - p0) * 64;
    for (int q = 0; q < 4; ++q) {
      const __m128i x = block_codes<F>(row, q);
      _mm256_store_ps(w + 16 * q, round_bf16(_mm256_fmadd_ps(code_values<F>(x), s[q], b[q])));
      _mm256_store_ps(w + 16 * q + 8, round_bf16(_mm256_fmadd_ps(code_values<F>(_mm_srli_si128(x, 8)), s[q], b[q])));
    }
  }
}

// qgemm: 1-2 rows dequantised in registers per row pair, more a k-block at a time into float32.
template <WFormat F>
void qgemm_format(const uint16_t* a, int64_t lda, int64_t m, const Strip& st, float* c, int64_t ldc) {
  if (m >= 3) return wide_gemm(a, lda, m, st.k, c, ldc, [&](int64_t p0, int64_t n, float* wf) {
    dequant_pairs<F>(st, p0, n, wf);
  });
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

// qgemm at every row count: 1-2 rows dequantise in registers, 3 and more a k-block at a time into
// float32 (no bf16 scratch to write and widen again: bench-1b's int8 strips at 64 rows ~1.15x).
// iqgemm: int8 strips up to 16 rows (at 32-64 rows dequantising once and the bf16 kernel win on
// some shapes); uint4 strips at every row count, where two 8-bit multiply-adds per pair-row beat
// expanding the codes at 1 to 256 tokens on every family's shape (benchmarks/bench_expert_kernels.py);
// MXFP4 strips alike, 3.7-4.0x the expanded codes' speed at 1-8 tokens on GPT-OSS's shapes and 1.7-2.0x
// at 64-256 (benchmarks/bench_mxfp4_experts.py, results/expert_mxfp4_avx2.md).
constexpr int64_t kAllRows = int64_t{1} << 40;
const moelight::ExpertIsa kIsa = [] {
  moelight::ExpertIsa t{dequant, gemm, act, qgemm, kAllRows, iqgemm, 16, kAllRows, nullptr, nullptr, 1};
  t.iqgemm_rows_fp4 = kAllRows;
  return t;
}();

}  // namespace
#pragma GCC pop_options

const moelight::ExpertIsa* moelight::avx2_expert_isa() { return &kIsa; }
#else
const moelight::ExpertIsa* moelight::avx2_expert_isa() { return nullptr; }
#endif
