// Flash-style attention over one tile of query rows against one KV head, templated on
// the vector ISA (V), the KV storage type (T) and the head dim (D).
//
// Used by both ops: decode (1 query x `group` heads, no mask: each K/V byte of the
// (sequence, KV head) block is read once for all heads of the group) and prefill
// (a block of queries x `group` heads, causal). Keys are processed in blocks of 16:
//   1. scores  s[r][t] = q_r . k_t for all rows first, 4 rows sharing each K load:
//      float32 K is read in place; bf16/f16 K is converted once into L1 scratch, or
//      (AVX512-BF16) used as stored by bf16 dot products. Doing one row's scores and
//      softmax at a time was latency-bound (dot -> transpose -> exp chains).
//   2. online softmax with lazy rescaling (running max m_r, lane-wise sums l_r)
//   3. acc_r += p[r][t] * v_t with NR rows x CG vectors of accumulators in registers;
//      with AVX512-BF16 on a bf16 cache and a bf16/f16 output, as bf16 dot products over
//      key pairs with P rounded to bf16 (error below the output's own rounding).
// bf16 data is otherwise widened in an even/odd element order (no shuffles); q and the
// output are permuted to match (kPerm). All accumulation is float32.
// Include after `#pragma GCC target` in an ISA TU.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attend_blocks.h"
#include "attend_scores.h"
#include "kernels.h"

namespace {

// D elements at element offset `off` of a float32 / bf16 / f16 q tensor, as float32.
template <class V, int D>
inline void load_row(const void* base, moelight::KvDtype dt, int64_t off, float* dst) {
  for (int c = 0; c < D; c += V::W) {
    V::store(dst + c, dt == moelight::KvDtype::F32
                          ? V::load(static_cast<const float*>(base) + off + c)
                          : V::load(static_cast<const uint16_t*>(base) + off + c, dt == moelight::KvDtype::BF16));
  }
}

// W output elements at element offset `off`, rounded to the output dtype.
template <class V>
inline void store_out(void* base, moelight::KvDtype dt, int64_t off, typename V::R x) {
  if (dt == moelight::KvDtype::F32) {
    V::store(static_cast<float*>(base) + off, x);
  } else {
    V::store_half(static_cast<uint16_t*>(base) + off, x, dt == moelight::KvDtype::BF16);
  }
}

template <class V, class T, int D>
void attend_rows(const moelight::AttnArgs& a, int r0, int nr) {
  using R = typename V::R;
  alignas(64) float qs[rows_per_pass<D>() * D];
  alignas(64) float acc[rows_per_pass<D>() * D];
  alignas(64) float P[rows_per_pass<D>() * kKeyBlock];
  alignas(64) float kf[kKeyBlock * D];
  // bf16 dot-product path (AVX512-BF16 on a bf16 cache): q split in two bf16 halves.
  constexpr bool kPerm = std::is_same<T, Bf16>::value && D % (2 * V::W) == 0;
  constexpr bool kDot = V::kBf16Dot && std::is_same<T, Bf16>::value && D % (2 * V::W) == 0;
  alignas(64) uint16_t qh[kDot ? rows_per_pass<D>() * D : 1], ql[kDot ? rows_per_pass<D>() * D : 1];
  alignas(64) uint16_t ktail[kDot ? kKeyBlock * D : 1];
  bool has_lo = false;
  alignas(64) float lv[rows_per_pass<D>() * V::W];  // per-row softmax denominators, lane-wise
  float m[rows_per_pass<D>()];
  int64_t limit[rows_per_pass<D>()];  // keys visible to each row

  const int g = a.group;
  int64_t kmax = 0;
  for (int r = 0; r < nr; ++r) {
    const int i = (r0 + r) / g, j = (r0 + r) % g;
    // Per-item setup is a measurable share of short items (ctx 128-512) from DRAM, so the
    // common cases skip the float32 staging row: float32 q scaled straight into qs, bf16 q
    // used as its own high half (its low half is zero).
    const int64_t qoff = i * a.q_stride_i + j * D;
    if (!kPerm && !kDot && a.q_dtype == moelight::KvDtype::F32) {
      const float* qf = static_cast<const float*>(a.q) + qoff;
      const R sc = V::set1(a.scale);
      for (int c = 0; c < D; c += V::W) V::store(qs + r * D + c, V::mul(V::load(qf + c), sc));
    } else if (kDot && a.q_dtype == moelight::KvDtype::BF16) {
      std::memcpy(qh + r * D, static_cast<const uint16_t*>(a.q) + qoff, D * sizeof(uint16_t));
    } else {
      alignas(64) float src[D];
      load_row<V, D>(a.q, a.q_dtype, qoff, src);
      if constexpr (!kDot) {  // the bf16 dot path scores with qh / ql below instead
        for (int c = 0; c < D; ++c) qs[r * D + (kPerm ? perm_index<V::W>(c) : c)] = src[c] * a.scale;
      }
      if constexpr (kDot) {
        for (int c = 0; c < D; c += V::W) has_lo |= V::split_bf16(src + c, qh + r * D + c, ql + r * D + c);
      }
    }
    limit[r] = a.causal_first < 0 ? a.n_keys : a.causal_first + i + 1;
    if (limit[r] > a.n_keys) limit[r] = a.n_keys;
    if (limit[r] > kmax) kmax = limit[r];
    m[r] = -__builtin_inff();
    V::store(lv + r * V::W, V::zero());
    for (int c = 0; c < D; c += V::W) V::store(acc + r * D + c, V::zero());  // D fixed: inlined, no memset call
  }

  const T* kbase = static_cast<const T*>(a.k);
  const T* vbase = static_cast<const T*>(a.v);
  const int64_t st = a.kv_stride_t;
  for (int64_t kb = 0; kb < kmax; kb += kKeyBlock) {
    const int nk = kmax - kb < kKeyBlock ? static_cast<int>(kmax - kb) : kKeyBlock;
    // Touch V while scoring, so K and V stream side by side instead of in alternating
    // bursts (measured: the one exception is the bf16-dot scores with float32 P).
    const RowTouch vt{(kDot && !a.bf16_p) ? nullptr : reinterpret_cast<const char*>(vbase + kb * st),
                      st * static_cast<int64_t>(sizeof(T)), D * static_cast<int>(sizeof(T)), nk};
    // float32 full blocks are read in place; other dtypes / the tail go through L1 scratch.
    const bool direct = sizeof(T) == sizeof(float) && nk == kKeyBlock;
    const float* kblk = reinterpret_cast<const float*>(kbase + kb * st);
    const int64_t kst = direct ? st : D;
    const uint16_t* kraw = reinterpret_cast<const uint16_t*>(kbase + kb * st);
    int64_t kraw_st = st;
    if constexpr (kDot) {  // K is used as stored; only a tail block is copied (zero-padded)
      if (nk < kKeyBlock) {
        std::memset(ktail, 0, sizeof(ktail));
        for (int t = 0; t < nk; ++t) std::memcpy(ktail + t * D, kraw + t * st, D * sizeof(uint16_t));
        kraw = ktail;
        kraw_st = D;
      }
    } else if (!direct) {
      load_block<V, T, D, kPerm>(kf, kbase + kb * st, st, nk);
      kblk = kf;
    }

    // Phase 1: raw scores of every row (independent work the core can overlap).
    if constexpr (kDot) {
      if (has_lo) {
        scores_bf16<V, D, true>(P, qh, ql, nr, kraw, kraw_st, a.scale, vt);
      } else {
        scores_bf16<V, D, false>(P, qh, ql, nr, kraw, kraw_st, a.scale, vt);
      }
    } else {
      scores_f32<V, D>(P, qs, nr, kblk, kst, vt);
    }
    // Phase 2: online softmax per row (softmax_block_row), scores in P replaced by probabilities.
    for (int r = 0; r < nr; ++r) {
      const int valid = limit[r] - kb >= kKeyBlock ? kKeyBlock : static_cast<int>(limit[r] - kb);
      float* pr = P + r * kKeyBlock;
      if (valid <= 0) {  // causal: this row sees none of the block
        for (int t = 0; t < kKeyBlock; ++t) pr[t] = 0.0f;
        continue;
      }
      softmax_block_row<V, D>(pr, valid, m[r], lv + r * V::W, acc + r * D, kDot && a.bf16_p);
    }

    // Phase 3: acc += P.V, in row groups of 8, 4, 2, 1.
    const uint16_t* vraw = reinterpret_cast<const uint16_t*>(vbase + kb * st);
    const float* vblk = reinterpret_cast<const float*>(vbase + kb * st);
    if (!kPerm && !direct) {
      load_block<V, T, D, kPerm>(kf, vbase + kb * st, st, nk);  // K no longer needed: reuse its buffer
      vblk = kf;
    }
    for_row_groups(nr, [&](auto rows, int r) {
      constexpr int NR = decltype(rows)::value;
      float* ar = acc + r * D;
      const float* pr = P + r * kKeyBlock;
      if constexpr (kDot) {
        if (a.bf16_p) return accumulate_pv_dot<V, D, NR>(ar, pr, vraw, st, nk);
      }
      if constexpr (kPerm) {
        accumulate_pv_bf16<V, D, NR>(ar, pr, vraw, st, nk);
      } else {
        accumulate_pv<V, D, NR>(ar, pr, vblk, kst, nk);
      }
    });
  }

  for (int r = 0; r < nr; ++r) {
    const int i = (r0 + r) / g, j = (r0 + r) % g;
    const int64_t dst = i * a.out_stride_i + j * D;
    const float l = V::hsum(V::load(lv + r * V::W));
    // split-K partial (a.m set): unnormalised, the caller merges; else normalised (no keys: zeros).
    const float inv = a.m != nullptr ? 1.0f : (l > 0.0f ? 1.0f / l : 0.0f);
    if (a.m != nullptr) {
      a.m[r0 + r] = m[r];
      a.l[r0 + r] = l;
    }
    const float* src = acc + r * D;
    const R iv = V::set1(inv);
    if constexpr (kDot) {
      if (a.bf16_p) {  // undo the dot order of accumulate_pv_dot
        for (int c = 0; c < D; c += 2 * V::W) {
          R n0, n1;
          V::undo_dot_order(V::mul(V::load(src + c), iv), V::mul(V::load(src + c + V::W), iv), n0, n1);
          store_out<V>(a.out, a.out_dtype, dst + c, n0);
          store_out<V>(a.out, a.out_dtype, dst + c + V::W, n1);
        }
        continue;
      }
    }
    if (kPerm) {  // undo the even/odd order
      for (int c = 0; c < D; c += 2 * V::W) {
        R lo, hi;
        V::interleave(V::mul(V::load(src + c), iv), V::mul(V::load(src + c + V::W), iv), lo, hi);
        store_out<V>(a.out, a.out_dtype, dst + c, lo);
        store_out<V>(a.out, a.out_dtype, dst + c + V::W, hi);
      }
    } else {
      for (int c = 0; c < D; c += V::W) store_out<V>(a.out, a.out_dtype, dst + c, V::mul(V::load(src + c), iv));
    }
  }
}

template <class V, class T, int D>
void attend(const moelight::AttnArgs& a) {
  const int rows = a.n_queries * a.group;
  for (int r0 = 0; r0 < rows; r0 += rows_per_pass<D>()) {
    attend_rows<V, T, D>(a, r0, rows - r0 < rows_per_pass<D>() ? rows - r0 : rows_per_pass<D>());
  }
}

// Table lookup shared by the ISA TUs: head dims must be multiples of 16.
template <class V>
moelight::AttnFn select_attn(moelight::KvDtype dtype, int64_t d) {
#define MOELIGHT_DIMS(T)                  \
  switch (d) {                            \
    case 64: return &attend<V, T, 64>;    \
    case 80: return &attend<V, T, 80>;    \
    case 96: return &attend<V, T, 96>;    \
    case 128: return &attend<V, T, 128>;  \
    case 192: return &attend<V, T, 192>;  \
    case 256: return &attend<V, T, 256>;  \
    default: return nullptr;              \
  }
  switch (dtype) {
    case moelight::KvDtype::F32: MOELIGHT_DIMS(float)
    case moelight::KvDtype::BF16: MOELIGHT_DIMS(Bf16)
    case moelight::KvDtype::F16: MOELIGHT_DIMS(F16)
  }
#undef MOELIGHT_DIMS
  return nullptr;
}

}  // namespace
