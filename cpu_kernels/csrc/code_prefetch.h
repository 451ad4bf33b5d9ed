// Software prefetch of a quantized strip's codes and group scales for the int8-activation kernels
// (expert_iq_avx2.h, expert_isa_avx512vnni.cpp) at a token or two per expert, where each strip is
// read once, front to back. Its functions have internal linkage (an anonymous namespace), so each ISA
// unit keeps the copy compiled for its own target.
//
// The codes kAhead bytes past block blk's, into L2 (prefetcht2): the hardware prefetcher brings the
// stream more slowly (it stops at every 4 KB page); none at all is slower. 3 KB ahead: on the AMX
// host's VNNI kernel it timed 1.10-1.13x faster than 6 KB for int4 at 1 and 8 rows (cold experts,
// distances alternated in one process; 1-2 KB close to 3, 4 KB and 6 KB slower), and into L2
// rather than L1 (T0) 0.94-0.96x the time (int4), 0.98x (int8). Likely why (not measured with
// counters): a T0 prefetch holds one of the core's few L1 fill buffers until its line arrives from
// DRAM. On the AVX2 host (Zen 3) 2-6 KB ahead, T2 or T0, lift the AVX2 kernel from 0.93-0.96x to
// 1.01-1.16x the same pass's plain read for Mixtral-shaped int4 experts at one row (medians of 9 passes,
// benchmarks/expert_avx2_stream_ceiling.cpp; 1.08-1.11x as fast as without, alternated in one process:
// benchmarks/results/expert_avx2_t1_prefetch.md). On an AVX-512-BF16 host without AMX (Zen 4) 1, 3, 6
// and 12 KB timed within the host's run-to-run spread (benchmarks/results/vnni_prefetch_distance_zen4.md).
// Past the strip's end they are the next strip's in gate/up, where a thread takes runs of an expert's
// strips.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "experts.h"

namespace {

template <moelight::WFormat F>
inline void prefetch_block_codes(const uint8_t* codes, int64_t blk) {
  constexpr int64_t kAhead = 3072, kBytes = F == moelight::WFormat::I8 ? 1024 : 512;  // a block's codes
  const char* p = reinterpret_cast<const char*>(codes + blk * kBytes + kAhead);
  for (int64_t o = 0; o < kBytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T2);
}

// Group g + 2's scales (and bias), 32 floats each: past the strip's, the next strip's.
inline void prefetch_group_scales(const moelight::Strip& st, int64_t g) {
  const char* s = reinterpret_cast<const char*>(st.scales + (g + 2) * 32);
  _mm_prefetch(s, _MM_HINT_T0);
  _mm_prefetch(s + 64, _MM_HINT_T0);
  if (st.bias) {
    const char* b = reinterpret_cast<const char*>(st.bias + (g + 2) * 32);
    _mm_prefetch(b, _MM_HINT_T0);
    _mm_prefetch(b + 64, _MM_HINT_T0);
  }
}

}  // namespace
