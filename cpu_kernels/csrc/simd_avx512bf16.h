// AVX-512 vector ops plus the AVX512-BF16 dot product (Zen 4+, Cooper Lake, Sapphire Rapids+).
// Include only from a TU compiled for avx512f + avx512bf16.
#pragma once
#include "simd_avx512.h"

namespace {

struct VecAvx512Bf16 : VecAvx512 {
  static constexpr bool kBf16Dot = true;
  // 32 raw bf16 values (as the bit pattern of a float vector).
  static R load_raw(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  // acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1], a and b holding 32 bf16 each.
  static R dot_bf16(R acc, R a, R b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
  }
  // 16 floats -> bf16 hi + bf16 lo with hi + lo ~= x (round to nearest even both times).
  // Returns whether any lo is non-zero (q was not already bf16).
  static bool split_bf16(const float* x, uint16_t* hi, uint16_t* lo) {
    const R v = _mm512_loadu_ps(x);
    const __m256i h = reinterpret_cast<const __m256i&>(static_cast<const __m256bh&>(_mm512_cvtneps_pbh(v)));
    const R hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256bh lb = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hv));
    const __m256i l = reinterpret_cast<const __m256i&>(lb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
    return !_mm256_testz_si256(l, l);
  }
};

}  // namespace
