// Latent (MLA) decode attention for one work item, templated on the vector ISA (V), the cache
// storage type (T), the row width DK (latent + RoPE key) and the latent width DV.
//
// Every query head reads the same rows, so the kernel walks the item's keys in blocks of 16 and,
// per block, serves all heads from the block while it sits in L1: (1) scores of every head: with
// heads in multiples of the vector width, W heads in the lanes (latent_lanes.h: bf16 dot products on
// a bf16 cache with AVX512-BF16, else float32 FMAs over the block widened into L1); other head counts
// in tiles of up to 4 heads, each K chunk loaded once per tile; (2) the online softmax of
// attend_kernel.h per head;
// (3) acc_h += p_h . V with V the first DV columns of the same rows (bf16 dot products over key
// pairs when the output is 16-bit). DRAM sees each row once per item, whatever the head count.
// Include after `#pragma GCC target` in an ISA TU.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attend_kernel.h"
#include "latent_lanes.h"
#include "latent_lanes_avx2.h"
#include "latent_kernels.h"

namespace {

// Scores of heads [r0, r0 + NR) against one block of 16 keys: NR x NT accumulators, each a chain of
// D / (elements per instruction) products, so the products' latency overlaps (the GQA kernel's 4 x 1
// tile, enough for a few heads per KV head, left MLA's 16-128 heads latency-bound). kDot: bf16 dot
// products on bf16 q halves (qh, ql when kLo) and a bf16 block; else float32 FMAs on scaled q and a
// float32 block. S[r][t] = scale * q_r . k_t (kDot scales here; float32 q is already scaled).
template <class V, int D, int NR, bool kDot, bool kLo>
inline void latent_tile_scores(float* S, const void* q, const void* q_lo, int r0, const void* kblk, float scale) {
  using R = typename V::R;
  constexpr int NT = V::W == 16 ? 4 : 2;  // keys per tile: 16 (AVX-512) / 8 (AVX2) accumulators
  constexpr int E = kDot ? 2 * V::W : V::W;  // elements per instruction
  alignas(64) float part[NR][kKeyBlock][V::W];
  for (int t0 = 0; t0 < kKeyBlock; t0 += NT) {
    R x[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) x[r][t] = V::zero();
    for (int c = 0; c < D; c += E) {
      R k[NT];
      for (int t = 0; t < NT; ++t) {
        if constexpr (kDot) {
          k[t] = V::load_raw(static_cast<const uint16_t*>(kblk) + (t0 + t) * D + c);
        } else {
          k[t] = V::load(static_cast<const float*>(kblk) + (t0 + t) * D + c);
        }
      }
      for (int r = 0; r < NR; ++r) {
        const int64_t qoff = static_cast<int64_t>(r0 + r) * D + c;
        if constexpr (kDot) {
          const R qv = V::load_raw(static_cast<const uint16_t*>(q) + qoff);
          for (int t = 0; t < NT; ++t) x[r][t] = V::dot_bf16(x[r][t], qv, k[t]);
          if constexpr (kLo) {
            const R lo = V::load_raw(static_cast<const uint16_t*>(q_lo) + qoff);
            for (int t = 0; t < NT; ++t) x[r][t] = V::dot_bf16(x[r][t], lo, k[t]);
          }
        } else {
          const R qv = V::load(static_cast<const float*>(q) + qoff);
          for (int t = 0; t < NT; ++t) x[r][t] = V::fma(qv, k[t], x[r][t]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) V::store(part[r][t0 + t], x[r][t]);
  }
  const R sv = V::set1(kDot ? scale : 1.0f);
  for (int r = 0; r < NR; ++r) {
    for (int h = 0; h < kKeyBlock / V::W; ++h) {
      R p[V::W];
      for (int t = 0; t < V::W; ++t) p[t] = V::load(part[r][h * V::W + t]);
      V::store(S + (r0 + r) * kKeyBlock + h * V::W, V::mul(sv, V::transpose_sum(p)));
    }
  }
}

// Scores of all H heads against one block (rows contiguous, D elements apart), in head tiles of 4, 2, 1
// (AVX2, with half the registers: 2, 1).
template <class V, int D, bool kDot, bool kLo>
inline void latent_scores(float* S, const void* q, const void* q_lo, int H, const void* kblk, float scale) {
  constexpr int NR = V::W == 16 ? 4 : 2;
  int r = 0;
  for (; r + NR <= H; r += NR) latent_tile_scores<V, D, NR, kDot, kLo>(S, q, q_lo, r, kblk, scale);
  if (NR == 4 && H - r >= 2) {
    latent_tile_scores<V, D, 2, kDot, kLo>(S, q, q_lo, r, kblk, scale);
    r += 2;
  }
  if (H - r >= 1) latent_tile_scores<V, D, 1, kDot, kLo>(S, q, q_lo, r, kblk, scale);
}

template <class V, class T, int DK, int DV>
void latent_attend(const moelight::LatentArgs& a) {
  static_assert(kKeyBlock == moelight::kLatentBlockKeys, "LatentArgs::blocks are of kKeyBlock keys");
  if constexpr (V::W == 8 && !std::is_same<T, float>::value && DV % 16 == 0) {
    if (a.heads % 16 == 0) return latent_attend_lanes<V, T, DK, DV>(a);  // AVX2: latent_lanes_avx2.h
  }
  using R = typename V::R;
  constexpr bool kDot = V::kBf16Dot && std::is_same<T, Bf16>::value;
  const int H = a.heads;
  float* qs = a.scratch;              // H x DK: scaled float32 queries (or bf16 halves qh, ql)
  float* acc = qs + H * DK;           // H x DV
  float* P = acc + H * DV;            // H x kKeyBlock scores, then probabilities
  float* lv = P + H * kKeyBlock;      // H x V::W lane-wise softmax sums
  float* kf = lv + H * kKeyBlock;     // kKeyBlock x DK: a block widened to float32 (or a bf16 tail)
  float* m = kf + kKeyBlock * DK;     // H running maxima
  float* qt = m + H;                  // H x DK: queries with heads in lanes (bf16: hi pairs, then lo)
  uint16_t* qh = reinterpret_cast<uint16_t*>(qs);
  uint16_t* ql = qh + H * DK;
  bool has_lo = false;

  for (int r = 0; r < H; ++r) {
    if (kDot && a.q_dtype == moelight::KvDtype::BF16) {  // bf16 q is its own high half
      std::memcpy(qh + r * DK, static_cast<const uint16_t*>(a.q) + r * DK, DK * sizeof(uint16_t));
    } else {
      alignas(64) float src[DK];
      load_row<V, DK>(a.q, a.q_dtype, static_cast<int64_t>(r) * DK, src);
      if constexpr (kDot) {
        for (int c = 0; c < DK; c += V::W) has_lo |= V::split_bf16(src + c, qh + r * DK + c, ql + r * DK + c);
      } else {
        for (int c = 0; c < DK; ++c) qs[r * DK + c] = src[c] * a.scale;
      }
    }
    m[r] = -__builtin_inff();
    V::store(lv + r * V::W, V::zero());
    for (int c = 0; c < DV; c += V::W) V::store(acc + r * DV + c, V::zero());
  }

  // Heads in lanes: H a multiple of W; bf16 pairs only with 16 lanes (dot_bf16); not for a float32
  // cache, whose scores keep the tiles' shorter summation chains (its output has float32's rounding).
  constexpr bool kLanes =
      kDot ? V::W == 16 && DK % 32 == 0 : !std::is_same<T, float>::value && DK % V::W == 0;
  const bool lanes = kLanes && H % V::W == 0;
  if constexpr (kLanes) {
    if (lanes) {
      if constexpr (kDot) {
        pack_heads_in_lanes<V, DK / 2>(qt, reinterpret_cast<const float*>(qh), H);
        if (has_lo) pack_heads_in_lanes<V, DK / 2>(qt + H * DK / 2, reinterpret_cast<const float*>(ql), H);
      } else {
        pack_heads_in_lanes<V, DK>(qt, qs, H);
      }
    }
  }

  const T* rows = static_cast<const T*>(a.rows);
  for (int64_t kb = 0; kb < a.n_keys; kb += kKeyBlock) {
    const int nk = a.n_keys - kb < kKeyBlock ? static_cast<int>(a.n_keys - kb) : kKeyBlock;
    const T* blk = a.blocks != nullptr ? static_cast<const T*>(a.blocks[kb / kKeyBlock]) : rows + kb * DK;
    const int64_t after = a.n_keys - kb - kKeyBlock;  // keys after this block: prefetched by the lanes' loops
    const char* next = after <= 0 ? nullptr
                                  : static_cast<const char*>(a.blocks != nullptr ? a.blocks[kb / kKeyBlock + 1]
                                                                                 : blk + kKeyBlock * DK);
    const int next_lines =
        after <= 0 ? 0 : static_cast<int>((after < kKeyBlock ? after : kKeyBlock) * DK * sizeof(T) / 64);
    const float* vblk = kf;  // float32 V rows (stride DK) for the non-dot P.V
    // Phase 1: scores of every head.
    if constexpr (kDot) {
      const uint16_t* kraw = reinterpret_cast<const uint16_t*>(blk);
      if (nk < kKeyBlock) {  // the tail block, zero-padded, so the vector loops read only this item's rows
        std::memset(kf, 0, kKeyBlock * DK * sizeof(uint16_t));
        std::memcpy(kf, kraw, static_cast<size_t>(nk) * DK * sizeof(uint16_t));
        kraw = reinterpret_cast<const uint16_t*>(kf);
      }
      if (lanes) {
        if constexpr (kLanes) {  // lanes is false where kLanes is: not instantiated there
          for (int g = 0; g < H / 16; ++g) {
            const float* qg = qt + g * DK / 2 * 16;
            float* Sg = P + g * 16 * kKeyBlock;
            const int lines = g == 0 ? next_lines : 0;
            if (has_lo) {
              heads_in_lanes_scores_bf16<V, DK, true>(Sg, qg, qg + H * DK / 2, kraw, a.scale, next, lines);
            } else {
              heads_in_lanes_scores_bf16<V, DK, false>(Sg, qg, nullptr, kraw, a.scale, next, lines);
            }
          }
        }
      } else if (has_lo) {
        latent_scores<V, DK, true, true>(P, qh, ql, H, kraw, a.scale);
      } else {
        latent_scores<V, DK, true, false>(P, qh, ql, H, kraw, a.scale);
      }
      if (!a.bf16_p) load_block<V, T, DK, false>(kf, blk, DK, nk);  // float32 P.V wants float32 V
    } else {
      if (std::is_same<T, float>::value && nk == kKeyBlock) {
        vblk = reinterpret_cast<const float*>(blk);  // float32 full blocks are read in place
      } else {
        load_block<V, T, DK, false>(kf, blk, DK, nk);
      }
      if (lanes) {
        if constexpr (kLanes) {
          for (int g = 0; g < H / V::W; ++g)
            heads_in_lanes_scores_f32<V, DK>(P + g * V::W * kKeyBlock, qt + g * DK * V::W, vblk, next,
                                             g == 0 ? next_lines : 0);
        }
      } else {
        latent_scores<V, DK, false, false>(P, qs, nullptr, H, vblk, a.scale);
      }
    }
    // Phase 2: online softmax per head (softmax_block_row).
    for (int r = 0; r < H; ++r) {
      softmax_block_row<V, DV>(P + r * kKeyBlock, nk, m[r], lv + r * V::W, acc + r * DV, kDot && a.bf16_p);
    }
    // Phase 3: acc += P.V over the rows' first DV columns, in head groups of 8, 4, 2, 1.
    for_row_groups(H, [&](auto group, int r) {
      constexpr int NR = decltype(group)::value;
      if constexpr (kDot) {
        if (a.bf16_p) {
          return accumulate_pv_dot<V, DV, NR>(acc + r * DV, P + r * kKeyBlock,
                                              reinterpret_cast<const uint16_t*>(blk), DK, nk);
        }
      }
      accumulate_pv<V, DV, NR>(acc + r * DV, P + r * kKeyBlock, vblk, DK, nk);
    });
  }

  for (int r = 0; r < H; ++r) {
    const float l = V::hsum(V::load(lv + r * V::W));
    const float inv = a.m != nullptr ? 1.0f : (l > 0.0f ? 1.0f / l : 0.0f);
    if (a.m != nullptr) {
      a.m[r] = m[r];
      a.l[r] = l;
    }
    const float* src = acc + r * DV;
    const int64_t dst = static_cast<int64_t>(r) * DV;
    const R iv = V::set1(inv);
    if constexpr (kDot) {
      if (a.bf16_p) {  // undo the dot order of accumulate_pv_dot
        for (int c = 0; c < DV; c += 2 * V::W) {
          R n0, n1;
          V::undo_dot_order(V::mul(V::load(src + c), iv), V::mul(V::load(src + c + V::W), iv), n0, n1);
          store_out<V>(a.out, a.out_dtype, dst + c, n0);
          store_out<V>(a.out, a.out_dtype, dst + c + V::W, n1);
        }
        continue;
      }
    }
    for (int c = 0; c < DV; c += V::W) store_out<V>(a.out, a.out_dtype, dst + c, V::mul(V::load(src + c), iv));
  }
}

// (row width, latent width) pairs, as cpu_kernels/latent.py's LATENT_SHAPES lists them.
template <class V>
moelight::LatentFn select_latent(moelight::KvDtype dtype, int64_t dk, int64_t dv) {
#define MOELIGHT_LATENT_SHAPES(T)                                    \
  if (dk == 576 && dv == 512) return &latent_attend<V, T, 576, 512>; \
  if (dk == 96 && dv == 64) return &latent_attend<V, T, 96, 64>;     \
  return nullptr;
  switch (dtype) {
    case moelight::KvDtype::F32: MOELIGHT_LATENT_SHAPES(float)
    case moelight::KvDtype::BF16: MOELIGHT_LATENT_SHAPES(Bf16)
    case moelight::KvDtype::F16: MOELIGHT_LATENT_SHAPES(F16)
  }
#undef MOELIGHT_LATENT_SHAPES
  return nullptr;
}

}  // namespace
