// Plain-C++ interface between the fused expert op (expert_mix.cpp) and its per-ISA pieces
// (expert_isa_*.cpp). As kernels.h: no torch headers in the ISA units.
//
// Packed weight layout (cpu_kernels/expert_pack.py writes it): a matrix W [N, K] (out, in) is cut
// into strips of 32 output columns; a strip holds K/2 rows, one per pair of k, of 32 columns x 2 k
// ("pair layout", the B operand of AMX-BF16 and of AVX512-BF16's dot product). Its elements are
// bf16, or codes of a quantized format dequantized as w = lut(code) * scale + bias, with one scale
// (and bias) per column and per group of `group` consecutive k.
#pragma once
#include <cstdint>

namespace moelight {

// Weight formats: BF16 as stored; byte codes (I8: int8, F8: float8 e4m3) at one byte per element,
// in pair-layout order; nibble codes (U4: 0..15, FP4: e2m1) at 32 bytes per row of 64 elements,
// byte i holding element i (low nibble) and element i + 32 (high nibble).
enum class WFormat : int { BF16 = 0, I8 = 1, F8 = 2, U4 = 3, FP4 = 4 };

struct Strip {
  const uint8_t* codes;  // the strip's K/2 rows
  const float* scales;   // [K / group][32], nullptr for BF16
  const float* bias;     // [K / group][32] or nullptr (w = v * scale)
  int64_t k;             // K, a multiple of 32
  int64_t group;         // k per scale group, a multiple of 32 dividing K
  WFormat fmt;
};

// Rows of activations quantized for iqgemm: row r, k in block b = k / 32: a ~= q[r][k] * scale[r][b];
// sum[r][b] = the block's sum of q (for formats with a bias: sum_k w a = s sum_k c a + bias sum_k a).
struct QuantRows {
  const int8_t* q;       // [m][k]
  const float* scale;    // [m][k / 32]
  const int32_t* sum;    // [m][k / 32]
  int64_t k;             // a multiple of 32
};

// Activation of the gate/up epilogue: SwiGLU silu(g) * u, or GPT-OSS's clamped
// (min(u, l) clamped to +-l, plus 1) * g * sigmoid(alpha g) with g = min(g, l).
struct Act {
  int kind;  // 0: SwiGLU, 1: clamped SwiGLU
  float limit, alpha;
};

struct ExpertIsa {
  // A quantized strip -> bf16 pair layout, K/2 rows of 64 values.
  void (*dequant)(const Strip& s, uint16_t* out);
  // c[r][0, 32) = sum_k a[r][k] b[k][.] for r < m (m a multiple of row_step): a bf16 rows of stride lda,
  // b a bf16 strip of depth k (pair layout), c float32 rows of stride ldc. `next`: the codes of the strip
  // the thread multiplies after this one (next_bytes of them; nullptr: none known), which the ISA may
  // read ahead meanwhile (AVX512-BF16 does).
  void (*gemm)(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next,
               int64_t next_bytes, float* c, int64_t ldc);
  // Gate/up epilogue: c rows hold 16 gate then 16 up columns; bias (32 floats) or nullptr;
  // out[r][0, 16) = act(gate + bias, up + bias) rounded to bf16.
  void (*act)(const float* c, int64_t ldc, int64_t m, const float* bias, Act act, uint16_t* out, int64_t ldo);
  // Optional: gemm on a quantized strip with its weights dequantised in registers (no scratch), the
  // same bf16 values and summation order as dequant + gemm; used for m <= qgemm_rows, where
  // writing and re-reading the dequantised strip costs more than dequantising it per row pair
  // (AVX2: every m, its qgemm dequantising many rows' strip a k-block at a time into float32).
  void (*qgemm)(const uint16_t* a, int64_t lda, int64_t m, const Strip& b, float* c, int64_t ldc);
  int64_t qgemm_rows;
  // Optional: int8 / uint4 / MXFP4 strips times activations quantized to int8 per block of 32 k
  // (QuantRows), integer multiply-adds summed per block, scaled in float32: for m <= iqgemm_rows_i8
  // (int8 strips), iqgemm_rows_u4 (uint4) or iqgemm_rows_fp4 (MXFP4, below), where expanding the
  // codes to bf16 (per row pair, or once into scratch) costs more than the integer products. Not the
  // bf16 path's numbers: the activation is rounded to 8 bits (a relative error of at most 1/254 of
  // its block's largest value).
  void (*iqgemm)(const QuantRows& a, int64_t m, const Strip& b, float* c, int64_t ldc);
  int64_t iqgemm_rows_i8, iqgemm_rows_u4;
  // Optional per-thread setup / teardown (AMX tile configuration).
  void (*begin)();
  void (*end)();
  // gemm (tile_gemm where the ISA has it, and act after it) take m rounded up to a multiple of this
  // (AMX: a tile's 16 rows); the rows past an expert's tokens are zero in the gate/up input. 1:
  // exactly its rows, so a decode token per expert costs one row, not 16. iqgemm and act after it
  // take exactly the expert's rows.
  int64_t row_step;
  // Optional (AMX): the GEMM on A in tiles (tiled_offset), in place of gemm and qgemm. `next` is the
  // strip the thread multiplies after this one (its next_bytes of codes; nullptr: none known), read
  // ahead while this one runs.
  void (*tile_gemm)(const uint16_t* a, int64_t m, const uint16_t* b, int64_t k, const uint8_t* next, int64_t next_bytes,
                    float* c, int64_t ldc);
  // Optional: dequant's pair rows [r0, r1) only, into out + r * 64.
  void (*dequant_rows)(const Strip& s, int64_t r0, int64_t r1, uint16_t* out) = nullptr;
  // Optional (AMX): tile_gemm on a quantized strip, dequantised into scratch (as dequant would) a
  // k-block at a time between the tile products, in place of dequant then tile_gemm.
  void (*tile_qgemm)(const uint16_t* a, int64_t m, const Strip& b, uint16_t* scratch, const uint8_t* next,
                     int64_t next_bytes, float* c, int64_t ldc) = nullptr;
  // iqgemm's row limit for MXFP4 strips (0: iqgemm has no MXFP4 products; AVX2's has).
  int64_t iqgemm_rows_fp4 = 0;
};

// tile_gemm's A layout, rows of K values in groups of 16: group g's k-block b (16 rows x 32 k, an
// AMX tile, 1 KB contiguous) at (g K / 32 + b) 512, its row r at 32 r. A group takes 16 K values, as
// 16 rows of stride K would. (Rows of a power-of-two stride fell in a few L1 sets.)
inline int64_t tiled_offset(int64_t r, int64_t k, int64_t K) {
  return (r / 16) * 16 * K + (k / 32) * 512 + (r % 16) * 32 + k % 32;
}

// Where the CPU has AVX512-VNNI: t's iqgemm becomes VNNI's (expert_isa_avx512vnni.cpp), for int8 and
// uint4 strips at every row count; elsewhere t is left as it is.
void with_vnni_products(ExpertIsa& t);

const ExpertIsa* avx2_expert_isa();
const ExpertIsa* avx512_expert_isa();  // isa.cpp: AVX2's kernels, VNNI's int8-activation products
const ExpertIsa* avx512bf16_expert_isa();
const ExpertIsa* amx_expert_isa();  // nullptr where the OS does not grant AMX tile state

// The table for the active ISA (isa.cpp), nullptr without AVX2.
const ExpertIsa* expert_isa();

}  // namespace moelight
