// Packs a layer's expert codes and scales into the fused kernel's strips (csrc/experts.h; the layout
// cpu_kernels/expert_pack.py's torch reference builds): one pass from the canonical [E, N, K] arrays
// straight into the caller's buffers, experts' strips in parallel, no full-size temporaries. The torch
// formulation (pad, interleave gate/up, unpack nibbles, permute, OR back) made ~6 full-size copies and
// took ~1.5 s per Qwen3-30B-A3B int4 layer on 2 cores; this is bound by the write of the output.
//
// `rows` [n_pad] maps each output row to its source row (-1: a zero row): the gate/up interleave and
// the padding to whole strips are that map. Columns from the source's K up to the padded K are zero.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace moelight {
namespace {

constexpr int64_t kStrip = 32;
constexpr int64_t kTile = 64;  // pair columns per tile: a tile of one strip's output is 4-8 KiB (L1)

// One strip of 1- or 2-byte elements: out[kk][c] = the pair (2 kk, 2 kk + 1) of source row c.
template <typename Pair, typename Elem>
void pair_strip(const Elem* const* src, int64_t k, int64_t pairs_out, Pair* out) {
  const int64_t full = k / 2, any = (k + 1) / 2;
  for (int64_t t0 = 0; t0 < pairs_out; t0 += kTile) {
    const int64_t t1 = std::min(t0 + kTile, pairs_out);
    for (int64_t c = 0; c < kStrip; ++c) {
      const Elem* row = src[c];
      const Pair* pairs = reinterpret_cast<const Pair*>(row);
      for (int64_t kk = t0; kk < t1; ++kk) {
        Pair v{};
        if (row != nullptr && kk < full) {
          std::memcpy(&v, pairs + kk, sizeof(Pair));
        } else if (row != nullptr && kk < any) {  // odd K: the last pair's second element is padding
          Elem half[2] = {row[2 * kk], Elem{}};
          std::memcpy(&v, half, sizeof(Pair));
        }
        out[kk * kStrip + c] = v;
      }
    }
  }
}

// One strip of 4-bit codes (two a byte, element 2b in the low nibble of byte b): output byte i of pair
// column kk holds element 2 kk + i % 2 of row i / 2 (low nibble) and of row 16 + i / 2 (high nibble).
void nibble_strip(const uint8_t* const* src, int64_t kb, int64_t bytes_out, uint8_t* out) {
  for (int64_t t0 = 0; t0 < bytes_out; t0 += kTile) {
    const int64_t t1 = std::min(t0 + kTile, bytes_out);
    for (int64_t c = 0; c < kStrip / 2; ++c) {
      const uint8_t* lo = src[c];
      const uint8_t* hi = src[c + kStrip / 2];
      for (int64_t kk = t0; kk < t1; ++kk) {
        const uint8_t a = (lo != nullptr && kk < kb) ? lo[kk] : 0;
        const uint8_t b = (hi != nullptr && kk < kb) ? hi[kk] : 0;
        out[kk * kStrip + 2 * c] = static_cast<uint8_t>((a & 0x0F) | (b << 4));
        out[kk * kStrip + 2 * c + 1] = static_cast<uint8_t>((a >> 4) | (b & 0xF0));
      }
    }
  }
}

void check_rows(const at::Tensor& rows, int64_t n) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) % kStrip == 0,
              "moelight: pack rows wants contiguous int64 [n_pad], n_pad a multiple of 32");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= -1 && r[i] < n, "moelight: pack row ", i, " maps to ", r[i], " of ", n, " rows");
}

}  // namespace

// codes [E, N, Kc] (bf16 / int8 / uint8; nibble: uint8 with K = 2 Kc) -> out [E, n_pad / 32, k_pad * 32
// elements] (nibble: k_pad / 2 * 32 bytes).
void pack_code_strips(const at::Tensor& codes, const at::Tensor& rows, int64_t k_pad, bool nibble,
                      const at::Tensor& out) {
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && out.is_contiguous() &&
                  out.scalar_type() == codes.scalar_type(),
              "moelight: pack_code_strips wants contiguous codes [E, N, K] and an out of their dtype");
  const int64_t E = codes.size(0), N = codes.size(1), kc = codes.size(2), es = codes.element_size();
  TORCH_CHECK(es == 1 || es == 2, "moelight: pack_code_strips takes 1- or 2-byte codes");
  TORCH_CHECK(!nibble || es == 1, "moelight: 4-bit codes come two to a uint8");
  check_rows(rows, N);
  const int64_t k = nibble ? 2 * kc : kc, S = rows.size(0) / kStrip;
  TORCH_CHECK(k_pad >= k && k_pad % 2 == 0, "moelight: padded K ", k_pad, " below K ", k, " or odd");
  const int64_t strip_bytes = nibble ? k_pad / 2 * kStrip : k_pad * kStrip * es;
  TORCH_CHECK(out.numel() * es == E * S * strip_bytes, "moelight: pack_code_strips out has ", out.numel(),
              " elements, the strips need ", E * S * strip_bytes / es);
  const auto* in = static_cast<const uint8_t*>(codes.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t row_bytes = kc * es;
  at::parallel_for(0, E * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t e = u / S, s = u % S;
      const uint8_t* src[kStrip];
      for (int64_t c = 0; c < kStrip; ++c) {
        const int64_t sr = r[s * kStrip + c];
        src[c] = sr < 0 ? nullptr : in + (e * N + sr) * row_bytes;
      }
      uint8_t* o = dst + u * strip_bytes;
      if (nibble) {
        nibble_strip(src, kc, k_pad / 2, o);
      } else if (es == 1) {
        pair_strip<uint16_t, uint8_t>(src, k, k_pad / 2, reinterpret_cast<uint16_t*>(o));
      } else {
        pair_strip<uint32_t, uint16_t>(reinterpret_cast<const uint16_t* const*>(src), k, k_pad / 2,
                                       reinterpret_cast<uint32_t*>(o));
      }
    }
  });
}

// float32 per (row, group) t [E, N, G] -> out [E, n_pad / 32, g_pad, 32] (groups from G up: zero).
void pack_group_strips(const at::Tensor& t, const at::Tensor& rows, int64_t g_pad, const at::Tensor& out) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.is_contiguous() && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "moelight: pack_group_strips wants contiguous float32 [E, N, G] and a float32 out");
  const int64_t E = t.size(0), N = t.size(1), G = t.size(2);
  check_rows(rows, N);
  const int64_t S = rows.size(0) / kStrip;
  TORCH_CHECK(g_pad >= G && out.numel() == E * S * g_pad * kStrip, "moelight: pack_group_strips out size");
  const float* in = t.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  at::parallel_for(0, E * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t e = u / S, s = u % S;
      float* o = dst + u * g_pad * kStrip;
      for (int64_t c = 0; c < kStrip; ++c) {
        const int64_t sr = r[s * kStrip + c];
        const float* row = sr < 0 ? nullptr : in + (e * N + sr) * G;
        for (int64_t gi = 0; gi < g_pad; ++gi) o[gi * kStrip + c] = (row != nullptr && gi < G) ? row[gi] : 0.0f;
      }
    }
  });
}

}  // namespace moelight

TORCH_LIBRARY_FRAGMENT(moelight, m) {
  m.def("pack_code_strips(Tensor codes, Tensor rows, int k_pad, bool nibble, Tensor(a!) out) -> ()");
  m.def("pack_group_strips(Tensor t, Tensor rows, int g_pad, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moelight, CPU, m) {
  m.impl("pack_code_strips", &moelight::pack_code_strips);
  m.impl("pack_group_strips", &moelight::pack_group_strips);
}
