// Where AVX2's int4 / MXFP4 tiles (iq4_many_rows: a k-block unpacked once for all rows) overtake the
// few-row kernel (iqgemm_format: pairs of rows, the first pass prefetching the strip) on int8 activations:
// both over 512 MiB of strips (read from DRAM, as a decode step reads a layer's experts), split over 2
// threads, alternated `rounds` times at each row count; GOP/s best (median) and the time ratio of the medians.
// The two give the same bits (tests/test_expert_avx2_int4_tiles.py), so csrc/expert_iq_avx2.h's
// kIq4ManyRows is only a speed choice.
//
//   g++ -O3 -fopenmp -fno-math-errno -mavx2 -mfma -mf16c -Icpu_kernels/csrc \
//       benchmarks/expert_iq4_rows_crossover.cpp -o /tmp/iq4_rows
//   /tmp/iq4_rows <K> <group> uint4|mxfp4 <rounds> <rows> [<rows> ...]
//   e.g. /tmp/iq4_rows 2880 32 mxfp4 5 2 4 6 8 12 16     (GPT-OSS-20B's experts; MXFP4's group is 32)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "expert_iq_avx2.h"

using moelight::QuantRows;
using moelight::Strip;
using moelight::WFormat;

template <WFormat F>
static void strips_pass(bool tiles, const QuantRows& a, int m, const std::vector<Strip>& strips, float* c) {
#pragma omp parallel num_threads(2)
  {
    float* out = c + omp_get_thread_num() * m * 32;
#pragma omp for schedule(static)
    for (size_t s = 0; s < strips.size(); ++s) {
      if (tiles) iq4_many_rows<F>(a, m, strips[s], out, 32);
      else iqgemm_format<F>(a, m, strips[s], out, 32);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s <K> <group> uint4|mxfp4 <rounds> <rows> [<rows> ...]\n", argv[0]);
    return 2;
  }
  const int64_t k = std::atoi(argv[1]);
  const bool fp4 = std::strcmp(argv[3], "mxfp4") == 0;
  const int64_t group = fp4 ? 32 : std::atoi(argv[2]);
  const int rounds = std::atoi(argv[4]);
  if (k <= 0 || k % 32 || group <= 0 || k % group || group % 32 || rounds < 1) {
    std::fprintf(stderr, "K and the group must be multiples of 32 (K of the group), rounds at least 1\n");
    return 2;
  }
  for (int arg = 5; arg < argc; ++arg)
    if (std::atoi(argv[arg]) < 1) {
      std::fprintf(stderr, "rows per expert '%s': give whole numbers of 1 or more\n", argv[arg]);
      return 2;
    }
  const int64_t strip_bytes = k / 2 * 32, n = (int64_t(512) << 20) / strip_bytes;
  std::vector<uint8_t> codes(n * strip_bytes);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  std::vector<float> scales(n * (k / group) * 32, 0.01f), bias(fp4 ? 0 : scales.size(), -0.08f);
  std::vector<Strip> strips;
  for (int64_t s = 0; s < n; ++s)
    strips.push_back(Strip{codes.data() + s * strip_bytes, scales.data() + s * (k / group) * 32,
                           fp4 ? nullptr : bias.data() + s * (k / group) * 32, k, group,
                           fp4 ? WFormat::FP4 : WFormat::U4});
  std::printf("K %ld, group %ld, %s, %ld strips\n", static_cast<long>(k), static_cast<long>(group),
              fp4 ? "mxfp4" : "uint4", static_cast<long>(n));
  for (int arg = 5; arg < argc; ++arg) {
    const int m = std::atoi(argv[arg]);
    std::vector<int8_t> q(m * k);
    for (auto& x : q) x = static_cast<int8_t>(std::rand() % 255 - 127);
    std::vector<float> act_scale(m * k / 32, 0.01f);
    std::vector<int32_t> act_sum(m * k / 32, 5);
    const QuantRows a{q.data(), act_scale.data(), act_sum.data(), k};
    std::vector<float> c(2 * m * 32);
    std::vector<double> seconds[2];
    for (int r = 0; r < rounds; ++r)
      for (int tiles = 0; tiles < 2; ++tiles) {
        const auto t0 = std::chrono::steady_clock::now();
        if (fp4) strips_pass<WFormat::FP4>(tiles, a, m, strips, c.data());
        else strips_pass<WFormat::U4>(tiles, a, m, strips, c.data());
        seconds[tiles].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    for (auto& t : seconds) std::sort(t.begin(), t.end());
    const double ops = 2.0 * m * k * 32.0 * n / 1e9, mid = rounds / 2;
    std::printf("%2d rows: few-row %.1f (%.1f) GOP/s, tiles %.1f (%.1f); few-row / tiles time %.2f\n", m,
                ops / seconds[0][0], ops / seconds[0][mid], ops / seconds[1][0], ops / seconds[1][mid],
                seconds[0][mid] / seconds[1][mid]);
  }
}
