// Scores s[r][t] = q_r . k_t of a group of query rows against one key block (bf16 dot
// products on the stored bf16 cache, or float32 FMAs). Include after `#pragma GCC target`.
#pragma once
#include <cstdint>

#include "attend_blocks.h"

namespace {

// Scores of NR rows against one key block with bf16 dot-product instructions straight on
// the bf16 cache (no conversion). Each K chunk is loaded once for all NR rows, and the NR
// independent dot chains per key keep the FMA ports busy (one row at a time was bound by
// the dot -> transpose -> exp latency chain). q = qh + ql split into two
// bf16 parts (ql all zero when q was bf16: has_lo false), so the products keep ~16
// mantissa bits of q; the scale is applied to the float32 sums. S[r][t] = scaled score.
template <class V, int D, int NR, bool kLo>
inline void block_scores_bf16(float* S, const uint16_t* qh, const uint16_t* ql, const uint16_t* kblk,
                              int64_t kst, float scale, RowTouch vt = {}) {
  using R = typename V::R;
  constexpr int NP = D / (2 * V::W);  // 32 bf16 per instruction
  alignas(64) float part[NR][kKeyBlock][V::W];  // part[r][t] lanes sum to q_r . k_t
  R qv[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NP; ++c) qv[r][c] = V::load_raw(qh + r * D + c * 2 * V::W);
  for (int t = 0; t < kKeyBlock; ++t) {
    vt.row(t);
    const uint16_t* kt = kblk + t * kst;
    R x[NR];
    for (int r = 0; r < NR; ++r) x[r] = V::zero();
    for (int c = 0; c < NP; ++c) {
      const R kc = V::load_raw(kt + c * 2 * V::W);
      for (int r = 0; r < NR; ++r) x[r] = V::dot_bf16(x[r], qv[r][c], kc);
      if constexpr (kLo) {
        for (int r = 0; r < NR; ++r) x[r] = V::dot_bf16(x[r], V::load_raw(ql + r * D + c * 2 * V::W), kc);
      }
    }
    for (int r = 0; r < NR; ++r) V::store(part[r][t], x[r]);
  }
  const R sv = V::set1(scale);
  for (int r = 0; r < NR; ++r) {
    for (int h = 0; h < kKeyBlock / V::W; ++h) {
      R p[V::W];
      for (int t = 0; t < V::W; ++t) p[t] = V::load(part[r][h * V::W + t]);
      V::store(S + r * kKeyBlock + h * V::W, V::mul(sv, V::transpose_sum(p)));
    }
  }
}

// Float32 scores of NR rows against one block of float32 keys (the cache itself, or bf16 /
// f16 keys widened into L1): each K chunk loaded once for NR rows. q rows are already
// scaled (and permuted like the keys).
template <class V, int D, int NR>
inline void block_scores_f32(float* S, const float* q, const float* kblk, int64_t kst, RowTouch vt = {}) {
  using R = typename V::R;
  constexpr int NC = D / V::W;
  alignas(64) float part[NR][kKeyBlock][V::W];
  for (int t = 0; t < kKeyBlock; ++t) {
    vt.row(t);
    const float* kt = kblk + t * kst;
    R x[NR];
    for (int r = 0; r < NR; ++r) x[r] = V::zero();
    for (int c = 0; c < NC; ++c) {
      const R kc = V::load(kt + c * V::W);
      for (int r = 0; r < NR; ++r) x[r] = V::fma(V::load(q + r * D + c * V::W), kc, x[r]);
    }
    for (int r = 0; r < NR; ++r) V::store(part[r][t], x[r]);
  }
  for (int r = 0; r < NR; ++r) {
    for (int h = 0; h < kKeyBlock / V::W; ++h) {
      R p[V::W];
      for (int t = 0; t < V::W; ++t) p[t] = V::load(part[r][h * V::W + t]);
      V::store(S + r * kKeyBlock + h * V::W, V::transpose_sum(p));
    }
  }
}

// All nr rows' float32 scores for one block, two rows at a time: two q rows stay in
// registers and later pairs re-read K from L1. Four rows per K load was up to ~6% slower
// from DRAM (one thread): more work between the first pass's cache misses.
template <class V, int D>
inline void scores_f32(float* S, const float* q, int nr, const float* kblk, int64_t kst, RowTouch vt) {
  int r = 0;
  for (; r + 2 <= nr; r += 2, vt = {}) block_scores_f32<V, D, 2>(S + r * kKeyBlock, q + r * D, kblk, kst, vt);
  if (nr - r >= 1) block_scores_f32<V, D, 1>(S + r * kKeyBlock, q + r * D, kblk, kst, vt);
}

// All nr rows' scores for one block, in groups of 4, 2 and 1 rows.
template <class V, int D, bool kLo>
inline void scores_bf16(float* S, const uint16_t* qh, const uint16_t* ql, int nr, const uint16_t* kblk,
                        int64_t kst, float scale, RowTouch vt = {}) {
  int r = 0;
  for (; r + 4 <= nr; r += 4, vt = {})
    block_scores_bf16<V, D, 4, kLo>(S + r * kKeyBlock, qh + r * D, ql + r * D, kblk, kst, scale, vt);
  if (nr - r >= 2) {
    block_scores_bf16<V, D, 2, kLo>(S + r * kKeyBlock, qh + r * D, ql + r * D, kblk, kst, scale, vt);
    r += 2;
    vt = {};
  }
  if (nr - r >= 1)
    block_scores_bf16<V, D, 1, kLo>(S + r * kKeyBlock, qh + r * D, ql + r * D, kblk, kst, scale, vt);
}

}  // namespace
