// Latent (MLA) scores with the query heads in the vector lanes, for latent_kernel.h. Every head reads
// the same rows, so with W heads (the vector width) in the lanes of one accumulator per key, a block
// of keys is scored with no horizontal sums: the head tiles of latent_tile_scores sum each partial
// vector across its lanes afterwards, which at MLA's 16+ heads costs about as much as the products.
// The queries are packed once per work item ([D][W] 32-bit columns, pack_heads_in_lanes), each key's
// element (or bf16 pair) is broadcast from its row, and a W x W transpose puts the scores back in
// rows. The loops also prefetch the next block (`next_lines` lines from `next`) into L2, a line per
// column step: spread over the products the lines arrive in time; one burst at the block's start
// left the cold rows' misses in the critical path.
// Include after `#pragma GCC target` in an ISA TU (after attend_blocks.h: kKeyBlock).
#pragma once
#include <cstdint>

namespace {

// q [H][N] 32-bit elements (float32 queries, or bf16 pairs), H a multiple of V::W ->
// qt [H / W][N][W]: column c of W heads in one vector.
template <class V, int N>
inline void pack_heads_in_lanes(float* qt, const float* q, int H) {
  using R = typename V::R;
  static_assert(N % V::W == 0, "whole W x W tiles");
  for (int g = 0; g < H / V::W; ++g) {
    for (int c0 = 0; c0 < N; c0 += V::W) {
      R r[V::W];
      for (int h = 0; h < V::W; ++h) r[h] = V::load(q + (g * V::W + h) * N + c0);
      V::transpose(r);
      for (int j = 0; j < V::W; ++j) V::store(qt + (g * N + c0 + j) * V::W, r[j]);
    }
  }
}

// Scores of 16 heads against one block of kKeyBlock bf16 keys, bf16 dot products over pairs: qt is
// [D / 2][16] pairs of the queries' high bf16 halves, qt_lo of the low halves (kLo: float32 queries).
// S[h * kKeyBlock + t] = scale * q_h . k_t.
template <class V, int D, bool kLo>
inline void heads_in_lanes_scores_bf16(float* S, const float* qt, const float* qt_lo, const uint16_t* kblk,
                                       float scale, const char* next, int next_lines) {
  using R = typename V::R;
  static_assert(V::W == 16 && kKeyBlock == 16, "16 heads in the lanes, 16 keys a block");
  R acc[kKeyBlock];
  for (int t = 0; t < kKeyBlock; ++t) acc[t] = V::zero();
  const uint32_t* k = reinterpret_cast<const uint32_t*>(kblk);
  for (int c = 0; c < D / 2; ++c) {
    if (c < next_lines) __builtin_prefetch(next + 64 * c, 0, 2);
    const R qv = V::load(qt + c * 16);
#pragma GCC unroll 16
    for (int t = 0; t < kKeyBlock; ++t) acc[t] = V::dot_bf16(acc[t], qv, V::set1_pair(k[t * (D / 2) + c]));
    if constexpr (kLo) {
      const R lv = V::load(qt_lo + c * 16);
#pragma GCC unroll 16
      for (int t = 0; t < kKeyBlock; ++t) acc[t] = V::dot_bf16(acc[t], lv, V::set1_pair(k[t * (D / 2) + c]));
    }
  }
  V::transpose(acc);  // acc[h] lane t
  const R sv = V::set1(scale);
  for (int h = 0; h < 16; ++h) V::store(S + h * kKeyBlock, V::mul(sv, acc[h]));
}

// Scores of W heads against one block of float32 keys (the block widened into L1, or a float32 cache's
// rows in place), float32 FMAs in passes of W keys (W accumulators: 8 on AVX2, 16 on AVX-512): qt is
// [D][W] of the scaled queries. S[h * kKeyBlock + t] = q_h . k_t.
template <class V, int D>
inline void heads_in_lanes_scores_f32(float* S, const float* qt, const float* kblk, const char* next,
                                      int next_lines) {
  using R = typename V::R;
  constexpr int KT = V::W;
  static_assert(kKeyBlock % KT == 0, "whole passes");
  for (int t0 = 0; t0 < kKeyBlock; t0 += KT) {
    R acc[KT];
    for (int t = 0; t < KT; ++t) acc[t] = V::zero();
    for (int c = 0; c < D; ++c) {
      if (t0 == 0 && c < next_lines) __builtin_prefetch(next + 64 * c, 0, 2);
      const R qv = V::load(qt + c * KT);
#pragma GCC unroll 16
      for (int t = 0; t < KT; ++t) acc[t] = V::fma(qv, V::set1(kblk[(t0 + t) * D + c]), acc[t]);
    }
    V::transpose(acc);  // acc[h] lane t
    for (int h = 0; h < KT; ++h) V::store(S + h * kKeyBlock + t0, acc[h]);
  }
}

}  // namespace
