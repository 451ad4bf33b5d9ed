// AVX2 + FMA + F16C instantiations of the attention tile kernel (CPUs without AVX-512).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "attend_kernel.h"

namespace {
moelight::AttnFn lookup(moelight::KvDtype dtype, int64_t d) { return select_attn<VecAvx2>(dtype, d); }
}  // namespace
#pragma GCC pop_options

moelight::AttnFn moelight::avx2_attn_fn(KvDtype dtype, int64_t d) { return lookup(dtype, d); }
#else
moelight::AttnFn moelight::avx2_attn_fn(KvDtype, int64_t) { return nullptr; }
#endif
