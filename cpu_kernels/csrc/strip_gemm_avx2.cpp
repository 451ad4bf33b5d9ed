// strip_linear's GEMM at 3 rows and more on AVX2 + FMA (strip_linear.cpp): float32 activation rows times one
// bf16 strip (experts.h's pair layout). A k-block of 64 pair rows is widened once into 16 KB of float32 (in L1),
// then 5 rows x 16 columns at a time: the 4 weight vectors of a pair row stay in registers and each row
// broadcasts its two float32 activations, 20 FMAs to 14 loads, 10 accumulator chains (4 would leave the
// FMAs waiting on their latency). The expert GEMM's 3 rows x 32 columns take its
// weights as FMA memory operands, an FMA to a load, and reach ~75% of the FMA ceiling on Zen 3; this shape
// leaves the FMAs the only bound. Each sum is taken in k order (even then odd k of a pair), as the expert
// GEMM takes it. Reached only after the CPU check; no torch headers here (kernels.h).
#include <algorithm>
#include <cstdint>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace moelight {
namespace {

constexpr int64_t kPairs = 64;  // pair rows widened at once: 64 x 64 floats

// c[r][16h, 16h + 16) for R rows of a (stride lda) over pair rows [p0, p0 + n) of wf; `first`: from zero.
template <int R>
inline void rows_half(const float* a, int64_t lda, const float* wf, int64_t p0, int64_t n, int h, bool first,
                      float* c) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * 32 + 16 * h + 8 * j);
  for (int64_t p = 0; p < n; ++p) {
    const float* w = wf + p * 64 + 32 * h;
    const __m256 we0 = _mm256_load_ps(w), wo0 = _mm256_load_ps(w + 8);
    const __m256 we1 = _mm256_load_ps(w + 16), wo1 = _mm256_load_ps(w + 24);
    for (int r = 0; r < R; ++r) {
      const float* ar = a + r * lda + 2 * (p0 + p);
      const __m256 ae = _mm256_broadcast_ss(ar), ao = _mm256_broadcast_ss(ar + 1);
      acc[r][0] = _mm256_fmadd_ps(wo0, ao, _mm256_fmadd_ps(we0, ae, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(wo1, ao, _mm256_fmadd_ps(we1, ae, acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + r * 32 + 16 * h + 8 * j, acc[r][j]);
}

}  // namespace

void strip_out_avx2(const float* c, int64_t m, const float* bias, uint16_t* out, int64_t ldo) {
  for (int64_t r = 0; r < m; ++r)
    for (int q = 0; q < 4; ++q) {
      __m256 v = _mm256_loadu_ps(c + r * 32 + 8 * q);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * q));
      VecAvx2::store_half(out + r * ldo + 8 * q, v, true);
    }
}

void strip_gemm_avx2(const float* a, int64_t lda, int64_t m, const uint16_t* strip, int64_t k, float* c) {
  alignas(32) float wf[kPairs * 64];
  for (int64_t p0 = 0; p0 < k / 2; p0 += kPairs) {
    const int64_t n = std::min(kPairs, k / 2 - p0);
    widen_pair_rows(strip, p0, n, wf);
    const bool first = p0 == 0;
    for (int h = 0; h < 2; ++h) {
      int64_t r = 0;
      for (; r + 5 <= m; r += 5) rows_half<5>(a + r * lda, lda, wf, p0, n, h, first, c + r * 32);
      switch (m - r) {
        case 4: rows_half<4>(a + r * lda, lda, wf, p0, n, h, first, c + r * 32); break;
        case 3: rows_half<3>(a + r * lda, lda, wf, p0, n, h, first, c + r * 32); break;
        case 2: rows_half<2>(a + r * lda, lda, wf, p0, n, h, first, c + r * 32); break;
        case 1: rows_half<1>(a + r * lda, lda, wf, p0, n, h, first, c + r * 32); break;
        default: break;
      }
    }
  }
}

}  // namespace moelight

#pragma GCC pop_options
#endif
