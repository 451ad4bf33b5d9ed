// How fast the AVX2 expert kernels stream Mixtral-8x7B-shaped experts at one row (a batch-1 decode
// step's expert work), without the rest of the expert op: L layers of 8 experts (hidden 4096, width
// 14336), 2 routed per layer, one per thread (896 gate/up strips of K = 4096, then 128 down strips of
// K = 14336), each layer one OpenMP region, weights on 2 MiB pages, a 512 MB read before each pass
// (the same pass's read bandwidth: kernel/read is the share of it the kernel reaches). Formats as
// --quantize gives them: 0 bf16, 1 int8 (per column), 3 int4 (group 128 with a zero point).
// No torch: it links the AVX2 unit alone.
//
//   g++ -O3 -fopenmp -fno-math-errno -Icpu_kernels/csrc -Ibenchmarks benchmarks/expert_avx2_stream_ceiling.cpp
//       cpu_kernels/csrc/expert_isa_avx2.cpp -o /tmp/avx2_ceiling   (one line)
//   flock /tmp/cpu.lock /tmp/avx2_ceiling 3 9 3     # format, passes, layers (int4: ~0.7 GB a layer)
//
// A/B against another commit's unit, alternated pass by pass in one process (the host's speed drifts
// between minutes): build that unit under another name and link both, with -DAB:
//   git worktree add /tmp/base COMMIT && g++ -O3 -fopenmp -fno-math-errno -c -Davx2_expert_isa=avx2_expert_isa_base
//       -I/tmp/base/cpu_kernels/csrc /tmp/base/cpu_kernels/csrc/expert_isa_avx2.cpp -o /tmp/base.o
//   g++ ... -DAB benchmarks/expert_avx2_stream_ceiling.cpp cpu_kernels/csrc/expert_isa_avx2.cpp /tmp/base.o
// It prints the per-pair ratio (this tree's GB/s over the base's) beside the figures of both together.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "driver_buffers.h"
#include "experts.h"
using namespace moelight;
#ifdef AB
namespace moelight {
const ExpertIsa* avx2_expert_isa_base();
}
#endif

int main(int argc, char** argv) {
  if (argc < 4) return fprintf(stderr, "usage: %s FORMAT(0|1|3) PASSES LAYERS\n", argv[0]), 2;
  const int fmt = atoi(argv[1]), passes = atoi(argv[2]), L = atoi(argv[3]);
#ifdef AB
  const ExpertIsa* isas[2] = {avx2_expert_isa_base(), avx2_expert_isa()};  // even passes: the base
#else
  const ExpertIsa* isas[2] = {avx2_expert_isa(), avx2_expert_isa()};
#endif
  if (!isas[0] || !isas[1]) return fprintf(stderr, "no AVX2 unit in this build\n"), 1;
  const ExpertIsa* isa = isas[0];
  const int64_t E = 8, H = 4096, F = 14336, s13n = 2 * F / 32, s2n = H / 32;
  const bool q = fmt != 0, zero = fmt == 3;
  const int64_t g13 = fmt == 3 ? 128 : H, g2 = fmt == 3 ? 128 : F;  // k per scale group
  const int64_t per_k = fmt == 3 ? 16 : fmt == 1 ? 32 : 64;           // strip bytes per k
  const int64_t b13 = H * per_k, b2 = F * per_k, sc13 = H / g13 * 32, sc2 = F / g2 * 32;
  std::vector<uint8_t*> w13(L), w2(L);
  std::vector<float*> s13(L), s2(L), z13(L), z2(L);
  for (int l = 0; l < L; ++l) {
    w13[l] = static_cast<uint8_t*>(huge(E * s13n * b13));
    w2[l] = static_cast<uint8_t*>(huge(E * s2n * b2));
    if (q) s13[l] = static_cast<float*>(huge(E * s13n * sc13 * 4)), s2[l] = static_cast<float*>(huge(E * s2n * sc2 * 4));
    if (zero) z13[l] = static_cast<float*>(huge(E * s13n * sc13 * 4)), z2[l] = static_cast<float*>(huge(E * s2n * sc2 * 4));
  }
  const size_t fb = 512ull << 20;
  const uint64_t* flush = static_cast<uint64_t*>(huge(fb));
  std::vector<int8_t> codes(F, 3);
  std::vector<float> ascale(F / 32, 0.1f);
  std::vector<int32_t> asum(F / 32, 96);
  std::vector<uint16_t> a16(F, 0x3f80);
  const QuantRows a1{codes.data(), ascale.data(), asum.data(), H}, a2{codes.data(), ascale.data(), asum.data(), F};
  const auto strip = [&](uint8_t* w, float* s, float* z, int64_t i, int64_t bytes, int64_t sc, int64_t k, int64_t g) {
    return Strip{w + i * bytes, q ? s + i * sc : nullptr, zero ? z + i * sc : nullptr, k, g, static_cast<WFormat>(fmt)};
  };
  const auto call = [&](const Strip& st, const QuantRows& a, float* c) {
    if (q) isa->iqgemm(a, 1, st, c, 32);
    else isa->gemm(a16.data(), st.k, 1, reinterpret_cast<const uint16_t*>(st.codes), st.k, c, 32);
  };
  std::vector<double> ks, rs, shares, by_unit[2];
  for (int pass = 0; pass < passes; ++pass) {
    isa = isas[pass % 2];
    const double flush_s = flush_read(flush, fb);
    const double t1 = now();
    for (int l = 0; l < L; ++l) {
      const int e0 = (pass * 3 + l) % E, e1 = (e0 + 3) % E;
#pragma omp parallel num_threads(2)
      {
        const int64_t e = omp_get_thread_num() ? e1 : e0;
        float c[32];
        for (int64_t j = 0; j < s13n; ++j) call(strip(w13[l], s13[l], z13[l], e * s13n + j, b13, sc13, H, g13), a1, c);
        for (int64_t j = 0; j < s2n; ++j) call(strip(w2[l], s2[l], z2[l], e * s2n + j, b2, sc2, F, g2), a2, c);
      }
    }
    const double t2 = now();
    const double bytes = L * 2.0 * (s13n * (b13 + (q + zero) * sc13 * 4) + s2n * (b2 + (q + zero) * sc2 * 4));
    rs.push_back(fb / flush_s / 1e9);
    ks.push_back(bytes / (t2 - t1) / 1e9);
    shares.push_back(ks.back() / rs.back());
    by_unit[pass % 2].push_back(ks.back());
  }
#ifdef AB
  std::vector<double> ratio;
  for (size_t i = 0; i < by_unit[1].size(); ++i) ratio.push_back(by_unit[1][i] / by_unit[0][i]);
  std::sort(ratio.begin(), ratio.end());
  printf("this tree / base, per pair of passes: %.2f / %.2f / %.2f (min / median / max of %zu)\n", ratio[0],
         ratio[ratio.size() / 2], ratio.back(), ratio.size());
#endif
  for (auto* v : {&ks, &rs, &shares}) std::sort(v->begin(), v->end());
  const int mid = passes / 2;
  printf("format %d: kernel %.1f / %.1f / %.1f GB/s (min / median / max), read %.1f GB/s, kernel/read %.2f / %.2f / %.2f\n",
         fmt, ks[0], ks[mid], ks.back(), rs[mid], shares[0], shares[mid], shares.back());
}
