// Variants of VNNI's one-row int4 / int8 product loop (expert_isa_avx512vnni.cpp) on bench-1b's experts,
// cold, alternated per pass, without the expert op around them (issue #34): the software prefetch's
// distance and level, the pre-permuted nibble layout (no vpermw), the scales and biases inside the code
// stream, and a read-only pass over the same bytes. 8 layers, each thread one expert per layer (224
// gate/up strips of K = 1024, then 32 down strips of K = 3584; int4 with group-128 scales and biases
// as --quantize int4 packs them), codes on 2 MiB pages, a 512 MB read before each variant's pass. The
// codes are constant, so variants of one layout share their buffers (no placement differences).
// Prints each variant's share of the same pass's read bandwidth and its time over the first variant's
// in the same pass (median, quartiles). The int8 copies read group-128 scales and biases, which the
// engine's int8 (one scale per row) does not: compare them with each other, not with "kernel".
//
//   g++ -O3 -fopenmp -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mavx2
//       -Icpu_kernels/csrc benchmarks/expert_vnni_variants.cpp cpu_kernels/csrc/expert_isa_avx512vnni.cpp
//       -o /tmp/vnni_variants   (one line)
//   flock /tmp/cpu.lock /tmp/vnni_variants 3 60 kernel,t0_3k,noperm_t0_3k,t2_3k,ro_t0_3k
//   (format 3: int4, 1: int8; passes; the variants to run, the first the ratios' base)
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <x86intrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "driver_buffers.h"
#include "experts.h"
using namespace moelight;


// One strip at one row (PF: prefetch distance in bytes, HINT its level, PF0 a second T0 distance;
// PERM: the packed layout's vpermw; RO: loads only). Layout of one strip: codes (K/2*32 B for U4, K*32 for I8), then separately scales / bias [G][32];
// INL: per group, the group's codes then its 32 scales then its 32 biases.
template <int PF, int HINT, bool PERM, bool INL, bool I8, bool RO, int PF0 = 0>
__attribute__((noinline)) void strip1(const QuantRows& a, const uint8_t* codes, const float* scales, const float* bias,
                                      int64_t k, float* c) {
  constexpr int64_t group = 128, bpg = group / 32, blkB = I8 ? 1024 : 512, gB = bpg * blkB;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 out0 = _mm512_setzero_ps(), out1 = _mm512_setzero_ps();
  const int64_t G = k / group;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gc = INL ? codes + g * (gB + 256) : codes + g * gB;
    const float* gs = INL ? reinterpret_cast<const float*>(gc + gB) : scales + g * 32;
    const float* gb = INL ? gs + 32 : bias + g * 32;
    if (!INL && PF > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(scales + (g + 2) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scales + (g + 2) * 32 + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bias + (g + 2) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bias + (g + 2) * 32 + 16), _MM_HINT_T0);
    }
    __m512 gacc0 = _mm512_setzero_ps(), gacc1 = _mm512_setzero_ps();
    float asum = 0.0f;
    for (int64_t b = 0; b < bpg; ++b) {
      const int64_t blk = g * bpg + b;
      const uint8_t* bc = gc + b * blkB;
      if constexpr (PF > 0) {
        const char* p = reinterpret_cast<const char*>(bc + PF);
        const int64_t n = (INL && b == bpg - 1) ? blkB + 256 : blkB;
        for (int64_t o = 0; o < n; o += 64) _mm_prefetch(p + o, (_mm_hint)HINT);
      }
      if constexpr (PF0 > 0) {
        const char* p = reinterpret_cast<const char*>(bc + PF0);
        for (int64_t o = 0; o < blkB; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
      }
      __m512i i0 = _mm512_setzero_si512(), i1 = i0, j0 = i0, j1 = i0;
      if constexpr (RO) {
#pragma GCC unroll 16
        for (int s = 0; s < blkB / 64; ++s) i0 = _mm512_xor_si512(i0, _mm512_loadu_si512(bc + s * 64));
      } else {
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) {
          const int64_t p = blk * 16 + 2 * s;
          __m512i lo, hi;
          if constexpr (I8) {
            const __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(bc + s * 128), flip);
            const __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512(bc + s * 128 + 64), flip);
            lo = _mm512_unpacklo_epi16(x0, x1);
            hi = _mm512_unpackhi_epi16(x0, x1);
          } else {
            __m512i x = _mm512_loadu_si512(bc + s * 64);
            if constexpr (PERM) x = _mm512_permutexvar_epi16(pairs, x);
            lo = _mm512_and_si512(x, low);
            hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
          }
          int32_t quad;
          std::memcpy(&quad, a.q + 2 * p, 4);
          const __m512i av = _mm512_set1_epi32(quad);
          if (s & 1) {
            j0 = _mm512_dpbusd_epi32(j0, lo, av);
            j1 = _mm512_dpbusd_epi32(j1, hi, av);
          } else {
            i0 = _mm512_dpbusd_epi32(i0, lo, av);
            i1 = _mm512_dpbusd_epi32(i1, hi, av);
          }
        }
      }
      i0 = _mm512_add_epi32(i0, j0);
      i1 = _mm512_add_epi32(i1, j1);
      const float sa = a.scale[blk];
      asum += sa * static_cast<float>(a.sum[blk]);
      const __m512 sv = _mm512_set1_ps(sa);
      gacc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), sv, gacc0);
      gacc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), sv, gacc1);
    }
    const __m512 as = _mm512_set1_ps(asum);
    out0 = _mm512_fmadd_ps(_mm512_loadu_ps(gb), as, _mm512_fmadd_ps(gacc0, _mm512_loadu_ps(gs), out0));
    out1 = _mm512_fmadd_ps(_mm512_loadu_ps(gb + 16), as, _mm512_fmadd_ps(gacc1, _mm512_loadu_ps(gs + 16), out1));
  }
  _mm512_storeu_ps(c, out0);
  _mm512_storeu_ps(c + 16, out1);
}

using Fn = void (*)(const QuantRows&, const uint8_t*, const float*, const float*, int64_t, float*);
struct Var {
  const char* name;
  Fn fn;  // nullptr: the real kernel (t.iqgemm)
  bool inl;
};

int main(int argc, char** argv) {
  const int fmt = atoi(argv[1]), passes = atoi(argv[2]);
  const std::string which = argc > 3 ? argv[3] : "";
  const bool i8 = fmt == 1;
  ExpertIsa t{};
  with_vnni_products(t);
  std::vector<Var> vars;
  if (!i8) {
    vars = {{"kernel", nullptr, false},
            {"t0_3k", strip1<3072, _MM_HINT_T0, true, false, false, false>, false},
            {"noperm_t0_3k", strip1<3072, _MM_HINT_T0, false, false, false, false>, false},
            {"t0_2k", strip1<2048, _MM_HINT_T0, true, false, false, false>, false},
            {"t0_1k", strip1<1024, _MM_HINT_T0, true, false, false, false>, false},
            {"noperm_t0_2k", strip1<2048, _MM_HINT_T0, false, false, false, false>, false},
            {"t1_3k", strip1<3072, _MM_HINT_T1, true, false, false, false>, false},
            {"t2_3k", strip1<3072, _MM_HINT_T2, true, false, false, false>, false},
            {"t1_6k", strip1<6144, _MM_HINT_T1, true, false, false, false>, false},
            {"inline_t0_3k", strip1<3072, _MM_HINT_T0, true, true, false, false>, true},
            {"inline_noperm_t0_3k", strip1<3072, _MM_HINT_T0, false, true, false, false>, true},
            {"ro_t0_3k", strip1<3072, _MM_HINT_T0, true, false, false, true>, false},
            {"t2_2k", strip1<2048, _MM_HINT_T2, true, false, false, false>, false},
            {"t2_4k", strip1<4096, _MM_HINT_T2, true, false, false, false>, false},
            {"t2_6k", strip1<6144, _MM_HINT_T2, true, false, false, false>, false},
            {"t2_12k", strip1<12288, _MM_HINT_T2, true, false, false, false>, false},
            {"t2_6k_t0_1k", strip1<6144, _MM_HINT_T2, true, false, false, false, 1024>, false},
            {"t2_12k_t0_2k", strip1<12288, _MM_HINT_T2, true, false, false, false, 2048>, false},
            {"noperm_t2_4k", strip1<4096, _MM_HINT_T2, false, false, false, false>, false},
            {"nta_3k", strip1<3072, _MM_HINT_NTA, true, false, false, false>, false}};
  } else {
    vars = {{"kernel", nullptr, false},
            {"t0_3k", strip1<3072, _MM_HINT_T0, true, false, true, false>, false},
            {"t0_2k", strip1<2048, _MM_HINT_T0, true, false, true, false>, false},
            {"t0_1k", strip1<1024, _MM_HINT_T0, true, false, true, false>, false},
            {"t1_3k", strip1<3072, _MM_HINT_T1, true, false, true, false>, false},
            {"inline_t0_3k", strip1<3072, _MM_HINT_T0, true, true, true, false>, true},
            {"ro_t0_3k", strip1<3072, _MM_HINT_T0, true, false, true, true>, false},
            {"t2_3k", strip1<3072, _MM_HINT_T2, true, false, true, false>, false},
            {"t2_6k", strip1<6144, _MM_HINT_T2, true, false, true, false>, false},
            {"t2_12k", strip1<12288, _MM_HINT_T2, true, false, true, false>, false},
            {"t2_6k_t0_1k", strip1<6144, _MM_HINT_T2, true, false, true, false, 1024>, false}};
  }
  if (!which.empty()) {  // comma list of names to keep
    std::vector<Var> keep;
    for (auto& v : vars)
      if (("," + which + ",").find("," + std::string(v.name) + ",") != std::string::npos) keep.push_back(v);
    vars = keep;
  }
  const int64_t E = 8, L = 8, H = 1024, F = 3584, s13n = 2 * F / 32, s2n = H / 32, GS = 128;
  const int64_t b13 = i8 ? H * 32 : H * 16, b2 = i8 ? F * 32 : F * 16;
  const int64_t g13 = H / GS, g2 = F / GS;
  // int8 in the engine: one scale per row (group = K) and no bias; int4: group 128 with bias
  const bool has_bias = !i8;
  const int64_t V = vars.size();
  struct Layer { uint8_t *w13, *w2; float *s13, *s2, *z13, *z2; };
  std::vector<std::vector<Layer>> lay(V, std::vector<Layer>(L));
  int64_t first_sep = -1, first_inl = -1;  // variants of one layout share its buffers (constant codes)
  for (int64_t v = 0; v < V; ++v)
    for (int l = 0; l < L; ++l) {
      Layer& y = lay[v][l];
      int64_t& first = vars[v].inl ? first_inl : first_sep;
      if (first >= 0 && first != v) { y = lay[first][l]; continue; }
      first = v;
      if (vars[v].inl) {
        y.w13 = (uint8_t*)huge(E * s13n * (b13 + g13 * 256));
        y.w2 = (uint8_t*)huge(E * s2n * (b2 + g2 * 256));
        y.s13 = y.s2 = y.z13 = y.z2 = nullptr;
      } else {
        y.w13 = (uint8_t*)huge(E * s13n * b13);
        y.w2 = (uint8_t*)huge(E * s2n * b2);
        y.s13 = (float*)huge(E * s13n * g13 * 32 * 4);
        y.s2 = (float*)huge(E * s2n * g2 * 32 * 4);
        y.z13 = (float*)huge(E * s13n * g13 * 32 * 4);
        y.z2 = (float*)huge(E * s2n * g2 * 32 * 4);
      }
    }
  const size_t fb = 512ull << 20;
  uint64_t* flush = (uint64_t*)huge(fb);
  std::vector<int8_t> q(F, 3);
  std::vector<float> as(F / 32, 0.1f);
  std::vector<int32_t> su(F / 32, 96);
  QuantRows a1{q.data(), as.data(), su.data(), H}, a2{q.data(), as.data(), su.data(), F};
  std::vector<std::vector<double>> share(V), ratio(V);
  for (int pass = 0; pass < passes; ++pass) {
    std::vector<double> tk(V);
    for (int64_t vi = 0; vi < V; ++vi) {
      const int64_t v = (vi + pass) % V;  // rotate the order per pass
      const double flush_s = flush_read(flush, fb);  // the pass's read-bandwidth probe
      const double t1 = now();
      const Var& var = vars[v];
      for (int l = 0; l < L; ++l) {
        const int e0 = (pass * 3 + l) % E, e1 = (e0 + 3) % E;
        const Layer& y = lay[v][l];
#pragma omp parallel num_threads(2)
        {
          const int64_t e = omp_get_thread_num() ? e1 : e0;
          float c[128];
          for (int64_t j = 0; j < s13n; ++j) {
            const int64_t u = e * s13n + j;
            if (var.inl) {
              var.fn(a1, y.w13 + u * (b13 + g13 * 256), nullptr, nullptr, H, c);
            } else if (var.fn) {
              var.fn(a1, y.w13 + u * b13, y.s13 + u * g13 * 32, y.z13 + u * g13 * 32, H, c);
            } else {
              Strip st{y.w13 + u * b13, y.s13 + u * (i8 ? 32 : g13 * 32), has_bias ? y.z13 + u * g13 * 32 : nullptr,
                       H, i8 ? H : GS, (WFormat)fmt};
              t.iqgemm(a1, 1, st, c, 32);
            }
          }
          for (int64_t j = 0; j < s2n; ++j) {
            const int64_t u = e * s2n + j;
            if (var.inl) {
              var.fn(a2, y.w2 + u * (b2 + g2 * 256), nullptr, nullptr, F, c);
            } else if (var.fn) {
              var.fn(a2, y.w2 + u * b2, y.s2 + u * g2 * 32, y.z2 + u * g2 * 32, F, c);
            } else {
              Strip st{y.w2 + u * b2, y.s2 + u * (i8 ? 32 : g2 * 32), has_bias ? y.z2 + u * g2 * 32 : nullptr, F,
                       i8 ? F : GS, (WFormat)fmt};
              t.iqgemm(a2, 1, st, c, 32);
            }
          }
        }
      }
      double t2 = now();
      const double bytes = L * 2.0 * (s13n * b13 + s2n * b2 + (s13n * g13 + s2n * g2) * 256);
      tk[v] = t2 - t1;
      share[v].push_back(bytes / (t2 - t1) / (fb / flush_s));
    }
    for (int64_t v = 0; v < V; ++v) ratio[v].push_back(tk[v] / tk[0]);
  }
  auto med = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  auto q1 = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 4]; };
  auto q3 = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[3 * x.size() / 4]; };
  for (int64_t v = 0; v < V; ++v)
    printf("fmt %d %-20s share %.0f%% (q1 %.0f q3 %.0f) | time / %s: %.3f (q1 %.3f q3 %.3f)\n", fmt, vars[v].name,
           100 * med(share[v]), 100 * q1(share[v]), 100 * q3(share[v]), vars[0].name, med(ratio[v]), q1(ratio[v]),
           q3(ratio[v]));
}
