// How fast VNNI's int8-activation products (expert_isa_avx512vnni.cpp's iqgemm) stream bench-1b's
// experts at one row, without the rest of the expert op: 8 layers, each thread one expert per layer
// (224 gate/up strips of K = 1024, then 32 down strips of K = 3584), each layer one OpenMP region,
// codes and scales on 2 MiB pages, a 512 MB read before each pass (which also gives the same run's
// read bandwidth). No torch: it links the VNNI unit alone.
//
//   g++ -O3 -fopenmp -fno-math-errno -Icpu_kernels/csrc benchmarks/expert_vnni_stream_ceiling.cpp
//       cpu_kernels/csrc/expert_isa_avx512vnni.cpp -o /tmp/vnni_ceiling   (one line)
//   flock /tmp/cpu.lock /tmp/vnni_ceiling 3 15     # format (3: int4, 1: int8), passes
#include <omp.h>
#include <sys/mman.h>
#include <x86intrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "driver_buffers.h"
#include "experts.h"
using namespace moelight;
int main(int argc, char** argv) {
  const int fmt = atoi(argv[1]), passes = atoi(argv[2]);
  ExpertIsa t{};
  with_vnni_products(t);
  const int64_t E = 8, L = 8, H = 1024, F = 3584, s13n = 2 * F / 32, s2n = H / 32;
  const int64_t b13 = fmt == 3 ? H * 16 : H * 32, b2 = fmt == 3 ? F * 16 : F * 32;
  std::vector<uint8_t*> w13(L), w2(L); std::vector<float*> sc13(L), sc2(L);
  for (int l = 0; l < L; ++l) {
    w13[l] = (uint8_t*)huge(E * s13n * b13); w2[l] = (uint8_t*)huge(E * s2n * b2);
    sc13[l] = (float*)huge(E * s13n * (H / 128) * 32 * 4); sc2[l] = (float*)huge(E * s2n * (F / 128) * 32 * 4);
  }
  const size_t fb = 512ull << 20;
  uint64_t* flush = (uint64_t*)huge(fb);
  std::vector<int8_t> q(F, 3); std::vector<float> as(F / 32, 0.1f); std::vector<int32_t> su(F / 32, 96);
  QuantRows a1{q.data(), as.data(), su.data(), H}, a2{q.data(), as.data(), su.data(), F};
  std::vector<double> ks, rs;
  uint64_t cyc[2] = {};
  for (int pass = 0; pass < passes; ++pass) {
    const double flush_s = flush_read(flush, fb);  // the pass's read-bandwidth probe
    const double t1 = now();
    for (int l = 0; l < L; ++l) {
      const int e0 = (pass * 3 + l) % E, e1 = (e0 + 3) % E;
#pragma omp parallel num_threads(2)
      {
        const int tid = omp_get_thread_num();
        const int64_t e = tid ? e1 : e0;
        float c[128];
        uint64_t c0 = __rdtsc();
        for (int64_t j = 0; j < s13n; ++j) {
          Strip st{w13[l] + (e * s13n + j) * b13, sc13[l] + (e * s13n + j) * (H / 128) * 32, nullptr, H, 128, (WFormat)fmt};
          t.iqgemm(a1, 1, st, c, 32);
        }
        uint64_t c1 = __rdtsc();
        for (int64_t j = 0; j < s2n; ++j) {
          Strip st{w2[l] + (e * s2n + j) * b2, sc2[l] + (e * s2n + j) * (F / 128) * 32, nullptr, F, 128, (WFormat)fmt};
          t.iqgemm(a2, 1, st, c, 32);
        }
        if (tid == 0) { cyc[0] += c1 - c0; cyc[1] += __rdtsc() - c1; }
      }
    }
    double t2 = now();
    const double bytes = L * 2.0 * (s13n * b13 + s2n * b2 + (s13n * H / 128 + s2n * F / 128) * 128);
    rs.push_back(fb / flush_s / 1e9); ks.push_back(bytes / (t2 - t1) / 1e9);
  }
  std::sort(ks.begin(), ks.end()); std::sort(rs.begin(), rs.end());
  printf("fmt %d: kernel %.1f GB/s (median), read %.1f GB/s, share %.0f%% | gateup %.0f down %.0f kcyc/layer\n", fmt, ks[passes / 2], rs[passes / 2], 100 * ks[passes / 2] / rs[passes / 2], cyc[0] / 1e3 / passes / L, cyc[1] / 1e3 / passes / L);
}
