// AVX2 + FMA rows of a bf16 linear layer for a few input rows (batch-1..4 decode): each weight row
// is read once, widened to float32 in registers and dotted with every input row; no float32 copy
// of the weight is read (it would move twice the bytes). Reached only after the CPU check.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace {

// 8 bf16 -> 8 float32 (exact).
inline __m256 widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [n0, n1) of the output for M input rows; U independent accumulators per input row (32 or
// 16 k per step) keep the FMA latency hidden at M = 1 without running out of registers at M = 4.
template <int M, int U>
void rows(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out, int64_t ldo) {
  const int64_t step = 8 * U, body = k / step * step;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * k;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += step) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = widen(wr + i + 8 * u);
        for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i + 8 * u), acc[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[m][0];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
      float t = hsum(s);
      for (int64_t i = body; i < k; ++i) t += bf16_value(wr[i]) * x[m * k + i];
      out[m * ldo + n] = t;
    }
  }
}

}  // namespace

void moelight::small_linear_rows_avx2(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k,
                                      float* out, int64_t ldo) {
  switch (m) {
    case 1: return rows<1, 4>(x, w, n0, n1, k, out, ldo);
    case 2: return rows<2, 4>(x, w, n0, n1, k, out, ldo);
    case 3: return rows<3, 2>(x, w, n0, n1, k, out, ldo);
    default: return rows<4, 2>(x, w, n0, n1, k, out, ldo);
  }
}
#pragma GCC pop_options
#else
void moelight::small_linear_rows_avx2(const float*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*,
                                      int64_t) {}
#endif
