// 8-lane float32 vector ops for AVX2 + FMA + F16C. Include only from a TU compiled for them.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace {

struct VecAvx2 {
  using R = __m256;
  static constexpr bool kBf16Dot = false;  // has dot_bf16 / load_raw
  static constexpr int W = 8;

  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const uint16_t* p, bool is_bf16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (is_bf16) {  // bf16 is the top half of a float32: widen and shift
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtph_ps(h);
  }
  // 2W bf16 -> float32 without shuffles: even elements and odd elements (see simd_avx512.h).
  static void load_bf16_pair(const uint16_t* p, R& even, R& odd) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  // float32 -> bf16 (round to nearest even, NaN -> 0x7FC0: as torch) or f16 (F16C, RNE).
  static void store_half(uint16_t* p, R x, bool is_bf16) {
    __m128i h;
    if (is_bf16) {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                            _mm256_set1_epi32(0x7FFF));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
      // values fit 16 bits: pack per 128-bit lane, then take qwords 0 and 2
      h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  // Inverse of load_bf16_pair's order: (even, odd) -> natural elements [0, W) and [W, 2W).
  static void interleave(R even, R odd, R& lo, R& hi) {
    const R a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);  // per 128-bit lane
    lo = _mm256_permute2f128_ps(a, b, 0x20);
    hi = _mm256_permute2f128_ps(a, b, 0x31);
  }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static bool any_gt(R a, float b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_GT_OQ)) != 0;
  }
  static float hmax(R a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static float hsum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static R keep_first(R a, int n, float fill) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 k = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), a, k);
  }

  static R exp(R x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    R n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    R y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n built in the exponent field; n is in [-126, 127] after the clamp above.
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }

  // r[i] lane j -> r[j] lane i for a W x W (8 x 8) block: 32-bit and 64-bit interleaves within
  // 128-bit halves, then the halves swapped across (24 shuffles).
  static void transpose(R* r) {
    R t[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    R u[8];
    for (int i = 0; i < 2; ++i) {  // half k of u[4i + j]: column 4k + j of rows 4i .. 4i + 3
      const __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 1]);
      const __m256d c = _mm256_castps_pd(t[4 * i + 2]), d = _mm256_castps_pd(t[4 * i + 3]);
      u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
      u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
      u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
      u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
      r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
  }

  // out[t] = sum of the lanes of a[t], t = 0..7 (transpose-and-add tree).
  static R transpose_sum(const R* a) {
    R s1[4];
    for (int i = 0; i < 4; ++i) {
      s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                            _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    }
    R s2[2];
    for (int i = 0; i < 2; ++i) {
      __m256d x = _mm256_castps_pd(s1[2 * i]), y = _mm256_castps_pd(s1[2 * i + 1]);
      s2[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                            _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20),
                         _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
  }
};

// Pair rows [p0, p0 + n) of a bf16 strip (experts.h's pair layout, 64 values a row) widened to float32: per
// block q of 8 columns the 8 even-k values, then the 8 odd-k ones (64 floats a pair row, 32-byte aligned `wf`).
// The k-blocks that the AVX2 expert GEMM and strip_linear's GEMM multiply from L1.
inline void widen_pair_rows(const uint16_t* b, int64_t p0, int64_t n, float* wf) {
  for (int64_t p = 0; p < n; ++p)
    for (int q = 0; q < 4; ++q) {
      __m256 we, wo;
      VecAvx2::load_bf16_pair(b + (p0 + p) * 64 + 16 * q, we, wo);
      _mm256_store_ps(wf + p * 64 + 16 * q, we);
      _mm256_store_ps(wf + p * 64 + 16 * q + 8, wo);
    }
}

}  // namespace
