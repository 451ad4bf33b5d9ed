// Plain-C++ interface of the latent (MLA) decode kernel, as kernels.h is for the GQA ones: the ISA
// translation units that instantiate it never include torch headers.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace moelight {

// Bytes a work item reads: a run of consecutive cache rows.
struct LatentSpan {
  const void* p;
  int64_t bytes;
};

// One work item: every query head of one sequence against keys [0, n_keys) of its latent rows.
// A row is [latent (dv), RoPE key (dk - dv)]; the score of head h is q_h . row, its value the
// row's first dv elements. Rows are contiguous (stride dk elements of the cache dtype).
struct LatentArgs {
  const void* q;      // heads rows of dk elements (absorbed queries, unscaled), in q_dtype
  KvDtype q_dtype;
  const void* rows;   // n_keys rows of dk elements, in the cache dtype
  const void* const* blocks;  // or, where not null, the first row of each block of 16 keys (a paged
                              // cache's runs of whole pages: rows contiguous within a block)
  int64_t n_keys;
  int heads;
  float scale;
  void* out;          // heads rows of dv elements in out_dtype (F32 for partials)
  KvDtype out_dtype;
  bool bf16_p;        // P.V may take P rounded to bf16 (the output is 16-bit anyway)
  float* m;           // nullptr: write softmax-normalised rows; else the unnormalised accumulator
  float* l;           // and each head's running max m and sum l (split-K partials)
  float* scratch;     // latent_scratch_floats(heads, dk, dv) floats for this call's thread
  const LatentSpan* next = nullptr;  // the rows of this thread's next item (n_next spans), which the
  int n_next = 0;                    // AMX kernel prefetches into L2 while it computes this one
  bool tile_major = false;  // each block of 16 keys stored as dk / 32 contiguous [16 keys x 32] tiles
                            // (latent_tile_major_offset) instead of 16 rows: AMX kernel only
};

// Element offset of (key t, column c) within a tile-major block of 16 keys of width dk: the block is
// dk / 32 tiles of 16 x 32 elements, each tile one contiguous KiB in bf16.
constexpr int64_t latent_tile_major_offset(int64_t t, int64_t c) { return (c / 32) * 512 + t * 32 + c % 32; }

using LatentFn = void (*)(const LatentArgs&);

constexpr int64_t kLatentBlockKeys = 16;  // keys per block of the kernels (an AMX tile): LatentArgs::blocks

// Floats of per-thread scratch one call needs (queries, accumulators, scores, one widened block,
// maxima, the queries packed with heads in the lanes; the AVX2 kernel's 32 keys x 64 columns widened).
inline int64_t latent_scratch_floats(int64_t heads, int64_t dk, int64_t dv) {
  return heads * dk + heads * dv + 2 * heads * 16 + 16 * dk + heads + heads * dk + 32 * 64;
}

// AMX (latent_amx.cpp): a bf16 cache and bf16 queries, work items of at most kAmxMaxKeys keys, read in
// place block by block (LatentArgs::blocks) like the other kernels.
constexpr int64_t kAmxMaxKeys = 512;
inline int64_t latent_amx_scratch_floats(int64_t dk, int64_t dv) {
  (void)dv;  // the output goes out 64 columns at a time
  // alignment, query pairs, scores, probabilities (P_o and P_e), 4 output tiles, a zero-padded tail block
  return 16 + dk / 2 * 16 + kAmxMaxKeys * 16 + kAmxMaxKeys * 32 + 4 * 256 + 16 * dk / 2;
}
bool amx_usable();  // the CPU has AMX-BF16 and the OS let this process use its tiles

// nullptr when (dtype, dk, dv) has no instantiation for that ISA.
LatentFn amx_latent_fn(KvDtype dtype, int64_t dk, int64_t dv);
LatentFn avx512bf16_latent_fn(KvDtype dtype, int64_t dk, int64_t dv);
LatentFn avx512_latent_fn(KvDtype dtype, int64_t dk, int64_t dv);
LatentFn avx2_latent_fn(KvDtype dtype, int64_t dk, int64_t dv);

}  // namespace moelight
