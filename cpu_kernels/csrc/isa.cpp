// Picks the kernel ISA from the running CPU (or a test override via set_isa).
#include <atomic>
#include <cstring>

#include "experts.h"
#include "kernels.h"

namespace moelight {
namespace {

enum Isa : int { kUnset = -1, kNone = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
std::atomic<int> g_isa{kUnset};

int detect() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    if (!(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"))) return kAvx512;
    // AMX: the CPU has it and the OS grants the tile state (amx_expert_isa asks once)
    return __builtin_cpu_supports("amx-bf16") && amx_expert_isa() != nullptr ? kAmx : kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;  // F16C comes with them
#endif
  return kNone;
}

int current() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa == kUnset) {
    isa = detect();
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return isa;
}

}  // namespace

AttnFn attn_fn(KvDtype dtype, int64_t d) {
  switch (current()) {
    case kAmx:
    case kAvx512Bf16: return avx512bf16_attn_fn(dtype, d);
    case kAvx512: return avx512_attn_fn(dtype, d);
    case kAvx2: return avx2_attn_fn(dtype, d);
    default: return nullptr;
  }
}

// AVX-512 without its bf16 dot product (Skylake-X, Cascade Lake, Ice Lake): the AVX2 expert kernels,
// with VNNI's int8-activation products for int8 / int4 strips at every row count where the CPU has
// them (the same outputs as AVX2's, bit for bit).
const ExpertIsa* avx512_expert_isa() {
  static const ExpertIsa isa = [] {
    ExpertIsa t = *avx2_expert_isa();
    with_vnni_products(t);
    return t;
  }();
  return &isa;
}

const ExpertIsa* expert_isa() {
  switch (current()) {
    case kAmx: return amx_expert_isa();
    case kAvx512Bf16: return avx512bf16_expert_isa();
    case kAvx512: return avx512_expert_isa();
    case kAvx2: return avx2_expert_isa();
    default: return nullptr;
  }
}

const char* active_isa() {
  switch (current()) {
    case kAmx: return "amx";
    case kAvx512Bf16: return "avx512bf16";
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "none";
  }
}

const char* set_isa(const char* name) {
  const int best = detect();
  int want = best;
  if (std::strcmp(name, "avx2") == 0) want = best >= kAvx2 ? kAvx2 : best;
  if (std::strcmp(name, "avx512") == 0) want = best >= kAvx512 ? kAvx512 : best;
  if (std::strcmp(name, "avx512bf16") == 0) want = best >= kAvx512Bf16 ? kAvx512Bf16 : best;
  if (std::strcmp(name, "amx") == 0) want = best;
  if (std::strcmp(name, "none") == 0) want = kNone;
  g_isa.store(want, std::memory_order_relaxed);
  return active_isa();
}

}  // namespace moelight
