// AVX-512 vector ops plus the AVX512-BF16 dot product (Zen 4+, Cooper Lake, Sapphire Rapids+).
// Include only from a TU compiled for avx512f + avx512bf16.
#pragma once
#include "simd_avx512.h"

namespace {

// Vector casts by value: reinterpret_cast through a reference made GCC keep the operand (and the
// accumulators beside it) in memory, a store per dot product.
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512bh as_bh(__m512 v) { return (__m512bh)v; }
inline __m256i as_si(__m256bh v) { return (__m256i)v; }
inline __m512i as_si(__m512bh v) { return (__m512i)v; }

struct VecAvx512Bf16 : VecAvx512 {
  static constexpr bool kBf16Dot = true;
  // 32 raw bf16 values (as the bit pattern of a float vector).
  static R load_raw(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  // acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1], a and b holding 32 bf16 each.
  static R dot_bf16(R acc, R a, R b) {
    return _mm512_dpbf16_ps(acc, as_bh(a), as_bh(b));
  }
  // x rounded to bf16 (nearest even) and widened back: the P.V dot products use P in bf16.
  static R round_bf16(R x) {
    const __m256bh h = _mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(as_si(h)), 16));
  }
  // 16 floats (already bf16 values) -> 8 bf16 pairs (p[2j] in the low half of pairs[j]).
  static void pack_pairs(const float* p, uint32_t* pairs) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(p));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs), as_si(h));
  }
  static R set1_pair(uint32_t pair) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair))); }
  // Two rows of 32 bf16 -> (row0[c], row1[c]) pairs for dot_bf16: `lo` pairs the first four
  // columns of each 8-column group, `hi` the last four (the "dot order", see undo_dot_order).
  static void pair_rows(R row0, R row1, R& lo, R& hi) {
    const __m512i a = _mm512_castps_si512(row0), b = _mm512_castps_si512(row1);
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a, b));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a, b));
  }
  // Dot order (lo, hi of pair_rows) -> natural columns [0, 16) and [16, 32).
  static void undo_dot_order(R lo, R hi, R& n0, R& n1) {
    const __m512i i0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i i1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    n0 = _mm512_permutex2var_ps(lo, i0, hi);
    n1 = _mm512_permutex2var_ps(lo, i1, hi);
  }
  // 16 floats -> bf16 hi + bf16 lo with hi + lo ~= x (round to nearest even both times).
  // Returns whether any lo is non-zero (q was not already bf16).
  static bool split_bf16(const float* x, uint16_t* hi, uint16_t* lo) {
    const R v = _mm512_loadu_ps(x);
    const __m256i h = as_si(_mm512_cvtneps_pbh(v));
    const R hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256bh lb = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hv));
    const __m256i l = as_si(lb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
    return !_mm256_testz_si256(l, l);
  }
};

}  // namespace
