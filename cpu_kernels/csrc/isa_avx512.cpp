// AVX-512 instantiations of the attention tile kernel. Only the code between the pragmas
// is compiled for AVX-512; it is reached only after the CPU check in isa.cpp.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include "simd_avx512.h"
#include "attend_kernel.h"

namespace {
moelight::AttnFn lookup(moelight::KvDtype dtype, int64_t d) { return select_attn<VecAvx512>(dtype, d); }
}  // namespace
#pragma GCC pop_options

moelight::AttnFn moelight::avx512_attn_fn(KvDtype dtype, int64_t d) { return lookup(dtype, d); }
#else
moelight::AttnFn moelight::avx512_attn_fn(KvDtype, int64_t) { return nullptr; }
#endif
