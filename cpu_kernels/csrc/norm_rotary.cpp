// The element-wise work between a decode step's matmuls, one pass each instead of torch's chain of
// small ops (at batch 1 each op's dispatch costs more than its arithmetic; BENCHMARKS §18 has the gain).
//
// rotary: x * cos + rotate_half(x) * sin, each product rounded to x's dtype and then the sum, as the
// three torch ops round them: the same values bit for bit in float32 and bf16 (no FMA contraction;
// float16 is left to torch).
// add_rms_norm: a residual add (x + delta, in float32 rounded to x's dtype, as torch's add) and rms_norm of the
// sum, in one call: a decode step's "h = x + attn_out; norm(h)" without the add's op.
// kv_write: a decode step's K and V rows copied into their cache slots (index_copy_ along the slot
// dimension, twice, in one call).
// rms_norm: transformers' RMSNorm for 16-bit activations: w * bf16(x * rsqrt(mean(x^2) + eps)), the
// mean in float32. Its sum runs in another order than torch's, so a 16-bit output can differ from
// torch's by one rounding step where the two means differ in their last bit; float32 models keep
// torch's norm (engine runs are exact against transformers there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#ifdef __clang__
#pragma clang fp contract(off)  // GCC: the functions' optimize attribute below
#endif

namespace moelight {
namespace {

// Rounding through the dtype as torch's element-wise ops round their results.
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// bf16 <-> float as c10::BFloat16 converts (round to nearest even, NaN to 0x7FC0), in plain integer
// operations the compiler vectorises.
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_rounded(float v) { return bf16_float(float_bf16(v)); }

// One head: out = round(round(x * cos) + round(rot * sin)), rot = (-x[half:], x[:half]).
__attribute__((optimize("fp-contract=off"))) void rotary_head(const float* x, const float* cos, const float* sin,
                                                              float* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + -x[i + half] * sin[i];
  for (int64_t i = half; i < 2 * half; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

__attribute__((optimize("fp-contract=off"))) void rotary_head(const uint16_t* x, const uint16_t* cos,
                                                              const uint16_t* sin, uint16_t* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16_rounded(bf16_float(x[i]) * bf16_float(cos[i]));
    const float b = bf16_rounded(-bf16_float(x[i + half]) * bf16_float(sin[i]));
    out[i] = float_bf16(a + b);
  }
  for (int64_t i = half; i < 2 * half; ++i) {
    const float a = bf16_rounded(bf16_float(x[i]) * bf16_float(cos[i]));
    const float b = bf16_rounded(bf16_float(x[i - half]) * bf16_float(sin[i]));
    out[i] = float_bf16(a + b);
  }
}

inline float to_float(c10::BFloat16 v) { return bf16_float(v.x); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline void store(c10::BFloat16& dst, float v) { dst.x = float_bf16(v); }
inline void store(c10::Half& dst, float v) { dst = static_cast<c10::Half>(v); }
inline float rounded_as(c10::BFloat16, float v) { return bf16_rounded(v); }
inline float rounded_as(c10::Half, float v) { return rounded<c10::Half>(v); }

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = to_float(x[i + l]);
      lane[l] += v * v;
    }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  for (; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) store(out[j], to_float(w[j]) * rounded_as(T(), to_float(x[j]) * inv));
}

}  // namespace

template <typename E>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), d = x.size(2), xr = x.stride(0), xh = x.stride(1);
  const E* xp = static_cast<const E*>(x.data_ptr());
  const E* cp = static_cast<const E*>(cos.data_ptr());
  const E* sp = static_cast<const E*>(sin.data_ptr());
  E* op = static_cast<E*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * d));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) rotary_head(xp + t * xr + h * xh, cp + t * d, sp + t * d, op + (t * H + h) * d, d / 2);
  });
}

// x [T, H, d] (d contiguous, rows and heads strided), cos / sin [T, d] in x's dtype (float32 or bf16) -> [T, H, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "moelight: rotary wants x [T, H, d] with d contiguous");
  const int64_t T = x.size(0), H = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d,
              "moelight: rotary wants cos / sin [T, d] for x [T, H, d], d even");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "moelight: rotary wants cos / sin in x's dtype");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({T, H, d}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(x, c, s, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moelight: rotary takes float32 or bf16");
    rotary_rows<uint16_t>(x, c, s, out);
  }
  return out;
}

// x [..., n] in bf16 / fp16, w [n] in x's dtype -> [..., n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "moelight: rms_norm is for 16-bit activations (float32 keeps torch's)");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "moelight: rms_norm wants a weight [n] in x's dtype for x [..., n]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "moelight_rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rms_norm_row<scalar_t>(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// x, delta [..., n] in bf16 / fp16 (the same shape), w [n] in x's dtype -> (x + delta, rms_norm(x + delta)).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "moelight: add_rms_norm is for 16-bit activations (float32 keeps torch's)");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "moelight: add_rms_norm wants delta of x's shape and dtype");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "moelight: add_rms_norm wants a weight [n] in x's dtype for x [..., n]");
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = w.contiguous();
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "moelight_add_rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* dp = dc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < n; ++j) store(sp[r * n + j], to_float(xp[r * n + j]) + to_float(dp[r * n + j]));
        rms_norm_row<scalar_t>(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// k_cache / v_cache [H, S, d], k / v [T, H, d] (d contiguous, any row and head strides), slots [T] int64:
// cache[:, slots[t]] = k[t], as index_copy_(1, slots, k.transpose(0, 1)) does.
void kv_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(k_cache.dim() == 3 && k.dim() == 3 && k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2),
              "moelight: kv_write wants k [T, H, d] for a cache [H, S, d]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v.sizes() == k.sizes(), "moelight: kv_write: K and V differ");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "moelight: kv_write wants the rows in the cache's dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "moelight: kv_write wants d contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong,
              "moelight: kv_write wants int64 slots [T]");
  const at::Tensor sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t T = k.size(0), H = k.size(1), d = k.size(2), S = k_cache.size(1), elem = k.element_size();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "moelight: kv_write slot ", sp[t], " out of range [0, ", S, ")");
  const auto copy = [&](at::Tensor& cache, const at::Tensor& rows, int64_t t0, int64_t t1) {
    char* cp = static_cast<char*>(cache.data_ptr());
    const char* rp = static_cast<const char*>(rows.data_ptr());
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(cp + (h * cache.stride(0) + sp[t] * cache.stride(1)) * elem,
                    rp + (t * rows.stride(0) + h * rows.stride(1)) * elem, d * elem);
  };
  // a decode step's few rows in this thread; a prompt's many in parallel, as index_copy_ would
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    copy(k_cache, k, t0, t1);
    copy(v_cache, v, t0, t1);
  });
}

}  // namespace moelight
