// RowQuant's int8 quantize (row_quant.h) on AVX-512: 32 bf16 a block in two vectors instead of the
// scalar loop (~12 us for a 3584-wide intermediate row on the AMX host, paid between an expert's gate/up
// and its down). The same operations in the same order per element (|v| max, v * (127 / amax), round by
// adding and subtracting 1.5 * 2^23, truncate, clamp), so the codes, scales and sums equal the scalar ones
// bit for bit; the max ignores NaN as the scalar std::max does (its NaN operand is the first).
#include <cstdint>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#include <immintrin.h>

namespace moelight {

// No FMA contraction: v * inv is rounded before the 1.5 * 2^23 is added, as in the scalar loop.
__attribute__((optimize("fp-contract=off"))) void quantize_row32_avx512(const uint16_t* a, int64_t k, int8_t* q,
                                                                       float* scale, int32_t* sum) {
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512i h = _mm512_loadu_si512(a + b * 32);
    const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 v1 =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), magnitude));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), magnitude));
    // max_ps(x, m) returns m where x is NaN: NaNs are skipped, as std::max(amax, NaN) keeps amax
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps())));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512 r0 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v0, vi), big), big);
    const __m512 r1 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v1, vi), big), big);
    const __m512i q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvttps_epi32(r0)));
    const __m512i q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvttps_epi32(r1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
    scale[b] = amax / 127.0f;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

}  // namespace moelight

#pragma GCC pop_options
#else
namespace moelight {
void quantize_row32_avx512(const uint16_t*, int64_t, int8_t*, float*, int32_t*) {}
}  // namespace moelight
#endif
