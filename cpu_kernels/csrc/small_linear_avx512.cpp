// AVX-512 rows of a bf16 linear layer for a few input rows (batch-1..4 decode), as
// small_linear_avx2.cpp but 16 weights a vector and the weight stream read ahead by software
// prefetch: on an AMX host the AVX2 loop read the LM head at ~7 GB/s a core, a third of what a
// sequential read of one core reaches there, because its uops per line left too few loads in flight.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#include <immintrin.h>

namespace {

constexpr int64_t kAhead = 1024;  // weights (2 KB) the prefetch runs ahead of the loads

// 16 bf16 -> 16 float32 (exact).
inline __m512 widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [n0, n1) of the output for M input rows; U accumulators per input row (16 U k per step).
template <int M, int U>
void rows(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out, int64_t ldo) {
  const int64_t step = 16 * U, body = k / step * step;
  const uint16_t* end = w + n1 * k;  // prefetch no further than this thread's rows
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * k;
    __m512 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += step) {
      for (int64_t p = 0; p < step; p += 32)  // a line of 32 weights
        if (wr + i + p + kAhead < end) _mm_prefetch(reinterpret_cast<const char*>(wr + i + p + kAhead), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m512 wv = widen(wr + i + 16 * u);
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * k + i + 16 * u), acc[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512 s = acc[m][0];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
      float t = _mm512_reduce_add_ps(s);
      for (int64_t i = body; i < k; ++i) t += bf16_value(wr[i]) * x[m * k + i];
      out[m * ldo + n] = t;
    }
  }
}

// One input row: output rows two at a time, two weight streams in flight with the prefetch 4 KB ahead of
// each. At Mixtral's widths (rows of 8 KB) `rows<1, U>`'s single stream read ~26 GB/s in a harness
// where a plain read of the same weights reached ~30; the pair reads at the plain read's rate. Each output
// row sums its products in the same order as `rows<1, U>` (same accumulators, same tail), so the values
// are the same bit for bit.
template <int U>
void row_pairs(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t kPairAhead = 2048;
  const int64_t step = 16 * U, body = k / step * step;
  const uint16_t* end = w + n1 * k;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint16_t* w0 = w + n * k;
    const uint16_t* w1 = w0 + k;
    __m512 a0[U], a1[U];
    for (int u = 0; u < U; ++u) a0[u] = a1[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += step) {
      for (int64_t p = 0; p < step; p += 32) {
        if (w0 + i + p + kPairAhead < end) _mm_prefetch(reinterpret_cast<const char*>(w0 + i + p + kPairAhead), _MM_HINT_T0);
        if (w1 + i + p + kPairAhead < end) _mm_prefetch(reinterpret_cast<const char*>(w1 + i + p + kPairAhead), _MM_HINT_T0);
      }
      for (int u = 0; u < U; ++u) {
        const __m512 xv = _mm512_loadu_ps(x + i + 16 * u);
        a0[u] = _mm512_fmadd_ps(widen(w0 + i + 16 * u), xv, a0[u]);
        a1[u] = _mm512_fmadd_ps(widen(w1 + i + 16 * u), xv, a1[u]);
      }
    }
    __m512 s0 = a0[0], s1 = a1[0];
    for (int u = 1; u < U; ++u) {
      s0 = _mm512_add_ps(s0, a0[u]);
      s1 = _mm512_add_ps(s1, a1[u]);
    }
    float t0 = _mm512_reduce_add_ps(s0), t1 = _mm512_reduce_add_ps(s1);
    for (int64_t i = body; i < k; ++i) t0 += bf16_value(w0[i]) * x[i];
    for (int64_t i = body; i < k; ++i) t1 += bf16_value(w1[i]) * x[i];
    out[n] = t0;
    out[n + 1] = t1;
  }
  if (n < n1) rows<1, U>(x, w, n, n1, k, out, ldo);
}

}  // namespace

void moelight::small_linear_rows_avx512(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1,
                                        int64_t k, float* out, int64_t ldo) {
  switch (m) {
    case 1: return row_pairs<4>(x, w, n0, n1, k, out, ldo);
    case 2: return rows<2, 4>(x, w, n0, n1, k, out, ldo);
    case 3: return rows<3, 2>(x, w, n0, n1, k, out, ldo);
    default: return rows<4, 2>(x, w, n0, n1, k, out, ldo);
  }
}
#pragma GCC pop_options
#else
void moelight::small_linear_rows_avx512(const float*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*,
                                        int64_t) {}
#endif
