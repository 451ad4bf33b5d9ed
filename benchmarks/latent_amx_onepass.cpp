// Issue #31's one-pass experiment (benchmarks/results/latent_attention_one_pass.md), for
// benchmarks/latent_amx_ceiling.cpp's `o` modes: latent_amx_grouped.h's kernel at every item length and
// a chosen group size (the engine takes G = 4 for items over 128 keys only). It includes latent_amx.cpp;
// link this file instead of that one.
// LATENT_ONEPASS_G=0 (the two-pass kernel, whatever the length), 1, 2 (default), 3, 4, 8 or 16: blocks of 16 keys per pass (8, 16: two passes over
// each group of 128 / 256 keys, the accumulator carried between groups).
// It also holds the staged experiment (latent_amx_staged.h, amx_latent_staged_fn: the driver's `s` modes).
#include "latent_amx.cpp"

#include <cstdlib>

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

namespace {

#include "latent_amx_staged.h"

template <int DK, int DV>
void latent_attend_amx_onepass_any(const moelight::LatentArgs& a) {
  static const int g = [] {
    const char* e = std::getenv("LATENT_ONEPASS_G");
    return e != nullptr ? std::atoi(e) : 2;
  }();
  if (a.tile_major || a.heads % 16 != 0 || g == 0) {  // 0: the two-pass kernel at every item length
    latent_attend_amx<DK, DV, false>(a);
  } else if (g == 1) {
    latent_attend_amx_grouped<DK, DV, 1>(a);
  } else if (g == 3) {
    latent_attend_amx_grouped<DK, DV, 3>(a);
  } else if (g == 4) {
    latent_attend_amx_grouped<DK, DV, 4>(a);
  } else if (g == 8) {
    latent_attend_amx_grouped<DK, DV, 8>(a);
  } else if (g == 16) {
    latent_attend_amx_grouped<DK, DV, 16>(a);
  } else {
    latent_attend_amx_grouped<DK, DV, 2>(a);
  }
}

}  // namespace
#pragma GCC pop_options

namespace moelight {

LatentFn amx_latent_onepass_fn(KvDtype dtype, int64_t dk, int64_t dv) {
  if (dtype != KvDtype::BF16 || !amx_usable()) return nullptr;
  if (dk == 576 && dv == 512) return &latent_attend_amx_onepass_any<576, 512>;
  if (dk == 96 && dv == 64) return &latent_attend_amx_onepass_any<96, 64>;
  return nullptr;
}

LatentFn amx_latent_staged_fn(KvDtype dtype, int64_t dk, int64_t dv) {
  if (dtype != KvDtype::BF16 || !amx_usable()) return nullptr;
  if (dk == 576 && dv == 512) return &latent_attend_amx_staged<576, 512>;
  if (dk == 96 && dv == 64) return &latent_attend_amx_staged<96, 64>;
  return nullptr;
}

}  // namespace moelight
#else
namespace moelight {
LatentFn amx_latent_onepass_fn(KvDtype, int64_t, int64_t) { return nullptr; }
LatentFn amx_latent_staged_fn(KvDtype, int64_t, int64_t) { return nullptr; }
}  // namespace moelight
#endif
