// AVX2's uint4 and MXFP4 strips on int8 activations at many rows per expert (expert_iq_avx2.h's
// iqgemm): a k-block of the strip's nibbles is unpacked once into L1 (MXFP4's as offset codes,
// fp4_offset_codes), in an order where one 32-bit broadcast of a row's 4 activations (a plain load on
// AVX2) meets 8 columns x 4 k per _mm256_maddubs_epi16, then tiles of R rows x 16 columns (two passes
// cover the strip's 32) multiply it. Per (row, column, block of 32 k) the int32 sum and every float32
// step after it are those of the few-row kernel (nibble_block, then iqgemm_rows' or, for MXFP4,
// fp4_iqgemm_rows'), so the outputs are the same bits.
// Include only from that AVX2 + FMA unit (an anonymous namespace).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "experts.h"

namespace {

using moelight::Strip;
using moelight::WFormat;

// MXFP4's e2m1 codes for _mm256_maddubs_epi16, whose weight operand is unsigned: twice the value
// (an integer in [-12, 12]) plus 12, in [0, 24]. A block's int32 sum then carries 12 x the sum of
// its activation codes, taken off in int32 (exact), and the group scale is halved (fp4_block_step).
// Summing n multiply-adds in an int16 lane reaches n x 2 x 24 x 127 = n x 6096: 4 at a time (24,384)
// before they are widened, where uint4's 15 allow 8.
constexpr int32_t kFp4Offset = 12;
inline __m256i fp4_offset_codes(__m256i nibbles) {
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  //
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  return _mm256_shuffle_epi8(lut, nibbles);
}

// A nibble format's codes as maddubs' unsigned bytes (nibbles: 0..15 in each byte).
template <WFormat F>
inline __m256i nibble_codes(__m256i nibbles) {
  if constexpr (F == WFormat::FP4) return fp4_offset_codes(nibbles);
  else return nibbles;
}

// Multiply-adds an int16 lane may sum before it is widened: 8 pair rows (uint4), 4 (MXFP4).
template <WFormat F>
constexpr int kInt16Run = F == WFormat::FP4 ? 4 : 8;

// MXFP4 (a scale per 32 k: a group per block, no bias) one block at a time: acc + its int32 sums less
// the offset times the activation block's code sum (block_sum), times its activation scale and the
// column's group scale halved, in one float32 step (the products of the halved scales are exact: a
// power of two times a float). The few-row kernel and the tiles take the same step: the same bits.
inline __m256 fp4_block_step(__m256i isum, int32_t block_sum, float a_scale, const float* scales, __m256 acc) {
  const __m256i w = _mm256_sub_epi32(isum, _mm256_set1_epi32(kFp4Offset * block_sum));
  const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scales), _mm256_set1_ps(0.5f * a_scale));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(w), s, acc);
}

// k per unpacked block (8 KB of codes: L1 while every row tile reads it), rows whose float partial
// sums one pass keeps in scratch (12 KB), and the register tile: 4 rows x 2 of the 4 column blocks
// (8 int16 accumulators, 2 weight vectors, a broadcast; 3 x 4, 2 x 4, 4 x 4 and 8 x 1 were no
// faster in a one-strip loop), the 2 halves of the columns one after the other.
constexpr int64_t kIq4KBlock = 256, kIq4Rows = 96;
constexpr int kIq4TileRows = 4, kIq4TileCols = 2;

// s + a b rounded once: the activation sums' step, spelled out so that it does not depend on whether
// the compiler contracts `s += a * b` (it did in iqgemm_rows, not always in iq4_tile's).
inline float fma_ss(float a, float b, float s) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(s)));
}

// Codes of k [k0, k0 + n) (n a multiple of 32) as bytes (nibble_codes): per 4 k (quad j) and column
// block q, 32 bytes at (4 j + q) 32 holding columns 8q .. 8q + 7, each as its 4 codes in k order.
template <WFormat F>
inline void unpack_quads(const uint8_t* codes, int64_t k0, int64_t n, uint8_t* wb) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t j = 0; j < n / 4; ++j) {
    const uint8_t* row = codes + (k0 / 2 + 2 * j) * 32;  // pair rows 2j (k 4j, 4j + 1) and 2j + 1
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
    for (int h = 0; h < 2; ++h) {  // low nibbles: columns 0..15, high: 16..31 (2 bytes a column)
      const __m256i c0 = nibble_codes<F>(_mm256_and_si256(h ? _mm256_srli_epi16(x0, 4) : x0, low));
      const __m256i c1 = nibble_codes<F>(_mm256_and_si256(h ? _mm256_srli_epi16(x1, 4) : x1, low));
      const __m256i a = _mm256_unpacklo_epi16(c0, c1), b = _mm256_unpackhi_epi16(c0, c1);  // 0-3 | 8-11, 4-7 | 12-15
      uint8_t* out = wb + (4 * j + 2 * h) * 32;
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
  }
}

// Quads [j0, j0 + n) of a block for 4 rows and 2 column blocks, in inline asm, 2 quads a loop:
// s[2 r + c] += the int16 multiply-adds of row r and column block c0 + c. GCC's own code for
// iq4_quads moved or spilled accumulators every quad (~20% slower in a one-strip loop). 8 int16
// accumulators; per quad 2 weight loads, 4 broadcasts, 8 multiply-adds and 8 adds.
inline void iq4_quads_4x2(const int8_t* q, int64_t lda, const uint8_t* wb, int c0, int j0, int n, __m256i s[8]) {
  __m256i s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3], s4 = s[4], s5 = s[5], s6 = s[6], s7 = s[7];
  const uint8_t* w = wb + c0 * 32 + j0 * 128;
  q += 4 * j0;
  const int8_t* q3 = q + 3 * lda;
  asm("1:\n\t"
      "vmovdqa 0(%[w]), %%ymm12\n\t"
      "vmovdqa 32(%[w]), %%ymm13\n\t"
      "vpbroadcastd (%[q]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s0], %[s0]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s1], %[s1]\n\t"
      "vpbroadcastd (%[q], %[lda]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s2], %[s2]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s3], %[s3]\n\t"
      "vpbroadcastd (%[q], %[lda], 2), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s4], %[s4]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s5], %[s5]\n\t"
      "vpbroadcastd (%[q3]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s6], %[s6]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s7], %[s7]\n\t"
      "vmovdqa 128(%[w]), %%ymm12\n\t"
      "vmovdqa 160(%[w]), %%ymm13\n\t"
      "vpbroadcastd 4(%[q]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s0], %[s0]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s1], %[s1]\n\t"
      "vpbroadcastd 4(%[q], %[lda]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s2], %[s2]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s3], %[s3]\n\t"
      "vpbroadcastd 4(%[q], %[lda], 2), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s4], %[s4]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s5], %[s5]\n\t"
      "vpbroadcastd 4(%[q3]), %%ymm14\n\t"
      "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s6], %[s6]\n\t"
      "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"
      "vpaddw %%ymm15, %[s7], %[s7]\n\t"
      "add $256, %[w]\n\t"
      "add $8, %[q]\n\t"
      "add $8, %[q3]\n\t"
      "cmp %[wend], %[w]\n\t"
      "jne 1b"
      : [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4), [s5] "+x"(s5), [s6] "+x"(s6),
        [s7] "+x"(s7), [w] "+r"(w), [q] "+r"(q), [q3] "+r"(q3)
      : [lda] "r"(lda), [wend] "r"(w + n * 128)
      : "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
  s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3, s[4] = s4, s[5] = s5, s[6] = s6, s[7] = s7;
}

// Quads [j0, j0 + n) for R rows and C column blocks: s[r][c] += their int16 multiply-adds.
template <int R, int C>
inline void iq4_quads(const int8_t* q, int64_t lda, const uint8_t* wb, int c0, int j0, int n, __m256i s[R][C]) {
#pragma GCC unroll 1  // a loop: unrolled, GCC computed every product first and spilled them
  for (int j = j0; j < j0 + n; ++j) {
    __m256i w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + (4 * j + c0 + c) * 32));
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, q + r * lda + 4 * j, 4);
      const __m256i ab = _mm256_set1_epi32(quad);
      for (int c = 0; c < C; ++c) s[r][c] = _mm256_add_epi16(s[r][c], _mm256_maddubs_epi16(w[c], ab));
    }
  }
}

// One block of 32 k for R rows and C column blocks from c0 (q: row 0's int8 activations at the
// block, rows lda apart; wb: the block's 8 quads): iacc[r][c] = the int32 sums of code x activation
// over columns 8 (c0 + c) .. + 7. Each int16 lane takes one pair of k a quad, kInt16Run<F> quads
// (uint4: 8 x 2 x 15 x 127 = 30,480 at most) before _mm256_madd_epi16 against ones adds a column's
// two lanes into int32, exactly.
template <WFormat F, int R, int C>
inline void iq4_tile_block(const int8_t* q, int64_t lda, const uint8_t* wb, int c0, __m256i iacc[R][C]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const auto run = [&](int j0, __m256i s[R][C]) {  // s = quads [j0, j0 + kInt16Run<F>) in int16
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_si256();
    if constexpr (R == 4 && C == 2) iq4_quads_4x2(q, lda, wb, c0, j0, kInt16Run<F>, &s[0][0]);
    else iq4_quads<R, C>(q, lda, wb, c0, j0, kInt16Run<F>, s);
  };
  __m256i s[R][C];
  run(0, s);  // the first run sets iacc (uint4's only one: no zeroed int32 sums kept across the asm)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) iacc[r][c] = _mm256_madd_epi16(s[r][c], ones);
  for (int j0 = kInt16Run<F>; j0 < 8; j0 += kInt16Run<F>) {
    run(j0, s);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) iacc[r][c] = _mm256_add_epi32(iacc[r][c], _mm256_madd_epi16(s[r][c], ones));
  }
}

// Rows [0, R) of a (their gacc / asum in scratch) over blocks [b0, b1) of the k-block unpacked in
// wb (block b0 at wb), C column blocks a pass: iqgemm_rows' float32 steps, a block at a time. gacc
// and asum hold the current group's sums; at a group's last block they are added into c. MXFP4:
// fp4_block_step into c, a block at a time.
template <WFormat F, int R, int C>
void iq4_tile(const moelight::QuantRows& a, const Strip& st, const uint8_t* wb, int64_t b0, int64_t b1, float* gacc,
              float* asum, float* c, int64_t ldc) {
  const int64_t bpg = st.group / 32, nb = a.k / 32;
  if constexpr (F == WFormat::FP4) {  // a group per block: each block's step straight into c
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int c0 = 0; c0 < 4; c0 += C) {
        __m256i iacc[R][C];
        iq4_tile_block<F, R, C>(a.q + blk * 32, a.k, wb + (blk - b0) * 1024, c0, iacc);
        for (int r = 0; r < R; ++r)
          for (int cc = 0; cc < C; ++cc) {
            float* cp = c + r * ldc + 8 * (c0 + cc);
            _mm256_storeu_ps(cp, fp4_block_step(iacc[r][cc], a.sum[r * nb + blk], a.scale[r * nb + blk],
                                                st.scales + blk * 32 + 8 * (c0 + cc), _mm256_loadu_ps(cp)));
          }
      }
    return;
  }
  for (int64_t blk = b0; blk < b1; ++blk) {
    const bool first = blk % bpg == 0, last = blk % bpg == bpg - 1;
    const int64_t grp = blk / bpg;
    for (int r = 0; r < R; ++r)
      asum[r] = fma_ss(a.scale[r * nb + blk], static_cast<float>(a.sum[r * nb + blk]), first ? 0.0f : asum[r]);
    for (int c0 = 0; c0 < 4; c0 += C) {
      __m256i iacc[R][C];
      iq4_tile_block<F, R, C>(a.q + blk * 32, a.k, wb + (blk - b0) * 1024, c0, iacc);
      for (int r = 0; r < R; ++r) {
        const __m256 sv = _mm256_set1_ps(a.scale[r * nb + blk]);
        for (int cc = 0; cc < C; ++cc) {
          const int q = c0 + cc;
          const __m256 g0 = first ? _mm256_setzero_ps() : _mm256_load_ps(gacc + r * 32 + 8 * q);
          const __m256 g = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][cc]), sv, g0);
          if (!last) {
            _mm256_store_ps(gacc + r * 32 + 8 * q, g);
            continue;
          }
          const __m256 s = _mm256_loadu_ps(st.scales + grp * 32 + 8 * q);
          const __m256 b = st.bias ? _mm256_loadu_ps(st.bias + grp * 32 + 8 * q) : _mm256_setzero_ps();
          float* cp = c + r * ldc + 8 * q;
          _mm256_storeu_ps(cp, _mm256_fmadd_ps(b, _mm256_set1_ps(asum[r]), _mm256_fmadd_ps(g, s, _mm256_loadu_ps(cp))));
        }
      }
    }
  }
}

// c[0, m) = a x a uint4 or MXFP4 strip, kIq4Rows rows at a time, each pass over the strip's k-blocks.
template <WFormat F>
void iq4_many_rows(const moelight::QuantRows& a, int64_t m, const Strip& st, float* c, int64_t ldc) {
  alignas(32) uint8_t wb[kIq4KBlock * 32];
  alignas(32) float gacc[kIq4Rows * 32];
  float asum[kIq4Rows];
  const auto rows = [&](int64_t r0) {
    return moelight::QuantRows{a.q + r0 * a.k, a.scale + r0 * (a.k / 32), a.sum + r0 * (a.k / 32), a.k};
  };
  for (int64_t r = 0; r < m; ++r) std::memset(c + r * ldc, 0, 32 * sizeof(float));
  for (int64_t m0 = 0; m0 < m; m0 += kIq4Rows) {
    const int64_t mn = std::min(kIq4Rows, m - m0);
    for (int64_t k0 = 0; k0 < st.k; k0 += kIq4KBlock) {
      const int64_t n = std::min(kIq4KBlock, st.k - k0), b0 = k0 / 32, b1 = (k0 + n) / 32;
      unpack_quads<F>(st.codes, k0, n, wb);
      const auto tile = [&](int64_t r, auto rows_c) {
        constexpr int R = decltype(rows_c)::value / 8, C = decltype(rows_c)::value % 8;
        iq4_tile<F, R, C>(rows(m0 + r), st, wb, b0, b1, gacc + r * 32, asum + r, c + (m0 + r) * ldc, ldc);
      };
      int64_t r = 0;
      for (; r + kIq4TileRows <= mn; r += kIq4TileRows)
        tile(r, std::integral_constant<int, kIq4TileRows * 8 + kIq4TileCols>{});
      for (; r + 2 <= mn; r += 2) tile(r, std::integral_constant<int, 2 * 8 + kIq4TileCols>{});
      if (r < mn) tile(r, std::integral_constant<int, 1 * 8 + kIq4TileCols>{});
    }
  }
}

}  // namespace
