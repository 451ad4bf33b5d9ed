// Scratch harness (torch-free) for the AMX-BF16 expert kernel at T = 256 on bench-1b's shape: the
// fused op's two strip loops as expert_mix.cpp runs them (gate/up items largest expert first in
// RunQueue runs of 8 strips, down runs of 8 output strips over every expert, 2 OpenMP threads, the
// next strip read ahead into L2 a few lines per k-block step), with stand-in epilogues, no gather.
// Row counts are bench-1b's at T = 256 (71 59 60 61 69 56 81 55 pairs); weights in 4 copies on huge
// pages, rotated per call (cold). Results: benchmarks/results/expert_amx_bf16_t256.md.
//
//   g++ -O2 -fopenmp -mamx-tile -mamx-bf16 -mavx512f -mavx512bw -o h expert_amx_t256_harness.cpp
//   ./h VARIANT HOT RUN13 CALLS HINT
//   VARIANT 0: the op's tile loop (2 x 2 C tiles, a 1 x 2 tail); 1: 48-row passes (3 x 2 C tiles) where
//     48 or more rows remain, except at 64; 2: K in chunks of 8 k-blocks, every row pass per chunk.
//   HOT 0: cold weights; 1: each expert's strip 0 for all its strips (in L2); 2: the tiles read strip 0
//     but the read-ahead reads the true next strip (what the read-ahead's traffic alone costs).
//   HINT: the read-ahead's prefetch hint, 1 T1 (the op), 2 T2, 3 NTA, 4 T0.
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct alignas(64) TileConfig { uint8_t palette = 1; uint8_t start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static void begin() { TileConfig cfg; for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; } asm volatile("ldtilecfg %0" : : "m"(cfg)); }

static int g_hint = 1;  // 1: T1, 2: T2, 0: T0
struct NextStrip {
  const char* p; const char* end; int64_t per_step;
  NextStrip(const uint8_t* next, int64_t bytes, int64_t steps) : p((const char*)next), end(next ? p + bytes : p), per_step((bytes / 64 + steps - 1) / steps) {}
  inline void step() {
    if (g_hint == 1) for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
    else if (g_hint == 2) for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T2);
    else if (g_hint == 3) for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_NTA);
    else if (g_hint == 4) for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
};

// one pass of the op's loop over 32 rows (2 x 2 C tiles) and over 16 (its 1 x 2 tail), at rows r..
static inline void pass32(const uint16_t* a0, const uint16_t* b, int64_t k, int64_t kb, NextStrip& ahead, float* c0, int64_t ldc) {
  const uint16_t* a1 = a0 + 16 * k; const int64_t sc = ldc * 4;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < kb; ++i) {
    ahead.step();
    _tile_loadd(4, a0 + i * 512, 64); _tile_loadd(6, b + i * 1024, 128); _tile_loadd(7, b + i * 1024 + 32, 128); _tile_loadd(5, a1 + i * 512, 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, sc); _tile_stored(1, c0 + 16, sc); _tile_stored(2, c0 + 16 * ldc, sc); _tile_stored(3, c0 + 16 * ldc + 16, sc);
}

static inline void pass16(const uint16_t* a0, const uint16_t* b, int64_t kb, NextStrip& ahead, float* c0, int64_t ldc) {
  _tile_zero(0); _tile_zero(1);
  for (int64_t i = 0; i < kb; ++i) {
    ahead.step();
    _tile_loadd(4, a0 + i * 512, 64); _tile_loadd(6, b + i * 1024, 128); _tile_loadd(7, b + i * 1024 + 32, 128);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, c0, ldc * 4); _tile_stored(1, c0 + 16, ldc * 4);
}

// variant 0: the op's loop (2x2 then a 1x2 tail)
static void gemm0(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next, int64_t nb, float* c, int64_t ldc) {
  const int64_t kb = k / 32, rows = (m + 15) / 16 * 16;
  NextStrip ahead(next, nb, (rows + 31) / 32 * kb);
  int64_t r = 0;
  for (; r + 32 <= rows; r += 32) pass32(a + r * k, b, k, kb, ahead, c + r * ldc, ldc);
  if (r < rows) pass16(a + r * k, b, kb, ahead, c + r * ldc, ldc);
}

// variant 1: 48-row passes (3x2 C tiles: 0-5, A in 6, B in 7, B reloaded) where >= 48 rows remain
// and the rest isn't 16 (so 64 stays 32+32, 80 = 48+32, 96 = 48+48)
static void gemm1(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next, int64_t nb, float* c, int64_t ldc) {
  const int64_t kb = k / 32, sc = ldc * 4, rows = (m + 15) / 16 * 16;
  int64_t passes = 0;
  { int64_t r = rows; while (r > 0) { if (r >= 48 && r != 64) r -= 48; else if (r >= 32) r -= 32; else r -= 16; ++passes; } }
  NextStrip ahead(next, nb, passes * kb);
  int64_t r = 0;
  while (r < rows) {
    const int64_t left = rows - r;
    if (left >= 48 && left != 64) {
      const uint16_t* a0 = a + r * k; const uint16_t* a1 = a0 + 16 * k; const uint16_t* a2 = a1 + 16 * k;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
      for (int64_t i = 0; i < kb; ++i) {
        ahead.step();
        const uint16_t* b0 = b + i * 1024;
        _tile_loadd(6, a0 + i * 512, 64); _tile_loadd(7, b0, 128); _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(6, a1 + i * 512, 64); _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(6, a2 + i * 512, 64); _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, b0 + 32, 128); _tile_dpbf16ps(5, 6, 7);
        _tile_loadd(6, a1 + i * 512, 64); _tile_dpbf16ps(3, 6, 7);
        _tile_loadd(6, a0 + i * 512, 64); _tile_dpbf16ps(1, 6, 7);
      }
      float* c0 = c + r * ldc;
      _tile_stored(0, c0, sc); _tile_stored(1, c0 + 16, sc); _tile_stored(2, c0 + 16 * ldc, sc); _tile_stored(3, c0 + 16 * ldc + 16, sc);
      _tile_stored(4, c0 + 32 * ldc, sc); _tile_stored(5, c0 + 32 * ldc + 16, sc);
      r += 48;
    } else if (left >= 32) {
      pass32(a + r * k, b, k, kb, ahead, c + r * ldc, ldc);
      r += 32;
    } else {
      pass16(a + r * k, b, kb, ahead, c + r * ldc, ldc);
      r += 16;
    }
  }
}


// variant 2: K in chunks of 8 k-blocks, every row pass per chunk (the chunk's B reused from L1), C through memory
static void gemm2(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next, int64_t nb, float* c, int64_t ldc) {
  const int64_t kb = k / 32, sc = ldc * 4, rows = (m + 15) / 16 * 16, CK = 8;
  NextStrip ahead(next, nb, (rows + 31) / 32 * kb);
  for (int64_t k0 = 0; k0 < kb; k0 += CK) {
    const int64_t k1 = std::min(kb, k0 + CK);
    int64_t r = 0;
    for (; r + 32 <= rows; r += 32) {
      const uint16_t* a0 = a + r * k; const uint16_t* a1 = a0 + 16 * k;
      float* c0 = c + r * ldc;
      if (k0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
      else { _tile_loadd(0, c0, sc); _tile_loadd(1, c0 + 16, sc); _tile_loadd(2, c0 + 16 * ldc, sc); _tile_loadd(3, c0 + 16 * ldc + 16, sc); }
      for (int64_t i = k0; i < k1; ++i) {
        ahead.step();
        _tile_loadd(4, a0 + i * 512, 64); _tile_loadd(6, b + i * 1024, 128); _tile_loadd(7, b + i * 1024 + 32, 128); _tile_loadd(5, a1 + i * 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, sc); _tile_stored(1, c0 + 16, sc); _tile_stored(2, c0 + 16 * ldc, sc); _tile_stored(3, c0 + 16 * ldc + 16, sc);
    }
    if (r < rows) {
      const uint16_t* a0 = a + r * k; float* c0 = c + r * ldc;
      if (k0 == 0) { _tile_zero(0); _tile_zero(1); } else { _tile_loadd(0, c0, sc); _tile_loadd(1, c0 + 16, sc); }
      for (int64_t i = k0; i < k1; ++i) {
        ahead.step();
        _tile_loadd(4, a0 + i * 512, 64); _tile_loadd(6, b + i * 1024, 128); _tile_loadd(7, b + i * 1024 + 32, 128);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, c0, sc); _tile_stored(1, c0 + 16, sc);
    }
  }
}

struct RunQueue {
  std::atomic<int64_t> taken{0}; int64_t n, run;
  RunQueue(int64_t items, int64_t rl) : n(items), run(rl) {}
  int64_t claim() { return taken.fetch_add(run, std::memory_order_relaxed); }
  template <class F> void each(F f) {
    for (int64_t cur = claim(), nxt; cur < n; cur = nxt) { nxt = claim(); const int64_t end = std::min(n, cur + run); for (int64_t i = cur; i < end; ++i) f(i, i + 1 < end ? i + 1 : nxt); }
  }
};

static void* huge(size_t bytes) {
  bytes = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = aligned_alloc(2 << 20, bytes); madvise(p, bytes, MADV_HUGEPAGE); memset(p, 1, bytes); return p;
}

int main(int argc, char** argv) {
  int variant = argc > 1 ? atoi(argv[1]) : 0;
  int hot = argc > 2 ? atoi(argv[2]) : 0;
  int run13 = argc > 3 ? atoi(argv[3]) : 8;
  int calls = argc > 4 ? atoi(argv[4]) : 14;
  g_hint = argc > 5 ? atoi(argv[5]) : 1;
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int E = 8, H = 1024, F = 3584, NC = 4, T = 256, TOP = 2;
  const int64_t cnt[E] = {71, 59, 60, 61, 69, 56, 81, 55};
  int64_t rows[E], row0[E + 1]; row0[0] = 0;
  for (int e = 0; e < E; ++e) { rows[e] = (cnt[e] + 15) / 16 * 16; row0[e + 1] = row0[e] + rows[e]; }
  const int64_t S13 = 2 * F / 32, S2 = H / 32, B13 = (int64_t)H * 32 * 2, B2 = (int64_t)F * 32 * 2;
  const int64_t wbytes = E * (S13 * B13 + S2 * B2);
  std::vector<uint8_t*> w(NC);
  for (int c = 0; c < NC; ++c) { w[c] = (uint8_t*)huge(wbytes); uint16_t* q = (uint16_t*)w[c]; for (int64_t i = 0; i < wbytes / 2; i += 7) q[i] = 0x3c00 + (i & 0xff); }
  uint16_t* a13 = (uint16_t*)huge(row0[E] * H * 2); uint16_t* a2 = (uint16_t*)huge(row0[E] * F * 2);
  for (int64_t i = 0; i < row0[E] * H; ++i) a13[i] = 0x3c00 + (i & 0x7f);
  for (int64_t i = 0; i < row0[E] * F; ++i) a2[i] = 0x3c00 + (i & 0x7f);
  std::vector<float> y(T * H);
  std::vector<int> busy(E); for (int e = 0; e < E; ++e) busy[e] = e;
  std::stable_sort(busy.begin(), busy.end(), [&](int x, int z) { return cnt[x] > cnt[z]; });
  struct It { int e; int64_t j; }; std::vector<It> items; for (int e : busy) for (int64_t j = 0; j < S13; ++j) items.push_back({e, j});
  const int64_t n13 = items.size(), run2 = S2 / 4, runs2 = 4;
  auto gemm = variant == 1 ? gemm1 : variant == 2 ? gemm2 : gemm0;
  std::vector<double> tt, tg, td;
  for (int call = 0; call < calls; ++call) {
    uint8_t* wc = w[call % NC];
    auto s13 = [&](int e, int64_t j) { return wc + (hot == 1 ? (int64_t)e * S13 * B13 : ((int64_t)e * S13 + j) * B13); };
    uint8_t* w2 = wc + E * S13 * B13;
    auto s2 = [&](int e, int64_t j) { return w2 + (hot == 1 ? (int64_t)e * S2 * B2 : ((int64_t)e * S2 + j) * B2); };
    RunQueue q13(n13, run13), q2(runs2, 1);
    double t0 = omp_get_wtime(), t1 = 0;
    #pragma omp parallel num_threads(2)
    {
      std::vector<float> c(96 * 32);
      begin();
      q13.each([&](int64_t i, int64_t after) {
        const int e = items[i].e; const int64_t j = items[i].j;
        const uint8_t* next = after < n13 ? s13(items[after].e, items[after].j) : nullptr;
        gemm(a13 + row0[e] * H, rows[e], (const uint16_t*)(hot == 2 ? wc + (int64_t)e * S13 * B13 : s13(e, j)), H, next, B13, c.data(), 32);
        // epilogue stand-in: 16 bf16 columns per row into a2's tiles
        for (int64_t r = 0; r < rows[e]; ++r) { uint16_t* d = a2 + row0[e] * F + (r / 16) * 16 * F + (j * 16 / 32) * 512 + (r % 16) * 32 + (j * 16) % 32; for (int q = 0; q < 16; ++q) { float g = c[r * 32 + q], u = c[r * 32 + 16 + q]; float v = g * u; uint32_t b; memcpy(&b, &v, 4); d[q] = b >> 16; } }
      });
      #pragma omp barrier
      #pragma omp master
      t1 = omp_get_wtime();
      q2.each([&](int64_t run, int64_t after) {
        const int64_t j0 = run * run2, j1 = std::min(S2, j0 + run2);
        for (int u = 0; u < E; ++u) {
          for (int64_t j = j0; j < j1; ++j) {
            const uint8_t* next = j + 1 < j1 ? s2(u, j + 1) : u + 1 < E ? s2(u + 1, j0) : after < runs2 ? s2(0, after * run2) : nullptr;
            gemm(a2 + row0[u] * F, rows[u], (const uint16_t*)(hot == 2 ? w2 + (int64_t)u * S2 * B2 : s2(u, j)), F, next, B2, c.data(), 32);
            for (int64_t r = 0; r < cnt[u]; ++r) { float* d = y.data() + ((r * 7 + u) % T) * H + j * 32; for (int q = 0; q < 32; ++q) d[q] += c[r * 32 + q] * 0.5f; }
          }
        }
      });
      _tile_release();
    }
    double t2 = omp_get_wtime();
    if (call >= 2) { tt.push_back((t2 - t0) * 1e3); tg.push_back((t1 - t0) * 1e3); td.push_back((t2 - t1) * 1e3); }
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  auto mn = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()); };
  printf("hint %d variant %d hot %d run13 %d: total med %.2f min %.2f | gate/up med %.2f | down med %.2f  (%.1f GB/s)\n", g_hint, variant, hot, run13, med(tt), mn(tt), med(tg), med(td), wbytes / med(tt) / 1e6);
}
