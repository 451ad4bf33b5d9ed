// The AMX latent kernel over groups of G blocks (16 G keys) with an online softmax: per group the scores,
// the running max and sum per head (the accumulator rows of heads whose max rose rescaled in AVX-512),
// and P.V of the same blocks, so an item's rows are read twice within a group (scores, then P.V, from
// L1 / L2) instead of twice over the whole item. The 16 x DV float accumulator (DV / 16 tiles) lives in
// scratch: each 64-column chunk's 4 C tiles are loaded, the group's products added, and stored back.
// Row-major caches and head counts a multiple of 16 (one tile configuration for both steps).
// Measured (benchmarks/results/latent_attention_one_pass.md): G = 4 beats the item-wide two passes on
// 512-key items (16 x 2048: the two passes over 590 KB, beside the next item's 590 KB prefetch, do not
// stay in L2) and loses on items of <= 160 keys (256 x 117: 64 KiB of accumulator traffic per group for
// rows that were in L2 anyway), so latent_attend_amx_any takes it for items over kGroupedMinKeys.
// A fragment of latent_amx.cpp: included inside its namespace, after the pieces it uses (NextItem,
// configure, score_blocks, store_columns, align64).
#pragma once

template <int DK, int DV, int G>
void latent_attend_amx_grouped(const moelight::LatentArgs& a) {
  static_assert(DK % 32 == 0 && DV % 64 == 0 && G >= 1 && G <= 16, "AMX steps; G blocks a pass");
  const int64_t n = a.n_keys;
  const int nb = static_cast<int>((n + kBlock - 1) / kBlock), tail_rows = static_cast<int>(n % kBlock);
  const int H = a.heads;
  constexpr int kMaxBlocks = static_cast<int>(moelight::kAmxMaxKeys) / kBlock;
  float* base = align64(a.scratch);
  uint32_t* qv = reinterpret_cast<uint32_t*>(base);
  float* st = base + DK / 2 * 16;       // G blocks of scores
  float* pb = st + kMaxBlocks * 256;    // G blocks of P_o, P_e
  float* acc = pb + G * 512;            // DV / 64 chunks of 4 tiles
  static_assert(G * 512 + DV * 16 <= kMaxBlocks * 512, "the accumulator fits the P region");
  uint16_t* tail = reinterpret_cast<uint16_t*>(pb + kMaxBlocks * 512 + 4 * 256);
  const uint16_t* blk[kMaxBlocks];
  block_rows<DK, false>(a, nb, tail_rows, tail, blk);
  const bool stream = a.out_dtype != moelight::KvDtype::F32 && reinterpret_cast<uintptr_t>(a.out) % 64 == 0 &&
                      DV * 2 % 64 == 0;
  const uint32_t* q32 = static_cast<const uint32_t*>(a.q);
  const int groups = H / 16, ng = (nb + G - 1) / G;
  NextItem next(a, static_cast<int64_t>(groups) * (DK / 32 + (ng * ((G + 2) / 3 * (DK / 64) + 1) + nb * (DV / 64)) + DV / 64 * 4));
  configure(16, true);  // 16 heads: one configuration for scores and P.V

  for (int h0 = 0; h0 < H; h0 += 16) {
    for (int p = 0; p < DK / 2; p += 16) {
      R r[16];
      for (int h = 0; h < 16; ++h) r[h] = V::load(reinterpret_cast<const float*>(q32 + (h0 + h) * (DK / 2) + p));
      V::transpose(r);
      for (int i = 0; i < 16; ++i) V::store(reinterpret_cast<float*>(qv + (p + i) * 16), r[i]);
      next.fetch();
    }
    const R sc = V::set1(a.scale);
    R mx = V::set1(-__builtin_inff()), l = V::zero();
    for (int b = 0; b < nb; b += G) {
      const int gb = nb - b < G ? nb - b : G;
      for (int s0 = 0; s0 < gb; s0 += 3) {  // score_blocks shares a query tile among up to 3 blocks
        const int sb = gb - s0 < 3 ? gb - s0 : 3;
        if (sb == 3) {
          score_blocks<DK, 3, false, false>(blk + b + s0, qv, st + s0 * 256, next);
        } else if (sb == 2) {
          score_blocks<DK, 2, false, false>(blk + b + s0, qv, st + s0 * 256, next);
        } else {
          score_blocks<DK, 1, false, false>(blk + b + s0, qv, st + s0 * 256, next);
        }
      }
      // online softmax over the group's keys
      const int64_t t0 = static_cast<int64_t>(b) * kBlock, t1 = t0 + gb * kBlock < n ? t0 + gb * kBlock : n;
      R bm = mx;
      for (int64_t t = t0; t < t1; ++t) bm = V::max(bm, V::mul(V::load(st + (t - t0) * 16), sc));
      const __mmask16 rose = _mm512_cmp_ps_mask(bm, mx, _CMP_GT_OQ);
      const R alpha = V::exp(V::sub(mx, bm));  // 0 on the first group (mx = -inf)
      l = V::mul(l, alpha);
      if (b > 0 && rose != 0) {
        alignas(64) float al[16];
        V::store(al, alpha);
        for (unsigned m = rose; m != 0; m &= m - 1) {
          const int h = __builtin_ctz(m);
          const R ah = V::set1(al[h]);
          for (int t = 0; t < DV / 16; ++t) V::store(acc + t * 256 + h * 16, V::mul(V::load(acc + t * 256 + h * 16), ah));
        }
      }
      mx = bm;
      for (int g = 0; g < gb; ++g) {
        R r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t t = t0 + g * kBlock + i;
          r[i] = t < n ? V::round_bf16(V::exp(V::sub(V::mul(V::load(st + (t - t0) * 16), sc), mx))) : V::zero();
          l = V::add(l, r[i]);
        }
        V::transpose(r);
        for (int h = 0; h < 16; ++h) {
          V::store(pb + g * 512 + h * 16, r[h]);
          _mm512_store_si512(pb + g * 512 + 256 + h * 16, _mm512_srli_epi32(_mm512_castps_si512(r[h]), 16));
        }
      }
      next.fetch();
      // P.V of the group's blocks, 64 columns at a time, into the accumulator
      if (gb == 1) {
        _tile_loadd(4, pb, 64);
        _tile_loadd(5, pb + 256, 64);
      }
      for (int c = 0; c < DV; c += 64) {
        float* oc = acc + c / 64 * 1024;
        if (b == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, oc, 64);
          _tile_loadd(1, oc + 256, 64);
          _tile_loadd(2, oc + 512, 64);
          _tile_loadd(3, oc + 768, 64);
        }
        for (int g = 0; g < gb; ++g) {
          if (gb > 1) {
            _tile_loadd(4, pb + g * 512, 64);
            _tile_loadd(5, pb + g * 512 + 256, 64);
          }
          _tile_loadd(6, blk[b + g] + c, DK * 2);
          _tile_dpbf16ps(0, 5, 6);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, blk[b + g] + c + 32, DK * 2);
          _tile_dpbf16ps(2, 5, 7);
          _tile_dpbf16ps(3, 4, 7);
          next.fetch();  // a few lines per block, as the two-pass kernel: bursts of prefetches are lost
        }
        _tile_stored(0, oc, 64);
        _tile_stored(1, oc + 256, 64);
        _tile_stored(2, oc + 512, 64);
        _tile_stored(3, oc + 768, 64);
      }
    }
    alignas(64) float mh[16], lh[16], inv[16];
    V::store(mh, mx);
    V::store(lh, l);
    for (int h = 0; h < 16; ++h) {
      inv[h] = a.m != nullptr ? 1.0f : (lh[h] > 0.0f ? 1.0f / lh[h] : 0.0f);
      if (a.m != nullptr) {
        a.m[h0 + h] = mh[h];
        a.l[h0 + h] = lh[h];
      }
    }
    for (int c = 0; c < DV; c += 64) store_columns(a, acc + c / 64 * 1024, inv, h0, 16, DV, c, stream, next);
  }
  _tile_release();
  if (stream) _mm_sfence();
}
