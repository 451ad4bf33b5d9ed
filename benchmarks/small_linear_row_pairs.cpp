// small_linear_avx512.cpp's one-row loop against variants, at the 16-bit one-row matmuls of a batch-1 decode
// step: Mixtral-8x7B's shape cut to 5 layers (5 x (fused q/k/v 6144 x 4096, o 4096 x 4096) + LM head
// 32000 x 4096, 682 MB: beyond the 480 MB L3 of the AMX host) or, with `b1`, bench-1b's (8 x (1536 x 1024,
// 1024 x 1024) + 32000 x 1024, 107 MB: L3-resident here). Two OpenMP threads split each matrix's rows in
// halves as at::parallel_for does; variants alternate pass by pass; `stream` is a plain read of the same
// weights. `cur` was the engine's loop, `R2 U4 a4K` (two output rows at a time, prefetch 4 KB ahead of each
// stream) is what small_linear_avx512.cpp's row_pairs runs now (benchmarks/results/quantized_decode_mixtral_shape.md).
//
//     g++ -O3 -march=native -fopenmp benchmarks/small_linear_row_pairs.cpp -o /tmp/slp && /tmp/slp 20 [b1]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>

inline __m512 widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int U, int64_t Ahead>
void rows1(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out) {
  const int64_t step = 16 * U, body = k / step * step;
  const uint16_t* end = w + n1 * k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * k;
    __m512 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += step) {
      if (Ahead > 0)
        for (int64_t p = 0; p < step; p += 32)
          if (wr + i + p + Ahead < end) _mm_prefetch(reinterpret_cast<const char*>(wr + i + p + Ahead), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) acc[u] = _mm512_fmadd_ps(widen(wr + i + 16 * u), _mm512_loadu_ps(x + i + 16 * u), acc[u]);
    }
    __m512 s = acc[0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u]);
    out[n] = _mm512_reduce_add_ps(s);
  }
}

// R output rows at once: R interleaved weight streams, x loaded once per step
template <int R, int U, int64_t Ahead>
void rowsR(const float* x, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out) {
  const int64_t step = 16 * U;
  const uint16_t* end = w + n1 * k;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r) for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += step) {
      for (int r = 0; r < R; ++r) {
        const uint16_t* wr = w + (n + r) * k;
        if (Ahead > 0)
          for (int64_t p = 0; p < step; p += 32)
            if (wr + i + p + Ahead < end) _mm_prefetch(reinterpret_cast<const char*>(wr + i + p + Ahead), _MM_HINT_T0);
      }
      for (int u = 0; u < U; ++u) {
        const __m512 xv = _mm512_loadu_ps(x + i + 16 * u);
        for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(widen(w + (n + r) * k + i + 16 * u), xv, acc[r][u]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 s = acc[r][0];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[r][u]);
      out[n + r] = _mm512_reduce_add_ps(s);
    }
  }
  if (n < n1) rows1<4, 1024>(x, w, n, n1, k, out);
}

void stream(const float*, const uint16_t* w, int64_t n0, int64_t n1, int64_t k, float* out) {
  const __m512i* p = reinterpret_cast<const __m512i*>(w + n0 * k);
  const __m512i* e = reinterpret_cast<const __m512i*>(w + n1 * k);
  __m512i a = _mm512_setzero_si512(), b = a;
  for (; p + 1 < e; p += 2) { a = _mm512_xor_si512(a, _mm512_load_si512(p)); b = _mm512_xor_si512(b, _mm512_load_si512(p + 1)); }
  out[n0] = (float)_mm512_reduce_add_epi32(_mm512_xor_si512(a, b));
}

using Fn = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, float*);

int main(int argc, char** argv) {
  const int passes = argc > 1 ? atoi(argv[1]) : 10;
  const bool b1 = argc > 2 && !strcmp(argv[2], "b1");
  const int64_t k = b1 ? 1024 : 4096;
  std::vector<int64_t> ns;
  for (int l = 0; l < (b1 ? 8 : 5); ++l) { ns.push_back(b1 ? 1536 : 6144); ns.push_back(b1 ? 1024 : 4096); }
  ns.push_back(32000);
  std::vector<uint16_t*> ws;
  size_t total = 0;
  for (int64_t n : ns) {
    size_t bytes = (size_t)n * k * 2, al = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    void* p = aligned_alloc(2 << 20, al);
    madvise(p, al, MADV_HUGEPAGE);
    uint16_t* q = (uint16_t*)p;
    for (size_t i = 0; i < (size_t)n * k; ++i) q[i] = 0x3c00 + (i * 2654435761u >> 20) % 512;
    ws.push_back(q);
    total += bytes;
  }
  std::vector<float> x(k, 0.01f), out(32000);
  struct V { const char* name; Fn f; };
  V vs[] = {{"cur U4 a2K", rows1<4, 1024>}, {"U4 a4K", rows1<4, 2048>}, {"U4 a8K", rows1<4, 4096>},
            {"U8 a2K", rows1<8, 1024>}, {"U4 nopf", rows1<4, 0>}, {"R2 U4 a2K", rowsR<2, 4, 1024>},
            {"R2 U4 a4K", rowsR<2, 4, 2048>}, {"R4 U2 a2K", rowsR<4, 2, 1024>}, {"R2 U8 a2K", rowsR<2, 8, 1024>}, {"R2 U4 a1K", rowsR<2, 4, 512>}, {"stream", stream}};
  const int nv = sizeof(vs) / sizeof(vs[0]);
  std::vector<std::vector<double>> t(nv);
  for (int pass = 0; pass < passes; ++pass) {
    for (int j = 0; j < nv; ++j) {
      int v = pass % 2 ? j : nv - 1 - j;
      auto t0 = std::chrono::steady_clock::now();
      for (size_t m = 0; m < ws.size(); ++m) {
        const int64_t n = ns[m];
#pragma omp parallel num_threads(2)
        {
          int tid = omp_get_thread_num();
          int64_t half = (n / 2 + 63) / 64 * 64;
          int64_t n0 = tid ? half : 0, n1 = tid ? n : half;
          vs[v].f(x.data(), ws[m], n0, n1, k, out.data());
        }
      }
      t[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  for (int v = 0; v < nv; ++v) {
    auto& ts = t[v];
    std::sort(ts.begin() + 0, ts.end());
    double med = ts[ts.size() / 2];
    printf("%-12s ms %.2f / %.2f / %.2f  %.1f GB/s\n", vs[v].name, ts[0] * 1e3, med * 1e3, ts.back() * 1e3, total / med / 1e9);
  }
}
