// Plain-C++ interface between the torch-facing ops and the per-ISA attention kernels.
// The ISA translation units never include torch headers: they are compiled with
// `#pragma GCC target(...)`, and any inline torch/STL function compiled there could be
// merged by the linker with the generic copy and run AVX-512 code on a CPU without it.
#pragma once
#include <cstdint>

namespace moelight {

enum class KvDtype : int { F32 = 0, BF16 = 1, F16 = 2 };

// One attention tile: `n_queries` query positions x `group` query heads (one KV head)
// against keys [0, n_keys) of one contiguous-per-key region.
// Row r = (i, j) with i = r / group (query), j = r % group (head in the group).
struct AttnArgs {
  const void* q;         // row (i, j) at element i * q_stride_i + j * d, unscaled, in q_dtype
  int64_t q_stride_i;
  KvDtype q_dtype;       // q and the output are read / written in the caller's dtype, so a
  KvDtype out_dtype;     // bf16 model needs no float32 copies of them (F32 for partials)
  const void* k;         // key t at k + t * kv_stride_t elements (of the KV dtype)
  const void* v;
  int64_t kv_stride_t;
  int64_t n_keys;
  int n_queries;
  int group;
  int64_t causal_first;  // < 0: no mask; else query i sees keys [0, causal_first + i]
  float scale;
  void* out;             // row (i, j) at element i * out_stride_i + j * d, in out_dtype
  int64_t out_stride_i;
  bool bf16_p;           // P.V may take P rounded to bf16 (AVX512-BF16 on a bf16 cache): set
                         // when the caller's output is bf16 / f16 anyway
  float* m;              // nullptr: write softmax-normalised rows. Otherwise write the
  float* l;              // unnormalised accumulator plus running max m and sum l per row
                         // (split-K partials, merged by the caller).
};

using AttnFn = void (*)(const AttnArgs&);

// nullptr when (dtype, d) has no instantiation for that ISA.
AttnFn avx512bf16_attn_fn(KvDtype dtype, int64_t d);
AttnFn avx512_attn_fn(KvDtype dtype, int64_t d);
AttnFn avx2_attn_fn(KvDtype dtype, int64_t d);

// out[r][n] = sum_k x[r][k] w[n][k] for r < m <= 4, n in [n0, n1): float32 rows x [m, k], a bf16
// weight w [N, k] row-major, out float32 of row stride ldo (small_linear_avx2.cpp).
void small_linear_rows_avx2(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k,
                            float* out, int64_t ldo);
// The same on AVX-512 (small_linear_avx512.cpp), for the AVX-512 ISA levels.
void small_linear_rows_avx512(const float* x, int64_t m, const uint16_t* w, int64_t n0, int64_t n1, int64_t k,
                              float* out, int64_t ldo);

// c[r][0, 32) = sum_k a[r][k] strip[k][.] for r < m <= 64: float32 rows a of stride lda times one bf16 strip of
// depth k in the expert kernel's pair layout (experts.h), on AVX2 + FMA (strip_gemm_avx2.cpp, for strip_linear).
void strip_gemm_avx2(const float* a, int64_t lda, int64_t m, const uint16_t* strip, int64_t k, float* c);
// out[r][0, 32) = bf16(c[r][0, 32) + bias) for r < m (bias: 32 floats or nullptr), rounded as torch rounds.
void strip_out_avx2(const float* c, int64_t m, const float* bias, uint16_t* out, int64_t ldo);

// Activation rows quantized to int8 per block of 32 k (row_quant.h's RowQuant) on AVX-512: codes q[k], and per
// block its scale and code sum, bit for bit the scalar loop's (row_quant_avx512.cpp).
void quantize_row32_avx512(const uint16_t* a, int64_t k, int8_t* q, float* scale, int32_t* sum);
// The same on AVX2 (row_quant_avx2.cpp).
void quantize_row32_avx2(const uint16_t* a, int64_t k, int8_t* q, float* scale, int32_t* sum);

// Active kernel table, chosen from the CPU at first use (see isa.cpp).
AttnFn attn_fn(KvDtype dtype, int64_t d);
const char* active_isa();
// "auto", "amx", "avx512bf16", "avx512", "avx2" or "none"; returns the ISA now in use ("amx": the
// AVX512-BF16 attention kernels and AMX-BF16 expert GEMMs).
const char* set_isa(const char* name);

}  // namespace moelight
