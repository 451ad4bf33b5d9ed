// torch.ops.moelight.small_linear: y = x W^T + b for a bf16 weight W [N, K] and a few rows of x
// (at most kSmallLinearRows), the decode-time matmuls of a CPU whose oneDNN packs no bf16 weights.
// There the engine keeps a packed float32 copy for large batches; reading the bf16 weight itself
// moves half the bytes, and at a few rows the matmul is bound by those bytes. Output rows are the
// float32 sums (plus bias) rounded to x's dtype, as the float32-copy path rounds them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "kernels.h"

namespace moelight {

constexpr int64_t kSmallLinearRows = 4;
// Output rows per thread at least: 64 rows of a 1024-wide weight are 128 KB, enough to amortise a
// thread's start; a K/V projection (a few hundred rows) still splits across the threads.
constexpr int64_t kRowsPerThread = 64;

namespace {

// Rows [0, m) x columns [n0, n1) of y (float32 sums, row stride n) plus the bias, rounded to out's dtype.
template <typename T>
void round_out(const float* y, const float* bias, int64_t m, int64_t n0, int64_t n1, int64_t n, T* out) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = n0; j < n1; ++j) out[r * n + j] = static_cast<T>(bias ? y[r * n + j] + bias[j] : y[r * n + j]);
}

}  // namespace

// The float32 rows, the sums and the rounded output without a torch op between them (each costs a decode
// step's 25 calls a dispatch and an allocation): bf16 rows widened here, each thread's columns rounded as
// soon as they are summed. The numbers of x.to(float) -> sums -> + bias -> .to(x's dtype).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "moelight: small_linear wants a contiguous bf16 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(-1) == k, "moelight: small_linear input has " + std::to_string(x.size(-1)) +
                                   " features, the weight " + std::to_string(k));
  const int64_t m = k ? x.numel() / k : 0;
  TORCH_CHECK(m <= kSmallLinearRows, "moelight: small_linear takes at most " + std::to_string(kSmallLinearRows) +
                                         " rows, got " + std::to_string(m));
  const bool has_bias = bias.has_value() && bias->defined();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  if (std::strcmp(active_isa(), "none") == 0) {  // set_isa("none"): the same sums through torch
    const at::Tensor xf = x.reshape({-1, k}).to(at::kFloat);
    at::Tensor y = at::linear(xf, w.to(at::kFloat), has_bias ? bias->to(at::kFloat) : at::Tensor());
    return y.to(x.scalar_type()).view(sizes);
  }
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "moelight: small_linear takes float32, bf16 or float16 rows");
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  std::unique_ptr<float[]> xbuf;
  const float* xp;
  if (dt == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xbuf.reset(new float[std::max<int64_t>(1, m * k)]);
    if (dt == at::kBFloat16) {
      const c10::BFloat16* src = xc.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < m * k; ++i) xbuf[i] = static_cast<float>(src[i]);
    } else {
      const c10::Half* src = xc.data_ptr<c10::Half>();
      for (int64_t i = 0; i < m * k; ++i) xbuf[i] = static_cast<float>(src[i]);
    }
    xp = xbuf.get();
  }
  at::Tensor bf;
  const float* bp = nullptr;
  if (has_bias) {
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  auto out = at::empty(sizes, x.options());
  std::unique_ptr<float[]> ybuf;
  float* yp;
  if (dt == at::kFloat && !bp) {
    yp = out.data_ptr<float>();
  } else {
    ybuf.reset(new float[std::max<int64_t>(1, m * n)]);
    yp = ybuf.get();
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const bool wide = std::strcmp(active_isa(), "avx2") != 0;  // an AVX-512 level
  void* op = out.data_ptr();
  if (m > 0) {
    at::parallel_for(0, n, kRowsPerThread, [&](int64_t n0, int64_t n1) {
      (wide ? small_linear_rows_avx512 : small_linear_rows_avx2)(xp, m, wp, n0, n1, k, yp, n);
      if (dt == at::kBFloat16) {
        round_out(yp, bp, m, n0, n1, n, static_cast<c10::BFloat16*>(op));
      } else if (dt == at::kHalf) {
        round_out(yp, bp, m, n0, n1, n, static_cast<c10::Half*>(op));
      } else if (bp) {
        round_out(yp, bp, m, n0, n1, n, static_cast<float*>(op));
      }
    });
  }
  return out;
}

}  // namespace moelight
