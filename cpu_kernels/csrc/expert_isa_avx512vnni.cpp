// AVX512-VNNI int8 / uint4 expert strips times int8 activations (the ExpertIsa's iqgemm on AVX-512
// CPUs). vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each 4 into an int32:
// 4 consecutive k of one column per lane, so two pair-rows (k = 2p .. 2p + 3) are interleaved per
// column first. Integer sums per block of 32 k are exact, and the float32 steps after them are
// AVX2's in the same order, so both ISAs give the same outputs bit for bit.
// Reached only after the CPU check in with_vnni_products().
#include <cstdint>
#include <cstring>

#include "experts.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
#include <immintrin.h>

#include "code_prefetch.h"

namespace {

using moelight::QuantRows;
using moelight::Strip;
using moelight::WFormat;

// The int8 path's column order: unpacking two pair-rows by 16-bit words within 128-bit lanes puts
// columns 8j .. 8j + 3 of lane j in the low vector and 8j + 4 .. 8j + 7 in the high one. Column c
// of the natural order (c < 16; c + 16: the same plus 8) picked out of (low, high) by permutex2var.
inline __m512i natural_columns() {
  return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}

// Row r's activations at k = 2p .. 2p + 3 times each column's 4 codes (lo: the columns of
// iacc[r][0], hi: of iacc[r][1]), added into the int32 sums.
template <int R>
inline void quad_products(const QuantRows& a, int64_t p, __m512i lo, __m512i hi, __m512i iacc[R][2]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    int32_t quad;
    std::memcpy(&quad, a.q + r * a.k + 2 * p, 4);
    const __m512i av = _mm512_set1_epi32(quad);
    iacc[r][0] = _mm512_dpbusd_epi32(iacc[r][0], lo, av);
    iacc[r][1] = _mm512_dpbusd_epi32(iacc[r][1], hi, av);
  }
}

// int8 codes made unsigned (c + 128: the sign bit flipped) for vpdpbusd; the block's sum then
// holds 128 x the activations' sum too, taken off with QuantRows::sum. At one or two rows the
// vpdpbusd chains (latency 5) would bound the loop: 64 B-steps alternate between two sets of sums,
// added at the block's end (int32 adds: the same sums).
template <int R>
inline void i8_block(const QuantRows& a, const uint8_t* codes, int64_t blk, __m512i iacc[R][2]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  constexpr bool kTwo = R <= 2;
  __m512i jacc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) jacc[r][0] = jacc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int64_t p = blk * 16; p < blk * 16 + 16; p += 2) {
    const __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(codes + p * 64), flip);
    const __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512(codes + (p + 1) * 64), flip);
    const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
    if (kTwo && (p & 2)) quad_products<R>(a, p, lo, hi, jacc);
    else quad_products<R>(a, p, lo, hi, iacc);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512i off = _mm512_set1_epi32(128 * a.sum[r * (a.k / 32) + blk]);
    const __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(iacc[r][0], jacc[r][0]), off);
    const __m512i hi = _mm512_sub_epi32(_mm512_add_epi32(iacc[r][1], jacc[r][1]), off);
    iacc[r][0] = _mm512_permutex2var_epi32(lo, natural_columns(), hi);
    iacc[r][1] = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(natural_columns(), _mm512_set1_epi32(8)), hi);
  }
}

// uint4 codes: two pair-rows are 64 contiguous bytes, columns 0..15 in the low nibbles and 16..31
// in the high ones; one word permutation of the raw bytes puts each column's two pairs side by side
// (natural order; it commutes with the per-word nibble masks), then lo / hi are the low / high
// nibbles. Sums in two sets at one or two rows, as i8_block.
template <int R>
inline void u4_block(const QuantRows& a, const uint8_t* codes, int64_t blk, __m512i iacc[R][2]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  constexpr bool kTwo = R <= 2;
  __m512i jacc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) jacc[r][0] = jacc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int64_t p = blk * 16; p < blk * 16 + 16; p += 2) {
    const __m512i x = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(codes + p * 32));
    const __m512i lo = _mm512_and_si512(x, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    if (kTwo && (p & 2)) quad_products<R>(a, p, lo, hi, jacc);
    else quad_products<R>(a, p, lo, hi, iacc);
  }
  if constexpr (kTwo) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      iacc[r][0] = _mm512_add_epi32(iacc[r][0], jacc[r][0]);
      iacc[r][1] = _mm512_add_epi32(iacc[r][1], jacc[r][1]);
    }
  }
}

// R rows of c = a x the strip (`ahead`: prefetching it, on the first pass over it). Per block: the
// int32 sums scaled by the block's activation scale into the group's float32 sums; per group: times
// the weight scales, plus bias x the activations' sum.
template <WFormat F, int R>
void iqgemm_rows(const QuantRows& a, const Strip& st, float* c, int64_t ldc, bool ahead) {
  const int64_t blocks_per_group = st.group / 32;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, _mm512_setzero_ps());
    _mm512_storeu_ps(c + r * ldc + 16, _mm512_setzero_ps());
  }
  for (int64_t g = 0; g < st.k / st.group; ++g) {
    __m512 gacc[R][2];
    float asum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      asum[r] = 0.0f;
      gacc[r][0] = gacc[r][1] = _mm512_setzero_ps();
    }
    if (ahead) prefetch_group_scales(st, g);
    for (int64_t blk = g * blocks_per_group; blk < (g + 1) * blocks_per_group; ++blk) {
      __m512i iacc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) iacc[r][0] = iacc[r][1] = _mm512_setzero_si512();
      if (ahead) prefetch_block_codes<F>(st.codes, blk);
      if constexpr (F == WFormat::I8) i8_block<R>(a, st.codes, blk, iacc);
      else u4_block<R>(a, st.codes, blk, iacc);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float sa = a.scale[r * (a.k / 32) + blk];
        asum[r] += sa * static_cast<float>(a.sum[r * (a.k / 32) + blk]);
        const __m512 sv = _mm512_set1_ps(sa);
#pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) gacc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][h]), sv, gacc[r][h]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {
      const __m512 s = _mm512_loadu_ps(st.scales + g * 32 + 16 * h);
      const __m512 b = st.bias ? _mm512_loadu_ps(st.bias + g * 32 + 16 * h) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* dst = c + r * ldc + 16 * h;
        const __m512 acc = _mm512_fmadd_ps(gacc[r][h], s, _mm512_loadu_ps(dst));
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(b, _mm512_set1_ps(asum[r]), acc));
      }
    }
  }
}

template <WFormat F>
void iqgemm_format(const QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  const auto rows = [&](int64_t r0) {
    return QuantRows{a.q + r0 * a.k, a.scale + r0 * (a.k / 32), a.sum + r0 * (a.k / 32), a.k};
  };
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) iqgemm_rows<F, 4>(rows(r), st, c + r * ldc, ldc, r == 0);
  switch (m - r) {
    case 3: return iqgemm_rows<F, 3>(rows(r), st, c + r * ldc, ldc, r == 0);
    case 2: return iqgemm_rows<F, 2>(rows(r), st, c + r * ldc, ldc, r == 0);
    case 1: return iqgemm_rows<F, 1>(rows(r), st, c + r * ldc, ldc, r == 0);
    default: return;
  }
}

void iqgemm(const QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  if (st.fmt == WFormat::I8) return iqgemm_format<WFormat::I8>(a, m, st, c, ldc);
  if (st.fmt == WFormat::U4) return iqgemm_format<WFormat::U4>(a, m, st, c, ldc);
}

}  // namespace
#pragma GCC pop_options

void moelight::with_vnni_products(ExpertIsa& t) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512vnni")) return;
  // one vpdpbusd does 64 products where vdpbf16ps does 32: faster than expanding the codes at 1 to
  // 256 tokens per layer call (benchmarks/bench_expert_kernels.py)
  t.iqgemm = iqgemm;
  t.iqgemm_rows_i8 = t.iqgemm_rows_u4 = int64_t{1} << 40;
  t.iqgemm_rows_fp4 = 0;  // no MXFP4 products here (AVX2's were not timed against AVX512-BF16's path)
}
#else
void moelight::with_vnni_products(ExpertIsa&) {}
#endif
