// torch.ops.moelight.strip_linear: y = x W^T + b for a bf16 weight W [N, K] packed in the expert kernel's
// strips (experts.h: 32 output columns a strip, pair layout): 1-2 rows by the expert kernel's bf16 GEMM (the bf16
// rows widened in registers), more on float32 copies of the rows by strip_gemm_avx2.cpp's.
// For CPUs whose oneDNN packs no bf16 weights (AVX2, AVX-512 without BF16): there the engine otherwise holds
// a packed float32 copy of every attention projection and the LM head, twice the bytes, which is what a
// 30B-parameter model's int4 job lacks on a 24 GiB host. The GEMM widens bf16 to float32 in registers and
// sums in float32, so every product is exact as with the float32 copy; the sums round to bf16 once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "experts.h"
#include "kernels.h"

namespace moelight {
namespace {

// Rows per GEMM call: their float32 sums (64 x 32 floats, 8 KB) stay in L1 beside the widened k-block (16 KB).
constexpr int64_t kRowBlock = 64;
// Rows widened to float32 at once (at most 512 x K floats): each thread reads a strip once per such pass and
// multiplies it with all of the pass's row blocks while it is in L2.
constexpr int64_t kRowPass = 512;

// Rows [0, m) of c (float32 sums, 32 a row) plus bias[0, width), rounded into out (row stride ldo).
void rows_out(const float* c, int64_t m, const float* bias, int64_t width, c10::BFloat16* out, int64_t ldo) {
  if (width == 32) return strip_out_avx2(c, m, bias, reinterpret_cast<uint16_t*>(out), ldo);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t q = 0; q < width; ++q) out[r * ldo + q] = static_cast<c10::BFloat16>(c[r * 32 + q] + (bias ? bias[q] : 0.f));
}

}  // namespace

at::Tensor strip_linear(const at::Tensor& x, const at::Tensor& strips, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moelight: strip_linear takes bf16 rows");
  TORCH_CHECK(strips.scalar_type() == at::kBFloat16 && strips.dim() == 2 && strips.is_contiguous(),
              "moelight: strip_linear wants contiguous bf16 strips [S, K * 32]");
  const int64_t k = x.size(-1), s = strips.size(0);
  TORCH_CHECK(k % 32 == 0 && strips.size(1) == k * 32, "moelight: strip_linear input has ", k,
              " features; the strips hold ", strips.size(1) / 32, " (a multiple of 32)");
  TORCH_CHECK(n > 0 && (n + 31) / 32 == s, "moelight: strip_linear: ", s, " strips cannot hold ", n, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!has_bias || bf.numel() == n, "moelight: strip_linear bias has ", bf.numel(), " values, not ", n);
  const ExpertIsa* isa = expert_isa();
  if (!isa || !isa->gemm || isa->row_step != 1 || isa->tile_gemm) {
    // set_isa("none"), or a level whose GEMM takes tiles of rows: the same float32 sums through torch
    const at::Tensor w = strips.view({s, k / 2, 32, 2}).permute({0, 2, 1, 3}).reshape({s * 32, k}).narrow(0, 0, n);
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), bf).to(at::kBFloat16);
  }
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t m = xc.numel() / k;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const auto* a = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(strips.data_ptr());
  const float* bp = has_bias ? bf.data_ptr<float>() : nullptr;
  auto* y = out.data_ptr<c10::BFloat16>();
  for (int64_t r0 = 0; r0 < m; r0 += kRowPass) {
    const int64_t rows = std::min(kRowPass, m - r0);
    const at::Tensor af = rows >= 3 ? xc.reshape({m, k}).narrow(0, r0, rows).to(at::kFloat).contiguous() : at::Tensor();
    const float* ap = rows >= 3 ? af.data_ptr<float>() : nullptr;
    at::parallel_for(0, s, 1, [&](int64_t s0, int64_t s1) {
      alignas(64) float c[kRowBlock * 32];
      for (int64_t j = s0; j < s1; ++j) {
        const uint16_t* strip = w + j * k * 32;
        const int64_t n0 = j * 32;
        for (int64_t b0 = 0; b0 < rows; b0 += kRowBlock) {
          const int64_t br = std::min(kRowBlock, rows - b0);
          if (br >= 3) {  // the float32 rows' kernel; 1-2 rows: the expert GEMM's, widening them in registers
            strip_gemm_avx2(ap + b0 * k, k, br, strip, k, c);
          } else {
            isa->gemm(a + (r0 + b0) * k, k, br, strip, k, nullptr, 0, c, 32);
          }
          rows_out(c, br, bp ? bp + n0 : nullptr, std::min<int64_t>(32, n - n0), y + (r0 + b0) * n + n0, n);
        }
      }
    });
  }
  return out;
}

}  // namespace moelight
