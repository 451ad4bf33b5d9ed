// 16-lane float32 vector ops for AVX-512F. Include only from a TU compiled for avx512f.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace {

struct VecAvx512 {
  using R = __m512;
  static constexpr bool kBf16Dot = false;  // has dot_bf16 / load_raw
  static constexpr int W = 16;

  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const uint16_t* p, bool is_bf16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (is_bf16) {  // bf16 is the top half of a float32: widen and shift
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtph_ps(h);
  }
  // 2W bf16 -> float32 without shuffles: even elements (low halves shifted up) and odd
  // elements (high halves masked). Callers keep data in this even/odd order.
  static void load_bf16_pair(const uint16_t* p, R& even, R& odd) {
    __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  // float32 -> bf16 (round to nearest even, NaN -> 0x7FC0: as torch) or f16 (F16C, RNE).
  static void store_half(uint16_t* p, R x, bool is_bf16) {
    __m256i h;
    if (is_bf16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                            _mm512_set1_epi32(0x7FFF));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  // Inverse of load_bf16_pair's order: (even, odd) -> natural elements [0, W) and [W, 2W).
  static void interleave(R even, R odd, R& lo, R& hi) {
    const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    lo = _mm512_permutex2var_ps(even, il, odd);
    hi = _mm512_permutex2var_ps(even, ih, odd);
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static bool any_gt(R a, float b) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_GT_OQ) != 0; }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  // Lanes >= n replaced by `fill`.
  static R keep_first(R a, int n, float fill) {
    __mmask16 k = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), k, a);
  }

  // exp(x) for x <= 0-ish ranges used by softmax (Cephes-style, rel. error ~1e-7).
  static R exp(R x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    R n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    R y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);  // y * 2^n
  }

  // r[i] lane j -> r[j] lane i for a W x W (16 x 16) block of 32-bit values: 32-bit and 64-bit
  // interleaves within 128-bit lanes, then a 4 x 4 transpose of the 128-bit lanes (64 shuffles).
  static void transpose(R* r) {
    R t[16];
    for (int i = 0; i < 8; ++i) {  // lane k of t[2i] / t[2i+1]: (a0 b0 a1 b1) / (a2 b2 a3 b3)
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    R u[16];
    for (int i = 0; i < 4; ++i) {  // lane k of u[4i + j]: column 4k + j of rows 4i .. 4i + 3
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
      u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; ++j) {  // r[4k + j] = lane k of u[j], u[4 + j], u[8 + j], u[12 + j]
      const R v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
      const R v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
      const R v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
      r[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
      r[4 + j] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
      r[8 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
      r[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
  }

  // out[t] = sum of the lanes of a[t], t = 0..15: a transpose-and-add tree
  // (45 shuffles/adds instead of 16 separate horizontal reductions).
  static R transpose_sum(const R* a) {
    R s1[8];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    }
    R s2[4];
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial of each of 4 inputs
      __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
      s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    R s3[2];
    for (int i = 0; i < 2; ++i) {  // sum 128-bit lane pairs (0,1) and (2,3)
      s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                         _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
  }
};

}  // namespace
