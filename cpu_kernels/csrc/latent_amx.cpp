// AMX-BF16 instantiation of the latent decode kernel (Sapphire Rapids and later), for a bf16 cache and
// bf16 queries. Absorbed MLA is an MQA with many heads over one row per key: ~30 FLOP per cached byte
// at 16 heads, which AVX512-BF16 dot products cannot keep up with on a core's share of DRAM bandwidth;
// AMX tiles do ~24x the work.
//
// Per work item (a sequence's chunk of at most kAmxMaxKeys keys, in blocks of 16 rows: one tile) and
// group of up to 16 heads:
//   1. scores S^T [16 keys x heads] per block = rows . Q^T: A the cache rows as stored, B the group's
//      queries in AMX's pair layout; three blocks share each query tile;
//   2. an exact softmax per head over the item (heads in vector lanes); P in bf16, transposed per
//      block to [heads x keys];
//   3. O [heads x dv] = P . V with V the rows as stored: a B tile row is one row's 32 columns read as 16
//      column pairs, so A is P with each key's probability beside a zero: (0, p) pairs ("P_o", the
//      float32 bits of the bf16-rounded P) give the odd columns, (p, 0) pairs ("P_e") the even ones.
//      Twice the products of a V interleaved into key pairs, but no vector work on V at all, and the
//      accumulators stay in tiles over the whole item.
// The rows come from DRAM in step 1 and again from L2 in step 3. Reading them in bounds the kernel:
// with an item's rows in L2 its compute takes ~7 us (n = 117), less than reading them from DRAM, but
// a line missed to DRAM holds one of the core's few line-fill buffers for the whole latency, and the
// hardware prefetcher does not follow the tile loads' 1,152-byte stride. So the kernel prefetches the
// thread's next item (LatentArgs::next) in eight sequential streams (measured: one stream helped
// little, eight best, more no better), a few lines at every step of all three phases (prefetching in
// the tile loops alone left DRAM idle during the vector phases), and writes its bf16 output with
// streaming stores (no read for ownership of the output's lines). Items over kGroupedMinKeys keys run
// latent_amx_grouped.h instead: the same three steps per group of 4 blocks with an online softmax, so
// P.V re-reads rows the scores read just before (a 512-key item's two passes did not stay in L2).
// Only code between the pragmas is compiled for AMX; it runs after the CPU and the OS (arch_prctl) said
// AMX may be used.
#include <cstdint>
#include <cstring>

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
constexpr int kBlock = static_cast<int>(moelight::kLatentBlockKeys);  // keys per tile
static_assert(kBlock == 16, "a block of keys is one 16-row tile");

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Scores: C tiles 0-2 (16 keys x hg heads), A 3-5 (16 keys x 32 dims), B 6, 7 (16 dim pairs x hg).
// P.V: C 0-3 (hg x 16 column pairs), A 4, 5 (hg x 16 key pairs), B 6, 7 (16 keys x 16 column pairs).
// A tile loaded while an earlier product still reads it waits, so consecutive products alternate
// tiles. With 16 heads every tile is 16 x 64 bytes and one configuration serves both steps.
void configure(int hg, bool scores) {
  TileConfig c;
  const uint8_t g = static_cast<uint8_t>(hg);
  const uint16_t gb = static_cast<uint16_t>(hg * 4);
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = scores || t >= 6 ? 16 : g;
    c.colsb[t] = scores && (t < 3 || t >= 6) ? gb : 64;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes: without this barrier the stores of
  // rows and colsb are dropped as dead and ldtilecfg faults on an invalid configuration
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

#include "latent_amx_next_item.h"

// One 32-dim step of the scores of G blocks: B tile TB the step's queries, A tile 3 + j block j's rows,
// C tile j its scores. A macro: GCC's tile intrinsics take tile numbers as literals. kOff / kStride: a
// step's first element in a block and the bytes between its rows (row-major: 32 elements on, a row
// apart; tile-major: the step's 1 KiB tile, rows 64 bytes apart).
// A block's rows: TILELOADDT1 (the "no reuse" hint) where the rows are not read again from L1 before they
// leave it (the two-pass kernel: an item's rows are ~2.5x L1, so P.V re-reads them from L2 either way)
#define LATENT_ROW_LOAD(T, p)                 \
  do {                                        \
    if constexpr (kStreamRows) {              \
      _tile_stream_loadd(T, p, kStride);      \
    } else {                                  \
      _tile_loadd(T, p, kStride);             \
    }                                         \
  } while (0)
#define LATENT_SCORE_STEP(TB, s)                       \
  do {                                                 \
    _tile_loadd(TB, qv + (s) * 256, 64);               \
    LATENT_ROW_LOAD(3, blk[0] + (s) * kOff);           \
    _tile_dpbf16ps(0, 3, TB);                          \
    if constexpr (G > 1) {                             \
      LATENT_ROW_LOAD(4, blk[1] + (s) * kOff);         \
      _tile_dpbf16ps(1, 4, TB);                        \
    }                                                  \
    if constexpr (G > 2) {                             \
      LATENT_ROW_LOAD(5, blk[2] + (s) * kOff);         \
      _tile_dpbf16ps(2, 5, TB);                        \
    }                                                  \
  } while (0)

// S^T of G (1-3) consecutive blocks into st (16 x 16 floats a block): a query tile serves G blocks.
// kStreamRows: the rows loaded with the no-reuse hint (LATENT_ROW_LOAD).
// Not inlined (nor store_columns): with one caller per instantiation GCC inlined them into the grouped
// kernel, whose code then differed from the measured one.
template <int DK, int G, bool TM, bool kStreamRows, class Next>
__attribute__((noinline)) void score_blocks(const uint16_t* const* blk, const uint32_t* qv, float* st, Next& next) {
  constexpr int kOff = TM ? 512 : 32, kStride = TM ? 64 : DK * 2;
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  int s = 0;
  for (; s + 1 < DK / 32; s += 2) {
    LATENT_SCORE_STEP(6, s);
    LATENT_SCORE_STEP(7, s + 1);
    next.fetch();
  }
  if (s < DK / 32) LATENT_SCORE_STEP(6, s);
  _tile_stored(0, st, 64);
  if constexpr (G > 1) _tile_stored(1, st + 256, 64);
  if constexpr (G > 2) _tile_stored(2, st + 512, 64);
}
#undef LATENT_SCORE_STEP
#undef LATENT_ROW_LOAD

inline float* align64(void* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Columns [c, c + 64) of heads [h0, h0 + hg) from the four P.V tiles in ob (even, odd columns of
// [c, c + 32), then of [c + 32, c + 64)), scaled by inv (per head), into the output rows. `stream`:
// bf16 rows with 64-byte alignment, written around the caches. Not inlined (see score_blocks).
template <class Next>
__attribute__((noinline)) void store_columns(const moelight::LatentArgs& a, const float* ob, const float* inv, int h0,
                                             int hg, int dv, int c, bool stream, Next& next) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  // bf16 (even lanes 0-15, odd lanes 16-31) -> natural order: column 2i is even i, 2i + 1 odd i
  const __m512i nat = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int h = 0; h < hg; ++h) {
    if (h % 4 == 3) next.fetch();
    const R iv = V::set1(inv[h]);
    const int64_t dst = static_cast<int64_t>(h0 + h) * dv + c;
    for (int half = 0; half < 2; ++half) {
      const R even = V::mul(V::load(ob + half * 512 + h * 16), iv);
      const R odd = V::mul(V::load(ob + half * 512 + 256 + h * 16), iv);
      if (a.out_dtype == moelight::KvDtype::F32) {
        float* o = static_cast<float*>(a.out) + dst + half * 32;
        V::store(o, _mm512_permutex2var_ps(even, lo, odd));
        V::store(o + 16, _mm512_permutex2var_ps(even, hi, odd));
      } else {
        const __m512i row = _mm512_permutexvar_epi16(nat, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
        uint16_t* o = static_cast<uint16_t*>(a.out) + dst + half * 32;
        if (stream) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(o), row);
        } else {
          _mm512_storeu_si512(o, row);
        }
      }
    }
  }
}

// blk[b]: block b's first row (the block table's, or the rows' in order). Tiles read 16 whole rows, so a
// partial last block is copied into `tail`, zero-padded (P is 0 there, V must be finite), and read from there.
template <int DK, bool TM>
void block_rows(const moelight::LatentArgs& a, int nb, int tail_rows, uint16_t* tail, const uint16_t** blk) {
  for (int b = 0; b < nb; ++b)
    blk[b] = a.blocks != nullptr ? static_cast<const uint16_t*>(a.blocks[b])
                                 : static_cast<const uint16_t*>(a.rows) + static_cast<int64_t>(b) * kBlock * DK;
  if (tail_rows == 0) return;
  if constexpr (TM) {  // each tile's first tail_rows rows
    for (int t = 0; t < DK / 32; ++t) {
      std::memcpy(tail + t * 512, blk[nb - 1] + t * 512, static_cast<size_t>(tail_rows) * 64);
      std::memset(tail + t * 512 + tail_rows * 32, 0, static_cast<size_t>(kBlock - tail_rows) * 64);
    }
  } else {
    std::memcpy(tail, blk[nb - 1], static_cast<size_t>(tail_rows) * DK * 2);
    std::memset(tail + tail_rows * DK, 0, static_cast<size_t>(kBlock - tail_rows) * DK * 2);
  }
  blk[nb - 1] = tail;
}

// Calls of Next::fetch() one item of nb blocks makes in latent_attend_amx_blocks
template <int DK, int DV>
int64_t two_pass_fetches(int heads, int nb) {
  return static_cast<int64_t>((heads + 15) / 16) * (DK / 32 + DK / 64 * ((nb + 2) / 3) + 2 * nb + DV / 64 * (nb + 4));
}

// The two passes over an item whose blocks start at blk[0..nb) (whole blocks of 16 rows, zero-padded past
// n_keys); next.fetch() a few times in every step, to bring in the thread's next item.
template <int DK, int DV, bool TM, class Next>
void latent_attend_amx_blocks(const moelight::LatentArgs& a, const uint16_t* const* blk, Next& next) {
  static_assert(DK % 32 == 0 && DV % 64 == 0, "AMX steps of 32 dims and 64 output columns");
  constexpr int kMaxBlocks = static_cast<int>(moelight::kAmxMaxKeys) / kBlock;
  const int64_t n = a.n_keys;
  const int nb = static_cast<int>((n + kBlock - 1) / kBlock);
  const int H = a.heads;
  // scratch (latent_amx_scratch_floats): query pairs, scores, P blocks, output tiles, the tail block
  float* base = align64(a.scratch);
  uint32_t* qv = reinterpret_cast<uint32_t*>(base);  // DK/2 pairs x 16 heads
  float* st = base + DK / 2 * 16;                     // nb blocks of 16 keys x 16 heads
  float* pb = st + kMaxBlocks * 256;                  // nb blocks of P_o, P_e: 16 heads x 16 keys each
  float* ob = pb + kMaxBlocks * 512;                  // 4 tiles of 16 x 16
  const bool stream = a.out_dtype != moelight::KvDtype::F32 && reinterpret_cast<uintptr_t>(a.out) % 64 == 0 &&
                      DV * 2 % 64 == 0;
  const uint32_t* q32 = static_cast<const uint32_t*>(a.q);

  for (int h0 = 0; h0 < H; h0 += 16) {
    const int hg = H - h0 < 16 ? H - h0 : 16;
    for (int p = 0; p < DK / 2; p += 16) {  // the queries as B tiles: dword pairs by head
      R r[16];
      for (int h = 0; h < 16; ++h)
        r[h] = h < hg ? V::load(reinterpret_cast<const float*>(q32 + (h0 + h) * (DK / 2) + p)) : V::zero();
      V::transpose(r);
      for (int i = 0; i < 16; ++i) V::store(reinterpret_cast<float*>(qv + (p + i) * 16), r[i]);
      next.fetch();
    }

    // 1. scores, three blocks at a time
    configure(hg, true);
    int b = 0;
    for (; b + 3 <= nb; b += 3) score_blocks<DK, 3, TM, true>(blk + b, qv, st + b * 256, next);
    if (nb - b == 2) score_blocks<DK, 2, TM, true>(blk + b, qv, st + b * 256, next);
    if (nb - b == 1) score_blocks<DK, 1, TM, true>(blk + b, qv, st + b * 256, next);

    // 2. softmax per head (a lane per head) over the item; P rounded to bf16 (as P.V uses it), each
    //    block transposed to rows per head, as P_o (0, p) and P_e (p, 0) bf16 pairs
    const R sc = V::set1(a.scale);
    R mx = V::set1(-__builtin_inff());
    for (int64_t t = 0; t < n; ++t) mx = V::max(mx, V::mul(V::load(st + t * 16), sc));
    R l = V::zero();
    for (int k = 0; k < nb; ++k) {
      R r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = static_cast<int64_t>(k) * kBlock + i;
        r[i] = t < n ? V::round_bf16(V::exp(V::sub(V::mul(V::load(st + t * 16), sc), mx))) : V::zero();
        l = V::add(l, r[i]);
      }
      next.fetch();
      V::transpose(r);
      next.fetch();
      for (int h = 0; h < 16; ++h) {
        V::store(pb + k * 512 + h * 16, r[h]);
        _mm512_store_si512(pb + k * 512 + 256 + h * 16, _mm512_srli_epi32(_mm512_castps_si512(r[h]), 16));
      }
    }
    alignas(64) float mh[16], lh[16], inv[16];
    V::store(mh, mx);
    V::store(lh, l);
    for (int h = 0; h < hg; ++h) {
      inv[h] = a.m != nullptr ? 1.0f : (lh[h] > 0.0f ? 1.0f / lh[h] : 0.0f);
      if (a.m != nullptr) {
        a.m[h0 + h] = mh[h];
        a.l[h0 + h] = lh[h];
      }
    }

    // 3. O = P . V, 64 columns at a time: C tiles 0 / 1 the even / odd columns of the first 32, 2 / 3
    //    of the next 32; A tile 4 P_o, 5 P_e; B tiles 6, 7 the block's rows, with the no-reuse hint as in
    //    the scores (benchmarks/results/latent_attention_amx_stream_loads.md: 256 x 117 5-10% faster)
    if (hg != 16) configure(hg, false);
    constexpr int kVStride = TM ? 64 : DK * 2;
    for (int c = 0; c < DV; c += 64) {
      const int v0 = TM ? c / 32 * 512 : c, v1 = TM ? (c / 32 + 1) * 512 : c + 32;  // columns c, c + 32
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int k = 0; k < nb; ++k) {
        _tile_stream_loadd(6, blk[k] + v0, kVStride);
        _tile_loadd(4, pb + k * 512, 64);
        _tile_loadd(5, pb + k * 512 + 256, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_stream_loadd(7, blk[k] + v1, kVStride);
        _tile_dpbf16ps(2, 5, 7);
        _tile_dpbf16ps(3, 4, 7);
        next.fetch();
      }
      _tile_stored(0, ob, 64);
      _tile_stored(1, ob + 256, 64);
      _tile_stored(2, ob + 512, 64);
      _tile_stored(3, ob + 768, 64);
      store_columns(a, ob, inv, h0, hg, DV, c, stream, next);
    }
  }
  _tile_release();
  if (stream) _mm_sfence();  // the streamed rows are visible before the caller's threads join
}

template <int DK, int DV, bool TM>
void latent_attend_amx(const moelight::LatentArgs& a) {
  constexpr int kMaxBlocks = static_cast<int>(moelight::kAmxMaxKeys) / kBlock;
  const int nb = static_cast<int>((a.n_keys + kBlock - 1) / kBlock), tail_rows = static_cast<int>(a.n_keys % kBlock);
  // the tail block after the query pairs, scores, P blocks and output tiles in scratch
  uint16_t* tail = reinterpret_cast<uint16_t*>(align64(a.scratch) + DK / 2 * 16 + kMaxBlocks * 768 + 4 * 256);
  const uint16_t* blk[kMaxBlocks];  // each block's first row
  block_rows<DK, TM>(a, nb, tail_rows, tail, blk);
  NextItem next(a, two_pass_fetches<DK, DV>(a.heads, nb));
  latent_attend_amx_blocks<DK, DV, TM>(a, blk, next);
}

#include "latent_amx_grouped.h"

// Items longer than this run in groups of 4 blocks (latent_amx_grouped.h); shorter ones in two passes
// over the whole item (their rows stay in L2 between the passes). Measured in the driver
// (benchmarks/results/latent_attention_staged.md): two passes 3-10% faster at 144-160 keys, even at 168-176.
constexpr int64_t kGroupedMinKeys = 10 * kBlock;

template <int DK, int DV>
void latent_attend_amx_any(const moelight::LatentArgs& a) {
  if (a.tile_major) {
    latent_attend_amx<DK, DV, true>(a);
  } else if (a.n_keys > kGroupedMinKeys && a.heads % 16 == 0) {
    latent_attend_amx_grouped<DK, DV, 4>(a);
  } else {
    latent_attend_amx<DK, DV, false>(a);
  }
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
  if (dk == 576 && dv == 512) return &latent_attend_amx_any<576, 512>;
  if (dk == 96 && dv == 64) return &latent_attend_amx_any<96, 64>;
  return nullptr;
}

}  // namespace moelight
#else
namespace moelight {
bool amx_usable() { return false; }
LatentFn amx_latent_fn(KvDtype, int64_t, int64_t) { return nullptr; }
}  // namespace moelight
#endif
