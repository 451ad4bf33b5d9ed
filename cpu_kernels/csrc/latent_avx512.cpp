// AVX-512 instantiations of the latent decode kernel. Only the code between the pragmas is compiled
// for the ISA; it is reached only after the CPU check in isa.cpp (latent_attention.cpp dispatches).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "latent_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include "simd_avx512.h"
#include "latent_kernel.h"

namespace {
moelight::LatentFn lookup(moelight::KvDtype dtype, int64_t dk, int64_t dv) {
  return select_latent<VecAvx512>(dtype, dk, dv);
}
}  // namespace
#pragma GCC pop_options

moelight::LatentFn moelight::avx512_latent_fn(KvDtype dtype, int64_t dk, int64_t dv) { return lookup(dtype, dk, dv); }
#else
moelight::LatentFn moelight::avx512_latent_fn(KvDtype, int64_t, int64_t) { return nullptr; }
#endif
