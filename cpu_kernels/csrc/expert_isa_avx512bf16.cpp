// AVX512-BF16 pieces of the fused expert op: dequantisation of a strip to bf16 pairs, into scratch
// or in registers for an expert's 1-2 decode rows; the strip GEMM on the bf16 dot product
// (vdpbf16ps, up to 8 rows x 32 columns in registers); the gate/up epilogue; VNNI's int8-activation
// products where the CPU has them. Reached only after the CPU check in isa.cpp. The AMX unit reuses
// dequant and act.
#include <cstdint>
#include <cstring>

#include "experts.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include "simd_avx512bf16.h"

namespace {

using moelight::Strip;
using moelight::WFormat;

// Per-element scale vectors of one group: element e of a 64-element row is column e / 2 (pairs).
struct GroupScales {
  __m512 s[4], b[4];
};

// 32 per-column values -> per-element vectors of a 64-element row (columns 0-7, 8-15, 16-23, 24-31).
inline void dup_columns(const float* p, __m512 out[4]) {
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
#pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_loadu_ps(p + 16 * h);
    out[2 * h] = _mm512_permutexvar_ps(dup_lo, v);
    out[2 * h + 1] = _mm512_permutexvar_ps(dup_hi, v);
  }
}

inline void load_group(const Strip& st, int64_t g, GroupScales& gs) {
  dup_columns(st.scales + g * 32, gs.s);
  if (st.bias != nullptr) {
    dup_columns(st.bias + g * 32, gs.b);
  } else {
    for (auto& v : gs.b) v = _mm512_setzero_ps();
  }
}

// 16 e4m3 bytes -> float32 (exact; the bit pattern moved into float32's fields, times 2^120).
inline __m512 fp8_to_f32(__m128i bytes) {
  const __m512i x = _mm512_cvtepu8_epi32(bytes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, mag)), _mm512_set1_ps(1.329227995784916e36f));
}

// Four vectors of 16 values (elements 0-15, 16-31, 32-47, 48-63) scaled and rounded to a row of
// bf16 pairs: columns 0-15 in lo, 16-31 in hi.
inline void scaled_row(const __m512 v[4], const GroupScales& gs, __m512bh& lo, __m512bh& hi) {
  __m512 w[4];
#pragma GCC unroll 8
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(v[i], gs.s[i], gs.b[i]);
  lo = _mm512_cvtne2ps_pbh(w[1], w[0]);
  hi = _mm512_cvtne2ps_pbh(w[3], w[2]);
}

inline void store_row(const __m512 v[4], const GroupScales& gs, uint16_t* out) {
  __m512bh lo, hi;
  scaled_row(v, gs, lo, hi);
  _mm512_storeu_si512(out, as_si(lo));
  _mm512_storeu_si512(out + 32, as_si(hi));
}

const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
const float kU4[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Row r of a quantized strip as float32 code values before scaling: elements 0-15, 16-31, 32-47, 48-63.
inline void decode_row(const Strip& st, int64_t r, __m512 lut, __m512 v[4]) {
  if (st.fmt == WFormat::U4 || st.fmt == WFormat::FP4) {
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    const uint8_t* p = st.codes + r * 32;
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    v[0] = _mm512_permutexvar_ps(_mm512_and_si512(a, low4), lut);
    v[1] = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), lut);
    v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), lut);
    v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
  } else {
    const uint8_t* p = st.codes + r * 64;
#pragma GCC unroll 8
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
      v[i] = st.fmt == WFormat::I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) : fp8_to_f32(bytes);
    }
  }
}

inline __m512 lut_of(const Strip& st) { return _mm512_loadu_ps(st.fmt == WFormat::FP4 ? kE2M1 : kU4); }

// Pair rows [r0, r1) of the strip into out + r * 64 (the AMX tile GEMM dequantises a k-block of
// 16 rows at a time, between its tile products).
void dequant_rows(const Strip& st, int64_t r0, int64_t r1, uint16_t* out) {
  const int64_t rows_per_group = st.group / 2;
  const __m512 lut = lut_of(st);
  GroupScales gs;
  for (int64_t r = r0; r < r1; ++r) {
    if (r == r0 || r % rows_per_group == 0) load_group(st, r / rows_per_group, gs);
    __m512 v[4];
    decode_row(st, r, lut, v);
    store_row(v, gs, out + r * 64);
  }
}

void dequant(const Strip& st, uint16_t* out) { dequant_rows(st, 0, st.k / 2, out); }

// The strip a thread multiplies next, read into L2 a line per pair-row of this strip's products: a
// strip multiplied by 8-64 rows (the README job's 256-token micro-batches) then finds its weights in
// L2, where the hardware prefetcher alone left the products waiting on DRAM (0.81-0.99x the time on
// Zen 4 at T = 256 on four families' shapes, Qwen3's narrow experts most). Not below 8 rows, where
// the kernel already reads at the memory's rate (BENCHMARKS §18). Spread over the first pass, so it
// adds no burst.
struct ReadAhead {
  const char* p;
  int64_t left;
  void step() {
    if (left <= 0) return;
    _mm_prefetch(p, _MM_HINT_T2);
    p += 64;
    left -= 64;
  }
};

template <int R>
inline void gemm_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, ReadAhead& ahead, float* c,
                      int64_t ldc) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    ahead.step();
    const __m512i b0 = _mm512_loadu_si512(b + p * 64), b1 = _mm512_loadu_si512(b + p * 64 + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, 4);
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bh(av), as_bh(b0));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], as_bh(av), as_bh(b1));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

// Any m: blocks of 8 rows, then the rest in one block of its own size (a decode token per expert
// is one row of work, not 8). From 8 rows on, the next strip is read ahead (ReadAhead).
void gemm(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next,
          int64_t next_bytes, float* c, int64_t ldc) {
  ReadAhead ahead{reinterpret_cast<const char*>(next), m >= 8 && next ? next_bytes : 0};
  int64_t r = 0;
  for (; r + 8 <= m; r += 8) gemm_rows<8>(a + r * lda, lda, b, k, ahead, c + r * ldc, ldc);
  a += r * lda;
  c += r * ldc;
  switch (m - r) {
    case 7: return gemm_rows<7>(a, lda, b, k, ahead, c, ldc);
    case 6: return gemm_rows<6>(a, lda, b, k, ahead, c, ldc);
    case 5: return gemm_rows<5>(a, lda, b, k, ahead, c, ldc);
    case 4: return gemm_rows<4>(a, lda, b, k, ahead, c, ldc);
    case 3: return gemm_rows<3>(a, lda, b, k, ahead, c, ldc);
    case 2: return gemm_rows<2>(a, lda, b, k, ahead, c, ldc);
    case 1: return gemm_rows<1>(a, lda, b, k, ahead, c, ldc);
    default: return;
  }
}

// gemm on a quantized strip, each pair-row dequantised in registers: dequant's bf16 values and
// gemm_rows' summation order, so the same outputs bit for bit without the scratch round trip.
template <int R>
void qgemm_rows(const uint16_t* a, int64_t lda, const Strip& st, float* c, int64_t ldc) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t rows_per_group = st.group / 2;
  const __m512 lut = lut_of(st);
  GroupScales gs;
  for (int64_t p = 0; p < st.k / 2; ++p) {
    if (p % rows_per_group == 0) load_group(st, p / rows_per_group, gs);
    __m512 v[4];
    decode_row(st, p, lut, v);
    __m512bh b0, b1;
    scaled_row(v, gs, b0, b1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, 4);
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bh(av), b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], as_bh(av), b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

void qgemm(const uint16_t* a, int64_t lda, int64_t m, const Strip& st, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) qgemm_rows<2>(a + r * lda, lda, st, c + r * ldc, ldc);
  if (r < m) qgemm_rows<1>(a + r * lda, lda, st, c + r * ldc, ldc);
}

void act(const float* c, int64_t ldc, int64_t m, const float* bias, moelight::Act fn, uint16_t* out, int64_t ldo) {
  const __m512 bg = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bu = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(fn.limit), nlim = _mm512_set1_ps(-fn.limit);
  const __m512 nalpha = _mm512_set1_ps(fn.kind == 1 ? -fn.alpha : -1.0f);
  for (int64_t r = 0; r < m; ++r) {
    __m512 g = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc), bg);
    __m512 u = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc + 16), bu);
    if (fn.kind == 1) {
      g = _mm512_min_ps(g, lim);
      u = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(u, lim), nlim), one);
    }
    // g * sigmoid(a g) = g / (1 + exp(-a g))
    const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, VecAvx512::exp(_mm512_mul_ps(g, nalpha))));
    const __m512 y = _mm512_mul_ps(sig, u);
    const __m256bh h = _mm512_cvtneps_pbh(y);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), as_si(h));
  }
}

// qgemm for up to 2 rows per expert; VNNI's integer products where the CPU has them.
moelight::ExpertIsa make_isa() {
  moelight::ExpertIsa t{dequant, gemm, act, qgemm, 2, nullptr, 0, 0, nullptr, nullptr, 1};
  t.dequant_rows = dequant_rows;
  moelight::with_vnni_products(t);
  return t;
}

}  // namespace
#pragma GCC pop_options

const moelight::ExpertIsa* moelight::avx512bf16_expert_isa() {
  static const moelight::ExpertIsa isa = make_isa();
  return &isa;
}
#else
const moelight::ExpertIsa* moelight::avx512bf16_expert_isa() { return nullptr; }
#endif
