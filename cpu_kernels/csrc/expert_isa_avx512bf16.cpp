// AVX512-BF16 pieces of the fused expert op: dequantisation of a strip to bf16 pairs, the strip
// GEMM on the bf16 dot product (vdpbf16ps, 8 rows x 32 columns in registers), the gate/up
// epilogue. Reached only after the CPU check in isa.cpp. The AMX unit reuses dequant and act.
#include <cstdint>
#include <cstring>

#include "experts.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include "simd_avx512.h"

namespace {

using moelight::Strip;
using moelight::WFormat;

// Per-element scale vectors of one group: element e of a 64-element row is column e / 2 (pairs).
struct GroupScales {
  __m512 s[4], b[4];
};

// 32 per-column values -> per-element vectors of a 64-element row (columns 0-7, 8-15, 16-23, 24-31).
inline void dup_columns(const float* p, __m512 out[4]) {
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_loadu_ps(p + 16 * h);
    out[2 * h] = _mm512_permutexvar_ps(dup_lo, v);
    out[2 * h + 1] = _mm512_permutexvar_ps(dup_hi, v);
  }
}

inline void load_group(const Strip& st, int64_t g, GroupScales& gs) {
  dup_columns(st.scales + g * 32, gs.s);
  if (st.bias != nullptr) {
    dup_columns(st.bias + g * 32, gs.b);
  } else {
    for (auto& v : gs.b) v = _mm512_setzero_ps();
  }
}

// 16 e4m3 bytes -> float32 (exact; the bit pattern moved into float32's fields, times 2^120).
inline __m512 fp8_to_f32(__m128i bytes) {
  const __m512i x = _mm512_cvtepu8_epi32(bytes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, mag)), _mm512_set1_ps(1.329227995784916e36f));
}

// Four vectors of 16 values (elements 0-15, 16-31, 32-47, 48-63) scaled, rounded, stored as a row.
inline void store_row(const __m512 v[4], const GroupScales& gs, uint16_t* out) {
  __m512 w[4];
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(v[i], gs.s[i], gs.b[i]);
  const __m512bh lo = _mm512_cvtne2ps_pbh(w[1], w[0]), hi = _mm512_cvtne2ps_pbh(w[3], w[2]);
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(lo));
  _mm512_storeu_si512(out + 32, reinterpret_cast<const __m512i&>(hi));
}

const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
const float kU4[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

void dequant(const Strip& st, uint16_t* out) {
  const int64_t rows = st.k / 2, rows_per_group = st.group / 2;
  const bool nibbles = st.fmt == WFormat::U4 || st.fmt == WFormat::FP4;
  const __m512 lut = _mm512_loadu_ps(st.fmt == WFormat::FP4 ? kE2M1 : kU4);
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  GroupScales gs;
  for (int64_t r = 0; r < rows; ++r) {
    if (r % rows_per_group == 0) load_group(st, r / rows_per_group, gs);
    __m512 v[4];
    if (nibbles) {
      const uint8_t* p = st.codes + r * 32;
      const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      v[0] = _mm512_permutexvar_ps(_mm512_and_si512(a, low4), lut);
      v[1] = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), lut);
      v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), lut);
      v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    } else {
      const uint8_t* p = st.codes + r * 64;
      for (int i = 0; i < 4; ++i) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
        v[i] = st.fmt == WFormat::I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) : fp8_to_f32(bytes);
      }
    }
    store_row(v, gs, out + r * 64);
  }
}

template <int R>
inline void gemm_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, float* c, int64_t ldc) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i b0 = _mm512_loadu_si512(b + p * 64), b1 = _mm512_loadu_si512(b + p * 64 + 32);
    _mm_prefetch(reinterpret_cast<const char*>(b + (p + 8) * 64), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, 4);
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<const __m512bh&>(av),
                                   reinterpret_cast<const __m512bh&>(b0));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<const __m512bh&>(av),
                                   reinterpret_cast<const __m512bh&>(b1));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

void gemm(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t k, float* c, int64_t ldc) {
  for (int64_t r = 0; r < m; r += 8) {  // m is a multiple of 8 (row_step)
    gemm_rows<8>(a + r * lda, lda, b, k, c + r * ldc, ldc);
  }
}

void act(const float* c, int64_t ldc, int64_t m, const float* bias, moelight::Act fn, uint16_t* out, int64_t ldo) {
  const __m512 bg = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bu = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(fn.limit), nlim = _mm512_set1_ps(-fn.limit);
  const __m512 nalpha = _mm512_set1_ps(fn.kind == 1 ? -fn.alpha : -1.0f);
  for (int64_t r = 0; r < m; ++r) {
    __m512 g = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc), bg);
    __m512 u = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc + 16), bu);
    if (fn.kind == 1) {
      g = _mm512_min_ps(g, lim);
      u = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(u, lim), nlim), one);
    }
    // g * sigmoid(a g) = g / (1 + exp(-a g))
    const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, VecAvx512::exp(_mm512_mul_ps(g, nalpha))));
    const __m512 y = _mm512_mul_ps(sig, u);
    const __m256bh h = _mm512_cvtneps_pbh(y);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), reinterpret_cast<const __m256i&>(h));
  }
}

const moelight::ExpertIsa kIsa{dequant, gemm, act, nullptr, 0, nullptr, 0, 0, nullptr, nullptr, 8};  // gemm_rows<8> blocks

}  // namespace
#pragma GCC pop_options

const moelight::ExpertIsa* moelight::avx512bf16_expert_isa() { return &kIsa; }
#else
const moelight::ExpertIsa* moelight::avx512bf16_expert_isa() { return nullptr; }
#endif
