// AVX-512 + AVX512-BF16 instantiations: as isa_avx512.cpp, but a bf16 cache's scores use
// the bf16 dot-product instruction on the stored bytes. Reached only after the CPU check.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include "simd_avx512bf16.h"
#include "attend_kernel.h"

namespace {
moelight::AttnFn lookup(moelight::KvDtype dtype, int64_t d) { return select_attn<VecAvx512Bf16>(dtype, d); }
}  // namespace
#pragma GCC pop_options

moelight::AttnFn moelight::avx512bf16_attn_fn(KvDtype dtype, int64_t d) { return lookup(dtype, d); }
#else
moelight::AttnFn moelight::avx512bf16_attn_fn(KvDtype, int64_t) { return nullptr; }
#endif
