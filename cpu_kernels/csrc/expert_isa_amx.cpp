// AMX-BF16 strip GEMM of the fused expert op: A in tiles of 16 rows x 32 k (each 1 KB contiguous,
// as the fused op lays out an expert's rows for it: rows of a power-of-two stride fell in a few L1
// sets) times 16 k-pairs x 16 columns (B, the strip's pair layout read with a 128-byte stride), 32
// rows x 32 columns of float32 accumulators in four tiles. While a strip runs, the codes of the next
// one the thread multiplies are read into L2, a few lines per k-block step: without it the weights'
// reads (or a quantized strip's dequantisation) and the tile products took turns. Measured on the
// bench shapes, a 16-row tile with that read-ahead beats AVX512-BF16's GEMM on cold weights even
// for one row, so every row count runs on tiles. Dequantisation and the epilogue are AVX512-BF16's
// (every AMX CPU has it). Linux grants a process the AMX tile state on request (arch_prctl); where
// it does not, amx_expert_isa() is nullptr and the AVX512-BF16 GEMM runs instead.
#include <cstdint>

#include "experts.h"

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")
#include <immintrin.h>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // 0-3: C (16 x 16 float32), 4-5: A (16 x 32 bf16), 6-7: B (16 pairs x 16 columns)
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // ldtilecfg through asm with a memory operand: GCC 12's _tile_loadconfig builtin does not count as
  // reading the struct, and the stores filling it were optimised away (tiles then fault as unconfigured)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

void end() { _tile_release(); }

// Reads the lines of the next strip's codes into L2 a few per k-block step, spread over all of
// this strip's steps (passes x k-blocks): the read runs at the pace of the products, not ahead of
// the fill buffers the tile loads need.
struct NextStrip {
  const char* p;
  const char* end;
  int64_t per_step;

  NextStrip(const uint8_t* next, int64_t bytes, int64_t steps)
      : p(reinterpret_cast<const char*>(next)), end(next ? p + bytes : p), per_step((bytes / 64 + steps - 1) / steps) {}

  void step() {
    for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// Dequantises a quantized strip into the bf16 scratch the tile loads read, one k-block (16 pair
// rows, 2 KB) ahead of them during the first row pass: the AVX-512 dequantisation then runs between
// the tile products instead of in a pass of its own before them, and each block is still in L1
// when its tiles load it. For bf16 strips (st nullptr) it does nothing.
struct BlockFill {
  const moelight::Strip* st;
  uint16_t* out;
  void (*rows)(const moelight::Strip&, int64_t, int64_t, uint16_t*);

  void block(int64_t i, int64_t kb) const {
    if (st && i < kb) rows(*st, 16 * i, 16 * (i + 1), out);
  }
};

// c[r][0, 32) for r < m rounded up to 16, a in tiles (experts.h, tiled_offset); fill: b's k-blocks
// written during the first row pass (BlockFill; Fill false: b is given, and the loop is the one
// without a fill at all).
template <bool Fill>
void tile_gemm_core(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next,
                    int64_t next_bytes, float* c, int64_t ldc, BlockFill fill) {
  const int64_t kb = k / 32, sc = ldc * 4, rows = (m + 15) / 16 * 16;
  NextStrip ahead(next, next_bytes, (rows + 31) / 32 * kb);
  if (Fill) fill.block(0, kb);
  int64_t r = 0;
  for (; r + 32 <= rows; r += 32) {
    const uint16_t* a0 = a + r * k;
    const uint16_t* a1 = a0 + 16 * k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < kb; ++i) {
      ahead.step();
      if (Fill && r == 0) fill.block(i + 1, kb);
      _tile_loadd(4, a0 + i * 512, 64);
      _tile_loadd(6, b + i * 1024, 128);
      _tile_loadd(7, b + i * 1024 + 32, 128);
      _tile_loadd(5, a1 + i * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* c0 = c + r * ldc;
    _tile_stored(0, c0, sc);
    _tile_stored(1, c0 + 16, sc);
    _tile_stored(2, c0 + 16 * ldc, sc);
    _tile_stored(3, c0 + 16 * ldc + 16, sc);
  }
  if (r < rows) {  // a last group of 16
    const uint16_t* a0 = a + r * k;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t i = 0; i < kb; ++i) {
      ahead.step();
      if (Fill && r == 0) fill.block(i + 1, kb);
      _tile_loadd(4, a0 + i * 512, 64);
      _tile_loadd(6, b + i * 1024, 128);
      _tile_loadd(7, b + i * 1024 + 32, 128);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c + r * ldc, sc);
    _tile_stored(1, c + r * ldc + 16, sc);
  }
}

void tile_gemm(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next, int64_t next_bytes,
               float* c, int64_t ldc) {
  tile_gemm_core<false>(a, m, b, k, next, next_bytes, c, ldc, BlockFill{nullptr, nullptr, nullptr});
}

void tile_qgemm(const uint16_t* a, int64_t m, const moelight::Strip& st, uint16_t* scratch, const uint8_t* next,
                int64_t next_bytes, float* c, int64_t ldc) {
  tile_gemm_core<true>(a, m, scratch, st.k, next, next_bytes, c, ldc,
                 BlockFill{&st, scratch, moelight::avx512bf16_expert_isa()->dequant_rows});
}

}  // namespace
#pragma GCC pop_options

namespace {
bool amx_granted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}
}  // namespace

const moelight::ExpertIsa* moelight::amx_expert_isa() {
  if (!amx_granted()) return nullptr;
  static const ExpertIsa isa = [] {
    ExpertIsa t = *avx512bf16_expert_isa();
    t.tile_gemm = tile_gemm;  // in place of its gemm and qgemm
    t.tile_qgemm = tile_qgemm;  // in place of dequant + tile_gemm
    t.begin = begin;
    t.end = end;
    t.row_step = 16;  // whole tiles
    // VNNI's int8-activation products for an expert's few rows, where they beat expanding the codes
    // to bf16 for the tiles (the rows then exactly its tokens, not a tile's 16). Timed on an AMX host
    // (2 cores; benchmarks/bench_iqgemm_crossover.py): with the tiles fed from cache (rows stored as
    // tiles, the next strip read ahead) VNNI wins at 8 rows per expert on every shape and loses from
    // 12-14 (results/expert_iqgemm_amx_tiles.md); against the older tiles it won to 16-24 rows
    // (results/expert_iqgemm_amx.md). At one row it is 2.6-4.7x faster. AMX-INT8 tile products lost
    // at 16-64 rows: QuantRows' scale per 32 k means draining the int32 tile (store, convert, scale)
    // after every product, which cost more than dequantising the strip once.
    with_vnni_products(t);
    t.iqgemm_rows_i8 = 10;
    t.iqgemm_rows_u4 = 10;
    return t;
  }();
  return &isa;
}
#else
const moelight::ExpertIsa* moelight::amx_expert_isa() { return nullptr; }
#endif
