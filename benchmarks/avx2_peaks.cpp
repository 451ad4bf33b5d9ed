// This host's AVX2 ceilings for the expert kernels' inner instructions, in inline asm (10 independent
// accumulator chains, no loads): float32 FMA (bf16 / dequantised weights), vpmaddwd + vpaddd (int8
// codes on int8 activations), vpmaddubsw + vpaddw (uint4 codes). On 1 and 2 threads; ops counted as
// the benchmarks count FLOPs, 2 per multiply-add (16, 32 and 64 per instruction pair).
// bench_expert_kernels.py's "GEMM roof" is oneDNN's GEMM, not these.
//
//   g++ -O2 -fopenmp -std=c++17 benchmarks/avx2_peaks.cpp -o /tmp/avx2_peaks && flock /tmp/cpu.lock /tmp/avx2_peaks
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <initializer_list>

#define R10(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define FMA(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define MWD(i) "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\tvpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"
#define MUB(i) "vpmaddubsw %%ymm14, %%ymm15, %%ymm13\n\tvpaddw %%ymm13, %%ymm" #i ", %%ymm" #i "\n\t"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm12", "xmm13"

template <int K>
void body(long n) {
  for (long it = 0; it < n; ++it) {
    if constexpr (K == 0) asm volatile(R10(FMA)::: CLOBBER);
    if constexpr (K == 1) asm volatile(R10(MWD)::: CLOBBER);
    if constexpr (K == 2) asm volatile(R10(MUB)::: CLOBBER);
  }
}

template <int K>
void probe(const char* name, double ops) {
  const long n = 40000000;
  for (int nt : {1, 2}) {
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nt)
      body<K>(n);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, nt * n * 10.0 / s);
    }
    std::printf("%-26s %d thread(s): %.2f G instr/s = %.1f G ops/s\n", name, nt, best / 1e9, best * ops / 1e9);
  }
}

int main() {
  probe<0>("vfmadd231ps ymm", 16);
  probe<1>("vpmaddwd + vpaddd ymm", 32);
  probe<2>("vpmaddubsw + vpaddw ymm", 64);
}
