// AMX-BF16 instantiation of the latent decode kernel (Sapphire Rapids and later), for a bf16 cache and
// bf16 queries. Absorbed MLA is an MQA with many heads over one row per key: ~30 FLOP per cached byte
// at 16 heads, which AVX512-BF16 dot products cannot keep up with on a core's share of DRAM bandwidth
// (the AVX-512 kernel runs at its dot-product peak and reads ~15% of it); AMX tiles do ~24x the work.
//
// Per work item (a sequence's chunk of at most kAmxMaxKeys keys) and group of up to 16 heads:
//   1. scores S^T [keys x heads] = rows [keys x dk] . Q^T, with A the cache rows as stored and B the
//      group's queries in AMX's pair layout (built once per item);
//   2. an exact softmax per head over the chunk (heads in vector lanes; max, then exp, P in bf16);
//   3. O [heads x dv] += P [heads x keys] . V, with V's row pairs interleaved into B tiles 32 columns
//      at a time, so they stay in L1 (AVX512-BF16's pair_rows: O is in its "dot order", undone when stored).
// The chunk's rows are read from DRAM in step 1 and again from L2 in step 3 (256 rows of 576 bf16 are
// 288 KiB; chunks of 128 to 512 rows measured alike, 64 slower). Only code between the pragmas is compiled for AMX; it runs after the CPU and
// the OS (arch_prctl) said AMX may be used.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "latent_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#include "simd_avx512bf16.h"

namespace {

using V = VecAvx512Bf16;
using R = V::R;

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two tile configurations per head group (hg heads). Scores: 0, 1 C (16 keys x hg heads); 2-5 A (16
// keys x 32 dims: two key blocks, two steps in flight); 6, 7 B (16 dim pairs x hg). P.V, 64 keys a
// step: 0, 1 C (hg x 16 columns); 2-5 B (16 key pairs x 16 columns); 6, 7 A (hg x 32 keys). Tiles are
// not renamed: a tile loaded while an earlier product still reads it waits, so steps alternate tiles.
void configure(int hg, bool scores) {
  TileConfig c;
  const uint8_t g = static_cast<uint8_t>(hg);
  const uint16_t gb = static_cast<uint16_t>(hg * 4);
  const uint8_t s_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  const uint16_t s_cols[8] = {gb, gb, 64, 64, 64, 64, gb, gb};
  const uint8_t p_rows[8] = {g, g, 16, 16, 16, 16, g, g};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = scores ? s_rows[t] : p_rows[t];
    c.colsb[t] = scores ? s_cols[t] : 64;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes: without this barrier the stores of
  // rows and colsb are dropped as dead and ldtilecfg faults on an invalid configuration
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

inline float* align64(void* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

template <int DK, int DV>
void latent_attend_amx(const moelight::LatentArgs& a) {
  static_assert(DK % 32 == 0 && DV % 32 == 0, "AMX steps of 32");
  constexpr int KS = DK / 32;  // dim steps of the scores
  const int64_t n = a.n_keys, n64 = (n + 63) / 64 * 64;
  const int H = a.heads;
  // scratch (latent_amx_scratch_floats): query pairs, scores/probabilities, P rows, V tiles, O, a tail
  float* base = align64(a.scratch);
  uint32_t* qv = reinterpret_cast<uint32_t*>(base);                      // DK/2 x 16
  float* st = base + DK / 2 * 16;                                        // n64 x 16
  uint16_t* pm = reinterpret_cast<uint16_t*>(st + n64 * 16);             // 16 x n64
  uint16_t* vb = reinterpret_cast<uint16_t*>(st + n64 * 16 + 8 * n64);   // 4 B tiles of 16 x 32
  float* acc = reinterpret_cast<float*>(vb + 4 * 512);                  // 16 x DV
  uint16_t* tail = reinterpret_cast<uint16_t*>(acc + 16 * DV);           // 32 x DK
  const uint16_t* rows = static_cast<const uint16_t*>(a.rows);
  const uint32_t* q32 = static_cast<const uint32_t*>(a.q);
  alignas(64) static const uint16_t zeros[DK] = {};

  for (int h0 = 0; h0 < H; h0 += 16) {
    const int hg = H - h0 < 16 ? H - h0 : 16;
    for (int p = 0; p < DK / 2; p += 16) {  // the queries as B tiles: dword pairs by head
      R r[16];
      for (int h = 0; h < 16; ++h)
        r[h] = h < hg ? V::load(reinterpret_cast<const float*>(q32 + (h0 + h) * (DK / 2) + p)) : V::zero();
      V::transpose(r);
      for (int i = 0; i < 16; ++i) V::store(reinterpret_cast<float*>(qv + (p + i) * 16), r[i]);
    }

    // 1. scores, 32 keys a pass (two C tiles share each query tile)
    configure(hg, true);
    for (int64_t kb = 0; kb < n; kb += 32) {
      const uint16_t* src = rows + kb * DK;
      if (kb + 32 > n) {  // the tail, zero-padded: tiles read 32 whole rows
        std::memset(tail, 0, 32 * DK * sizeof(uint16_t));
        std::memcpy(tail, src, static_cast<size_t>(n - kb) * DK * sizeof(uint16_t));
        src = tail;
      }
      _tile_zero(0);
      _tile_zero(1);
      for (int s = 0; s < KS; s += 2) {
        _tile_loadd(2, src + s * 32, DK * 2);
        _tile_loadd(3, src + 16 * DK + s * 32, DK * 2);
        _tile_loadd(6, qv + s * 16 * 16, 64);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 3, 6);
        if (s + 1 < KS) {
          _tile_loadd(4, src + (s + 1) * 32, DK * 2);
          _tile_loadd(5, src + 16 * DK + (s + 1) * 32, DK * 2);
          _tile_loadd(7, qv + (s + 1) * 16 * 16, 64);
          _tile_dpbf16ps(0, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
        }
      }
      _tile_stored(0, st + kb * 16, 64);
      _tile_stored(1, st + (kb + 16) * 16, 64);
    }

    // 2. softmax per head (a lane per head) over the chunk; P in bf16 (as P.V uses it), rows per head
    const R sc = V::set1(a.scale);
    R mx = V::set1(-__builtin_inff());
    for (int64_t t = 0; t < n; ++t) mx = V::max(mx, V::mul(V::load(st + t * 16), sc));
    R l = V::zero();
    for (int64_t t = 0; t < n64; ++t) {
      R p = V::zero();
      if (t < n) p = V::round_bf16(V::exp(V::sub(V::mul(V::load(st + t * 16), sc), mx)));
      l = V::add(l, p);
      V::store(st + t * 16, p);
    }
    for (int64_t kb = 0; kb < n64; kb += 32) {
      R lo[16], hi[16];
      for (int i = 0; i < 16; ++i) {
        lo[i] = V::load(st + (kb + i) * 16);
        hi[i] = V::load(st + (kb + 16 + i) * 16);
      }
      V::transpose(lo);
      V::transpose(hi);
      for (int h = 0; h < hg; ++h) {
        const __m512bh both = _mm512_cvtne2ps_pbh(hi[h], lo[h]);  // keys kb..kb+31 of head h
        V::store(reinterpret_cast<float*>(pm + h * n64 + kb), reinterpret_cast<const R&>(both));
      }
    }

    // 3. O += P . V, 64 keys a step, 32 columns at a time: the V row pairs of those columns interleaved
    //    into four B tiles (lo / hi columns of each 32-key half) that stay in L1 for their products
    configure(hg, false);
    for (int h = 0; h < hg; ++h)
      for (int c = 0; c < DV; c += 16) V::store(acc + h * DV + c, V::zero());
    for (int64_t kb = 0; kb < n; kb += 64) {
      const uint16_t* src[64];  // the step's rows; rows past the chunk read as zeros
      for (int i = 0; i < 64; ++i) src[i] = kb + i < n ? rows + (kb + i) * DK : zeros;
      _tile_loadd(6, pm + kb, n64 * 2);
      _tile_loadd(7, pm + kb + 32, n64 * 2);
      for (int j = 0; j < DV / 32; ++j) {
        for (int i = 0; i < 32; ++i) {  // pair i: rows 2i, 2i + 1 -> tile (i / 16), row i % 16
          R lo, hi;
          V::pair_rows(V::load_raw(src[2 * i] + 32 * j), V::load_raw(src[2 * i + 1] + 32 * j), lo, hi);
          uint16_t* dst = vb + (i / 16) * 1024 + (i % 16) * 32;
          V::store(reinterpret_cast<float*>(dst), lo);
          V::store(reinterpret_cast<float*>(dst + 512), hi);
        }
        _tile_loadd(0, acc + 32 * j, DV * 4);
        _tile_loadd(2, vb, 64);
        _tile_loadd(3, vb + 1024, 64);
        _tile_dpbf16ps(0, 6, 2);
        _tile_dpbf16ps(0, 7, 3);
        _tile_loadd(1, acc + 32 * j + 16, DV * 4);
        _tile_loadd(4, vb + 512, 64);
        _tile_loadd(5, vb + 1536, 64);
        _tile_dpbf16ps(1, 6, 4);
        _tile_dpbf16ps(1, 7, 5);
        _tile_stored(0, acc + 32 * j, DV * 4);
        _tile_stored(1, acc + 32 * j + 16, DV * 4);
      }
    }

    // out: normalised rows, or the partial's acc with each head's max and sum
    alignas(64) float mh[16], lh[16];
    V::store(mh, mx);
    V::store(lh, l);
    for (int h = 0; h < hg; ++h) {
      const float inv = a.m != nullptr ? 1.0f : (lh[h] > 0.0f ? 1.0f / lh[h] : 0.0f);
      if (a.m != nullptr) {
        a.m[h0 + h] = mh[h];
        a.l[h0 + h] = lh[h];
      }
      const R iv = V::set1(inv);
      const float* src = acc + h * DV;
      const int64_t dst = static_cast<int64_t>(h0 + h) * DV;
      for (int c = 0; c < DV; c += 32) {
        R n0, n1;
        V::undo_dot_order(V::mul(V::load(src + c), iv), V::mul(V::load(src + c + 16), iv), n0, n1);
        if (a.out_dtype == moelight::KvDtype::F32) {
          V::store(static_cast<float*>(a.out) + dst + c, n0);
          V::store(static_cast<float*>(a.out) + dst + c + 16, n1);
        } else {
          V::store_half(static_cast<uint16_t*>(a.out) + dst + c, n0, true);
          V::store_half(static_cast<uint16_t*>(a.out) + dst + c + 16, n1, true);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace
#pragma GCC pop_options

namespace moelight {

bool amx_usable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return tile && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

LatentFn amx_latent_fn(KvDtype dtype, int64_t dk, int64_t dv) {
  if (dtype != KvDtype::BF16 || !amx_usable()) return nullptr;
  if (dk == 576 && dv == 512) return &latent_attend_amx<576, 512>;
  if (dk == 96 && dv == 64) return &latent_attend_amx<96, 64>;
  return nullptr;
}

}  // namespace moelight
#else
namespace moelight {
bool amx_usable() { return false; }
LatentFn amx_latent_fn(KvDtype, int64_t, int64_t) { return nullptr; }
}  // namespace moelight
#endif
