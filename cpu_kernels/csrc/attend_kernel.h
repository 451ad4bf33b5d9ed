// Flash-style attention over one tile of query rows against one KV head, templated on
// the vector ISA (V), the KV storage type (T) and the head dim (D).
//
// Used by both ops: decode (1 query x `group` heads, no mask: each K/V byte of the
// (sequence, KV head) block is read once for all heads of the group) and prefill
// (a block of queries x `group` heads, causal). Keys are processed in blocks of 16:
//   1. scores  s[r][t] = q_r . k_t for all rows first, 4 rows sharing each K load:
//      float32 K is read in place; bf16/f16 K is converted once into L1 scratch, or
//      (AVX512-BF16) used as stored by bf16 dot products. Doing one row's scores and
//      softmax at a time was latency-bound (dot -> transpose -> exp chains): 1.3-1.5x slower.
//   2. online softmax with lazy rescaling (running max m_r, lane-wise sums l_r)
//   3. acc_r += p[r][t] * v_t with NR rows x CG vectors of accumulators in registers
// bf16 data is widened in an even/odd element order (no shuffles); q and the output are
// permuted to match (kPerm). All accumulation is float32.
// Include after `#pragma GCC target` in an ISA TU.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace {

constexpr int kKeyBlock = 16;
constexpr float kRescaleSlack = 8.0f;  // see the online softmax below
constexpr int kMaxRows = 64;  // rows per pass; more rows re-read K/V (never in practice)
// Rows per pass for head dim D: keeps the stack scratch of one call under ~150 KB.
template <int D> constexpr int rows_per_pass() { return D > 128 ? kMaxRows / 2 : kMaxRows; }

template <class T> struct KvLoad;
template <> struct KvLoad<float> {
  template <class V> static typename V::R load(const float* p) { return V::load(p); }
};
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
template <> struct KvLoad<Bf16> {
  template <class V> static typename V::R load(const Bf16* p) {
    return V::load(reinterpret_cast<const uint16_t*>(p), true);
  }
};
template <> struct KvLoad<F16> {
  template <class V> static typename V::R load(const F16* p) {
    return V::load(reinterpret_cast<const uint16_t*>(p), false);
  }
};

// Demand-touch the cache lines of one row that this pass of a multi-pass loop does not
// read (bytes [from, to)). The passes below read every row in chunks, so DRAM sees each
// row's lines in two visits; touching the rest in the first visit keeps the stream
// sequential for the hardware prefetcher (software prefetch hurt on the machines we tried).
inline void touch_rest(const void* row, int from, int to) {
  const volatile char* c = static_cast<const volatile char*>(row);
  for (int b = from; b < to; b += 64) (void)c[b];
}

// V rows of the block touched while K rows are scored, so K and V stream side by side
// instead of in alternating bursts (float32: 0.69 -> ~0.8 of a core's read bandwidth).
// Empty (p == nullptr) for all but the first row group.
struct RowTouch {
  const char* p = nullptr;
  int64_t stride = 0;  // bytes between rows
  int nbytes = 0;
  int rows = 0;  // rows that exist (a tail block has fewer)
  void row(int t) const {
    if (p != nullptr && t < rows) touch_rest(p + t * stride, 0, nbytes);
  }
};

// acc rows [0, NR) += P[r][t] * v_t for t < nk, with v already float32 in L1. NR rows x CG
// chunks of accumulators stay in registers; each broadcast P[r][t] serves CG chunks.
template <class V, int D, int NR>
inline void accumulate_pv(float* acc, const float* P, const float* vf, int64_t vst, int nk) {
  using R = typename V::R;
  constexpr int NCH = D / V::W;
  constexpr int CG = NR >= 8 ? 2 : (NR >= 4 ? 4 : 8);
  for (int c0 = 0; c0 < NCH; c0 += CG) {
    R a[NR][CG];
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) a[r][cc] = V::load(acc + r * D + (c0 + cc) * V::W);
    for (int t = 0; t < nk; ++t) {
      if (c0 == 0 && CG < NCH) touch_rest(vf + t * vst, CG * V::W * 4, D * 4);
      R vv[CG];
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) vv[cc] = V::load(vf + t * vst + (c0 + cc) * V::W);
      for (int r = 0; r < NR; ++r) {
        const R p = V::set1(P[r * kKeyBlock + t]);
        for (int cc = 0; cc < CG; ++cc)
          if (c0 + cc < NCH) a[r][cc] = V::fma(p, vv[cc], a[r][cc]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < CG; ++cc)
        if (c0 + cc < NCH) V::store(acc + r * D + (c0 + cc) * V::W, a[r][cc]);
  }
}

// Same as accumulate_pv, reading bf16 V rows in place: each 2W-element chunk converts to
// an even and an odd vector (the kPerm order of acc) with two integer ops, no scratch copy.
template <class V, int D, int NR>
inline void accumulate_pv_bf16(float* acc, const float* P, const uint16_t* v, int64_t vst, int nk) {
  using R = typename V::R;
  constexpr int NP = D / (2 * V::W);  // bf16 chunks per row
  constexpr int CP = NR >= 8 ? 1 : (NR >= 4 ? 2 : 4);
  for (int c0 = 0; c0 < NP; c0 += CP) {
    R a[NR][2 * CP];
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) a[r][cc] = V::load(acc + r * D + c0 * 2 * V::W + cc * V::W);
    for (int t = 0; t < nk; ++t) {
      if (c0 == 0 && CP < NP) touch_rest(v + t * vst, CP * 2 * V::W * 2, D * 2);
      R vv[2 * CP];
      for (int cc = 0; cc < CP; ++cc)
        if (c0 + cc < NP) V::load_bf16_pair(v + t * vst + (c0 + cc) * 2 * V::W, vv[2 * cc], vv[2 * cc + 1]);
      for (int r = 0; r < NR; ++r) {
        const R p = V::set1(P[r * kKeyBlock + t]);
        for (int cc = 0; cc < 2 * CP; ++cc)
          if (c0 + cc / 2 < NP) a[r][cc] = V::fma(p, vv[cc], a[r][cc]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < 2 * CP; ++cc)
        if (c0 + cc / 2 < NP) V::store(acc + r * D + c0 * 2 * V::W + cc * V::W, a[r][cc]);
  }
}

// Block of nk rows (stride st) -> float32 rows in L1, zero-padded to kKeyBlock rows so the
// vector loops never read outside the cache tensor. Sequential, so the prefetcher keeps up.
// With kPerm (bf16, D a multiple of 2W) each 2W chunk is stored even elements first, then
// odd ones: the conversion needs no shuffles, and q / the output use the same order.
template <class V, class T, int D, bool kPerm>
inline void load_block(float* dst, const T* src, int64_t st, int nk) {
  for (int t = 0; t < kKeyBlock; ++t) {
    if constexpr (kPerm) {
      for (int c = 0; c < D; c += 2 * V::W) {
        typename V::R ev = V::zero(), od = V::zero();
        if (t < nk) V::load_bf16_pair(reinterpret_cast<const uint16_t*>(src + t * st + c), ev, od);
        V::store(dst + t * D + c, ev);
        V::store(dst + t * D + c + V::W, od);
      }
    } else {
      for (int c = 0; c < D; c += V::W) {
        V::store(dst + t * D + c, t < nk ? KvLoad<T>::template load<V>(src + t * st + c) : V::zero());
      }
    }
  }
}

// Position in the even/odd chunk order of natural element c (see load_block).
template <int W>
inline int perm_index(int c) {
  const int base = c - c % (2 * W), w = c % (2 * W);
  return base + (w % 2) * W + w / 2;
}

// Scores of NR rows against one key block with bf16 dot-product instructions straight on
// the bf16 cache (no conversion). Each K chunk is loaded once for all NR rows, and the NR
// independent dot chains per key keep the FMA ports busy (one row at a time was bound by
// the dot -> transpose -> exp latency chain, ~2x slower). q = qh + ql split into two
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
// f16 keys widened into L1): as block_scores_bf16, each K chunk loaded once for NR rows.
// q rows are already scaled (and permuted like the keys).
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

template <class V, int D>
inline void scores_f32(float* S, const float* q, int nr, const float* kblk, int64_t kst, RowTouch vt) {
  int r = 0;
  for (; r + 4 <= nr; r += 4, vt = {}) block_scores_f32<V, D, 4>(S + r * kKeyBlock, q + r * D, kblk, kst, vt);
  if (nr - r >= 2) {
    block_scores_f32<V, D, 2>(S + r * kKeyBlock, q + r * D, kblk, kst, vt);
    r += 2;
    vt = {};
  }
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

template <class V, class T, int D>
void attend_rows(const moelight::AttnArgs& a, int r0, int nr) {
  using R = typename V::R;
  constexpr int NV = kKeyBlock / V::W;  // score vectors per key block
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
    const float* src = a.q + i * a.q_stride_i + j * D;
    if constexpr (!kDot) {  // the bf16 dot path scores with qh / ql below instead
      for (int c = 0; c < D; ++c) qs[r * D + (kPerm ? perm_index<V::W>(c) : c)] = src[c] * a.scale;
    }
    if constexpr (kDot) {
      for (int c = 0; c < D; c += V::W) has_lo |= V::split_bf16(src + c, qh + r * D + c, ql + r * D + c);
    }
    limit[r] = a.causal_first < 0 ? a.n_keys : a.causal_first + i + 1;
    if (limit[r] > a.n_keys) limit[r] = a.n_keys;
    if (limit[r] > kmax) kmax = limit[r];
    m[r] = -__builtin_inff();
    V::store(lv + r * V::W, V::zero());
  }
  std::memset(acc, 0, sizeof(float) * nr * D);

  const T* kbase = static_cast<const T*>(a.k);
  const T* vbase = static_cast<const T*>(a.v);
  const int64_t st = a.kv_stride_t;
  for (int64_t kb = 0; kb < kmax; kb += kKeyBlock) {
    const int nk = kmax - kb < kKeyBlock ? static_cast<int>(kmax - kb) : kKeyBlock;
    // Widened keys (float32 or converted in L1): touch V while scoring. The bf16 dot path
    // is faster without it (its V pass is short and touches the rest of each row itself).
    const RowTouch vt{kDot ? nullptr : reinterpret_cast<const char*>(vbase + kb * st),
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
        scores_bf16<V, D, true>(P, qh, ql, nr, kraw, kraw_st, a.scale);
      } else {
        scores_bf16<V, D, false>(P, qh, ql, nr, kraw, kraw_st, a.scale);
      }
    } else {
      scores_f32<V, D>(P, qs, nr, kblk, kst, vt);
    }
    // Phase 2: online softmax per row, scores in P replaced by probabilities.
    for (int r = 0; r < nr; ++r) {
      const int valid = limit[r] - kb >= kKeyBlock ? kKeyBlock : static_cast<int>(limit[r] - kb);
      float* pr = P + r * kKeyBlock;
      if (valid <= 0) {  // causal: this row sees none of the block
        for (int t = 0; t < kKeyBlock; ++t) pr[t] = 0.0f;
        continue;
      }
      R s[NV];
      for (int h = 0; h < NV; ++h) s[h] = V::load(pr + h * V::W);
      for (int h = 0; h < NV; ++h) {
        if (valid < kKeyBlock) s[h] = V::keep_first(s[h], valid - h * V::W, -__builtin_inff());
      }
      // Lazy rescaling: the reference max m[r] only moves when a score exceeds it by more
      // than kRescaleSlack, so p = exp(s - m) <= e^8 cannot overflow, while most blocks skip
      // the horizontal max, the scalar exp and the rescale of acc.
      bool grow = false;
      for (int h = 0; h < NV; ++h) grow |= V::any_gt(s[h], m[r] + kRescaleSlack);
      R lsum = V::load(lv + r * V::W);
      if (grow) {
        R mx = s[0];
        for (int h = 1; h < NV; ++h) mx = V::max(mx, s[h]);
        const float bm = V::hmax(mx);
        const float m_new = m[r] > bm ? m[r] : bm;
        const R av = V::set1(__builtin_expf(m[r] - m_new));  // 0 on the first block (m = -inf)
        lsum = V::mul(lsum, av);
        for (int c = 0; c < D; c += V::W) V::store(acc + r * D + c, V::mul(av, V::load(acc + r * D + c)));
        m[r] = m_new;
      }
      const R mv = V::set1(m[r]);
      for (int h = 0; h < NV; ++h) {
        R p = V::exp(V::sub(s[h], mv));
        if (valid < kKeyBlock) p = V::keep_first(p, valid - h * V::W, 0.0f);
        V::store(pr + h * V::W, p);
        lsum = V::add(lsum, p);
      }
      V::store(lv + r * V::W, lsum);
    }

    if constexpr (kPerm) {
      const uint16_t* vraw = reinterpret_cast<const uint16_t*>(vbase + kb * st);
      int r = 0;
      for (; r + 8 <= nr; r += 8) accumulate_pv_bf16<V, D, 8>(acc + r * D, P + r * kKeyBlock, vraw, st, nk);
      if (nr - r >= 4) { accumulate_pv_bf16<V, D, 4>(acc + r * D, P + r * kKeyBlock, vraw, st, nk); r += 4; }
      if (nr - r >= 2) { accumulate_pv_bf16<V, D, 2>(acc + r * D, P + r * kKeyBlock, vraw, st, nk); r += 2; }
      if (nr - r >= 1) accumulate_pv_bf16<V, D, 1>(acc + r * D, P + r * kKeyBlock, vraw, st, nk);
    } else {
      const float* vblk = reinterpret_cast<const float*>(vbase + kb * st);
      if (!direct) {
        load_block<V, T, D, kPerm>(kf, vbase + kb * st, st, nk);  // K no longer needed: reuse its buffer
        vblk = kf;
      }
      int r = 0;
      for (; r + 8 <= nr; r += 8) accumulate_pv<V, D, 8>(acc + r * D, P + r * kKeyBlock, vblk, kst, nk);
      if (nr - r >= 4) { accumulate_pv<V, D, 4>(acc + r * D, P + r * kKeyBlock, vblk, kst, nk); r += 4; }
      if (nr - r >= 2) { accumulate_pv<V, D, 2>(acc + r * D, P + r * kKeyBlock, vblk, kst, nk); r += 2; }
      if (nr - r >= 1) accumulate_pv<V, D, 1>(acc + r * D, P + r * kKeyBlock, vblk, kst, nk);
    }
  }

  for (int r = 0; r < nr; ++r) {
    const int i = (r0 + r) / g, j = (r0 + r) % g;
    float* dst = a.out + i * a.out_stride_i + j * D;
    const float l = V::hsum(V::load(lv + r * V::W));
    // split-K partial (a.m set): unnormalised, the caller merges; else normalised (no keys: zeros).
    const float inv = a.m != nullptr ? 1.0f : (l > 0.0f ? 1.0f / l : 0.0f);
    if (a.m != nullptr) {
      a.m[r0 + r] = m[r];
      a.l[r0 + r] = l;
    }
    const float* src = acc + r * D;
    if constexpr (kPerm) {  // undo the even/odd order chunk by chunk (vectorisable, no index math)
      for (int base = 0; base < D; base += 2 * V::W)
        for (int w = 0; w < V::W; ++w) {
          dst[base + 2 * w] = src[base + w] * inv;
          dst[base + 2 * w + 1] = src[base + V::W + w] * inv;
        }
    } else {
      for (int c = 0; c < D; ++c) dst[c] = src[c] * inv;
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
