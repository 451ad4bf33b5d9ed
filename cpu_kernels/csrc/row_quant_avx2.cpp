// RowQuant's int8 quantize (row_quant.h) on AVX2: a block's 32 bf16 in four vectors of 8 instead of the
// scalar loop (~2 ns an element on the AVX2 host; a T = 256 int4 layer quantizes 512 x 3584 intermediate
// values between its gate/up and its down). The operations of the scalar loop in the same order per element,
// as row_quant_avx512.cpp does, so codes, scales and sums equal the scalar ones bit for bit.
#include <cstdint>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"

namespace moelight {
namespace {

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace

// No FMA contraction: v * inv is rounded before the 1.5 * 2^23 is added, as in the scalar loop.
__attribute__((optimize("fp-contract=off"))) void quantize_row32_avx2(const uint16_t* a, int64_t k, int8_t* q,
                                                                     float* scale, int32_t* sum) {
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // packs_epi32 then packs_epi16 leave the 4-byte groups as v0 v1 v2 v3 (low lanes) then v0 v1 v2 v3
  // (high lanes); this puts them back in k order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / 32; ++b) {
    __m256 v[4];
    // max_ps(x, m) returns m where x is NaN: NaNs are skipped, as std::max(amax, NaN) keeps amax
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = VecAvx2::load(a + b * 32 + 8 * i, true);
      m = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), m);
    }
    const float amax = VecAvx2::hmax(m);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], vi), big), big);
      c[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvttps_epi32(r)));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), _mm256_permutevar8x32_epi32(bytes, order));
    scale[b] = amax / 127.0f;
    sum[b] = hsum8(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
  }
}

}  // namespace moelight

#pragma GCC pop_options
#else
namespace moelight {
void quantize_row32_avx2(const uint16_t*, int64_t, int8_t*, float*, int32_t*) {}
}  // namespace moelight
#endif
