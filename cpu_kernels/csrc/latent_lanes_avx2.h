// Latent (MLA) decode attention for 8-lane vectors (AVX2) over a 16-bit cache, heads a multiple of 16,
// for latent_kernel.h. The heads stay in the lanes from the scores to P.V, and a step takes up to 32
// keys (two blocks of 16), so:
// - scores: tiles of 16 heads (two vectors of scaled queries) x up to 6 keys (broadcast from the rows
//   widened into L1 a column chunk at a time), 12 accumulators per query load pair: 8 loads per 12 FMAs
//   instead of 9 per 8, every accumulator a single chain over the columns as before, and no key past
//   the item's end is scored (the 16-key tiles scored a tail block's padding);
// - softmax per vector of 8 heads ([key][head] layout): no transposes, no horizontal max;
// - P.V: tiles of up to 6 heads x 16 columns read from the 16-bit rows in place (no float32 copy of
//   the block, which with the queries overflowed L1), 12 accumulators, each loaded and stored once a
//   step of 32 keys (16 before).
// The widened chunk (32 keys x 64 columns) and the queries' chunk (64 columns x 16 heads) are 12 KiB,
// so the scores' loads hit L1. Include after `#pragma GCC target` in an AVX2 TU (after
// attend_kernel.h and latent_lanes.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace {

constexpr int kLanesStepKeys = 32;  // keys a step: two kernel blocks

// f(integral_constant<NT>, t0) over [0, nk) in passes of 6 keys, a remainder of 7 to 11 keys in two
// near-equal passes: a short pass loads the queries' chunk for few FMAs.
template <class F>
inline void for_key_passes(int nk, F&& f) {
  int t = 0;
  while (t < nk) {
    const int rem = nk - t;
    const int n = rem >= 12 || rem == 6 ? 6 : (rem > 6 ? (rem + 1) / 2 : rem);
    switch (n) {
      case 6: f(std::integral_constant<int, 6>{}, t); break;
      case 5: f(std::integral_constant<int, 5>{}, t); break;
      case 4: f(std::integral_constant<int, 4>{}, t); break;
      case 3: f(std::integral_constant<int, 3>{}, t); break;
      case 2: f(std::integral_constant<int, 2>{}, t); break;
      default: f(std::integral_constant<int, 1>{}, t); break;
    }
    t += n;
  }
}

// f(integral_constant<NR>, h0) over heads [0, H) in tiles of 6 and one of the rest.
template <class F>
inline void for_head_tiles(int H, F&& f) {
  int h = 0;
  for (; h + 6 <= H; h += 6) f(std::integral_constant<int, 6>{}, h);
  switch (H - h) {
    case 5: f(std::integral_constant<int, 5>{}, h); break;
    case 4: f(std::integral_constant<int, 4>{}, h); break;
    case 3: f(std::integral_constant<int, 3>{}, h); break;
    case 2: f(std::integral_constant<int, 2>{}, h); break;
    case 1: f(std::integral_constant<int, 1>{}, h); break;
    default: break;
  }
}

// S[t * H + 16 g .. + 16] += q_h . kc[t] over CW columns for keys [t0, t0 + NT), heads 16g .. 16g + 15:
// q0 / q1 point at the chunk's first column of the two 8-head vectors ([column][8]), kc is the chunk
// widened ([key][CW]).
template <class V, int CW, int NT>
inline void lanes_score_pass(float* S, int H, int g, int t0, const float* q0, const float* q1, const float* kc,
                             bool first) {
  using R = typename V::R;
  R a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) {
    a0[t] = first ? V::zero() : V::load(S + (t0 + t) * H + 16 * g);
    a1[t] = first ? V::zero() : V::load(S + (t0 + t) * H + 16 * g + 8);
  }
  for (int c = 0; c < CW; ++c) {
    const R x0 = V::load(q0 + c * 8), x1 = V::load(q1 + c * 8);
#pragma GCC unroll 6
    for (int t = 0; t < NT; ++t) {
      const R k = V::set1(kc[(t0 + t) * CW + c]);
      a0[t] = V::fma(x0, k, a0[t]);
      a1[t] = V::fma(x1, k, a1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    V::store(S + (t0 + t) * H + 16 * g, a0[t]);
    V::store(S + (t0 + t) * H + 16 * g + 8, a1[t]);
  }
}

// The next step's rows (or the next item's first bytes), prefetched into L2 spread over the chunks.
struct LanesPrefetch {
  const char* p[3] = {nullptr, nullptr, nullptr};
  int lines[3] = {0, 0, 0};
  int total = 0;
  void add(const void* at, int n) {
    if (n <= 0 || total >= 1024) return;  // 64 KiB: more than a step's 32 rows of 576
    for (int i = 0; i < 3; ++i) {
      if (p[i] == nullptr) {
        p[i] = static_cast<const char*>(at);
        lines[i] = n;
        total += n;
        return;
      }
    }
  }
  void lines_range(int from, int to) const {  // lines [from, to) of the concatenation
    int base = 0;
    for (int i = 0; i < 3 && p[i] != nullptr; ++i) {
      for (int l = from > base ? from - base : 0; l < lines[i] && base + l < to; ++l)
        __builtin_prefetch(p[i] + 64 * l, 0, 2);
      base += lines[i];
    }
  }
};

// Scores of every head against the step's nk rows (rp[t]): S[t * H + h] = q_h . row_t, q scaled.
template <class V, class T, int DK>
inline void lanes_scores(float* S, const float* qt, int H, const T* const* rp, int nk, float* kc,
                         const LanesPrefetch& pf) {
  constexpr int CW = DK % 64 == 0 ? 64 : 32;
  static_assert(DK % CW == 0, "whole column chunks");
  constexpr int NCH = DK / CW;
  for (int ch = 0; ch < NCH; ++ch) {
    const int c0 = ch * CW;
    pf.lines_range(pf.total * ch / NCH, pf.total * (ch + 1) / NCH);
    for (int t = 0; t < nk; ++t)
      for (int c = 0; c < CW; c += 8) V::store(kc + t * CW + c, KvLoad<T>::template load<V>(rp[t] + c0 + c));
    for (int g = 0; g < H / 16; ++g) {
      const float* q0 = qt + (2 * g) * DK * 8 + c0 * 8;
      const float* q1 = q0 + DK * 8;
      for_key_passes(nk, [&](auto n, int t0) {
        lanes_score_pass<V, CW, decltype(n)::value>(S, H, g, t0, q0, q1, kc, ch == 0);
      });
    }
  }
}

// Online softmax of the step, 8 heads a vector: S[t * H + h] -> p = exp(s - m_h); m, l per head.
// As softmax_block_row: m moves only when a score exceeds it by kRescaleSlack, and then scales the
// head's accumulator row and sum.
template <class V, int DV>
inline void lanes_softmax(float* S, int H, int nk, float* m, float* l, float* acc) {
  using R = typename V::R;
  for (int g = 0; g < H / 8; ++g) {
    R mx = V::load(S + 8 * g);
    for (int t = 1; t < nk; ++t) mx = V::max(mx, V::load(S + t * H + 8 * g));
    const R m_old = V::load(m + 8 * g);
    const __m256 grow = _mm256_cmp_ps(mx, V::add(m_old, V::set1(kRescaleSlack)), _CMP_GT_OQ);
    const int bits = _mm256_movemask_ps(grow);
    R mv = m_old;
    if (bits != 0) {
      mv = _mm256_blendv_ps(m_old, V::max(m_old, mx), grow);
      alignas(32) float sc[8], mo[8];
      V::store(sc, V::exp(V::sub(m_old, mv)));
      V::store(mo, m_old);
      V::store(m + 8 * g, mv);
      R lsum = V::load(l + 8 * g);
      V::store(l + 8 * g, _mm256_blendv_ps(lsum, V::mul(lsum, V::load(sc)), grow));
      for (int j = 0; j < 8; ++j) {
        if (!((bits >> j) & 1) || mo[j] == -__builtin_inff()) continue;  // first keys: acc is still zero
        float* row = acc + (8 * g + j) * DV;
        const R f = V::set1(sc[j]);
        for (int c = 0; c < DV; c += 8) V::store(row + c, V::mul(f, V::load(row + c)));
      }
    }
    R lsum = V::load(l + 8 * g);
    for (int t = 0; t < nk; ++t) {
      const R p = V::exp(V::sub(V::load(S + t * H + 8 * g), mv));
      V::store(S + t * H + 8 * g, p);
      lsum = V::add(lsum, p);
    }
    V::store(l + 8 * g, lsum);
  }
}

// 16 V elements of row v at column c as two float32 vectors: bf16 in even / odd order (load_bf16_pair),
// f16 in natural order.
template <class V, class T>
inline void lanes_v16(const T* v, typename V::R& x0, typename V::R& x1) {
  if constexpr (std::is_same<T, Bf16>::value) {
    V::load_bf16_pair(reinterpret_cast<const uint16_t*>(v), x0, x1);
  } else {
    x0 = KvLoad<T>::template load<V>(v);
    x1 = KvLoad<T>::template load<V>(v + 8);
  }
}

// acc[h] += sum_t P[t * H + h] . row_t[:DV] for every head, 16 columns at a time, heads in tiles of 6.
template <class V, class T, int DV>
inline void lanes_pv(float* acc, const float* P, int H, const T* const* rp, int nk) {
  using R = typename V::R;
  for (int c = 0; c < DV; c += 16) {
    for_head_tiles(H, [&](auto tile, int h0) {
      constexpr int NR = decltype(tile)::value;
      R a0[NR], a1[NR];
      for (int r = 0; r < NR; ++r) {
        a0[r] = V::load(acc + (h0 + r) * DV + c);
        a1[r] = V::load(acc + (h0 + r) * DV + c + 8);
      }
      for (int t = 0; t < nk; ++t) {
        R v0, v1;
        lanes_v16<V, T>(rp[t] + c, v0, v1);
        const float* pt = P + t * H + h0;
#pragma GCC unroll 6
        for (int r = 0; r < NR; ++r) {
          const R p = V::set1(pt[r]);
          a0[r] = V::fma(p, v0, a0[r]);
          a1[r] = V::fma(p, v1, a1[r]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        V::store(acc + (h0 + r) * DV + c, a0[r]);
        V::store(acc + (h0 + r) * DV + c + 8, a1[r]);
      }
    });
  }
}

// One work item (LatentArgs) with a.heads % 16 == 0 over a bf16 or f16 cache.
template <class V, class T, int DK, int DV>
void latent_attend_lanes(const moelight::LatentArgs& a) {
  static_assert(V::W == 8 && !std::is_same<T, float>::value && DV % 16 == 0, "AVX2, a 16-bit cache");
  using R = typename V::R;
  const int H = a.heads;
  float* qt = a.scratch;                 // [H / 8][DK][8] scaled queries, heads in the lanes
  float* acc = qt + H * DK;              // H x DV (bf16: each 16 columns in even / odd order)
  float* S = acc + H * DV;               // kLanesStepKeys x H scores, then probabilities
  float* m = S + kLanesStepKeys * H;     // H running maxima
  float* l = m + H;                      // H running sums
  float* kc = l + H;                     // kLanesStepKeys x 64: a column chunk widened
  float* qs = kc + kLanesStepKeys * 64;  // H x DK scaled queries, before packing
  for (int r = 0; r < H; ++r) {
    load_row<V, DK>(a.q, a.q_dtype, static_cast<int64_t>(r) * DK, qs + r * DK);
    for (int c = 0; c < DK; c += 8) V::store(qs + r * DK + c, V::mul(V::set1(a.scale), V::load(qs + r * DK + c)));
    m[r] = -__builtin_inff();
    l[r] = 0.0f;
    for (int c = 0; c < DV; c += 8) V::store(acc + r * DV + c, V::zero());
  }
  pack_heads_in_lanes<V, DK>(qt, qs, H);

  const T* rows = static_cast<const T*>(a.rows);
  auto block = [&](int64_t kb) -> const T* {  // first row of the block of 16 keys at key kb
    return a.blocks != nullptr ? static_cast<const T*>(a.blocks[kb / kKeyBlock]) : rows + kb * DK;
  };
  constexpr int kRowLines = static_cast<int>(DK * sizeof(T) / 64);
  const T* rp[kLanesStepKeys];
  for (int64_t kb = 0; kb < a.n_keys; kb += kLanesStepKeys) {
    const int nk = a.n_keys - kb < kLanesStepKeys ? static_cast<int>(a.n_keys - kb) : kLanesStepKeys;
    for (int t = 0; t < nk; t += kKeyBlock) {
      const T* b = block(kb + t);
      for (int i = 0; i < kKeyBlock && t + i < nk; ++i) rp[t + i] = b + i * DK;
    }
    LanesPrefetch pf;  // the next step's rows, else the next item's queries and first rows
    const int64_t after = a.n_keys - kb - nk;
    if (after > 0) {
      for (int64_t t = 0; t < after && t < kLanesStepKeys; t += kKeyBlock) {
        const int64_t n = after - t < kKeyBlock ? after - t : kKeyBlock;
        pf.add(block(kb + nk + t), static_cast<int>(n) * kRowLines);
      }
    } else {
      for (int i = 0; i < a.n_next; ++i)
        pf.add(a.next[i].p, static_cast<int>(std::min<int64_t>(a.next[i].bytes / 64, kLanesStepKeys * kRowLines)));
    }
    lanes_scores<V, T, DK>(S, qt, H, rp, nk, kc, pf);
    lanes_softmax<V, DV>(S, H, nk, m, l, acc);
    lanes_pv<V, T, DV>(acc, S, H, rp, nk);
  }

  for (int r = 0; r < H; ++r) {
    const float inv = a.m != nullptr ? 1.0f : (l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    if (a.m != nullptr) {
      a.m[r] = m[r];
      a.l[r] = l[r];
    }
    const float* src = acc + r * DV;
    const int64_t dst = static_cast<int64_t>(r) * DV;
    const R iv = V::set1(inv);
    for (int c = 0; c < DV; c += 16) {
      R x0 = V::mul(V::load(src + c), iv), x1 = V::mul(V::load(src + c + 8), iv);
      if constexpr (std::is_same<T, Bf16>::value) V::interleave(R(x0), R(x1), x0, x1);  // undo even / odd
      store_out<V>(a.out, a.out_dtype, dst + c, x0);
      store_out<V>(a.out, a.out_dtype, dst + c + 8, x1);
    }
  }
}

}  // namespace
