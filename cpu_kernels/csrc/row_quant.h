// The expert kernel's activation rows quantized to int8 per block of 32 k (RowQuant), iqgemm's
// operand, and the small helpers it shares with expert_mix.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "experts.h"
#include "kernels.h"

namespace moelight {
namespace row_quant {

inline float bf16_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A buffer of n values left uninitialised (std::vector would zero-fill it).
template <typename T>
inline std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// x rounded to the nearest integer, ties to even, for |x| < 2^22: adding 1.5 * 2^23 leaves no
// fraction bits, so the float add does the rounding (IEEE arithmetic: without -ffast-math the
// compiler may not fold it back to x). nearbyint's result, without the libm call per element that
// a build for baseline x86-64 (no SSE4.1 roundss) makes.
inline float round_even(float x) {
  constexpr float kBig = 12582912.0f;
  return (x + kBig) - kBig;
}

// One row's blocks of 32, scalar: codes q[k], scale and code sum per block.
inline void quantize_row_scalar(const uint16_t* a, int64_t k, int8_t* q, float* scale, int32_t* sum) {
  for (int64_t b = 0; b < k / 32; ++b) {
    float v[32], amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
      v[i] = bf16_float(a[b * 32 + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t qi = std::min(127, std::max(-127, static_cast<int32_t>(round_even(v[i] * inv))));
      q[b * 32 + i] = static_cast<int8_t>(qi);
      total += qi;
    }
    scale[b] = amax / 127.0f;
    sum[b] = total;
  }
}

// Which quantize loop this CPU runs: row_quant_avx512.cpp's, row_quant_avx2.cpp's or the scalar one (the same
// numbers; ~10x and ~5x faster than the scalar loop).
enum class QuantizeLoop { kScalar, kAvx2, kAvx512 };  // ordered: a CPU that runs one runs those before it

inline QuantizeLoop best_quantize_loop() {
#if defined(__x86_64__) || defined(_M_X64)
  static const QuantizeLoop loop = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return QuantizeLoop::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return QuantizeLoop::kAvx2;  // as isa.cpp
    return QuantizeLoop::kScalar;
  }();
  return loop;
#else
  return QuantizeLoop::kScalar;
#endif
}

inline void quantize_row(const uint16_t* a, int64_t k, int8_t* q, float* scale, int32_t* sum, QuantizeLoop loop) {
  switch (loop) {
    case QuantizeLoop::kAvx512:
      quantize_row32_avx512(a, k, q, scale, sum);
      break;
    case QuantizeLoop::kAvx2:
      quantize_row32_avx2(a, k, q, scale, sum);
      break;
    default:
      quantize_row_scalar(a, k, q, scale, sum);
  }
}

// bf16 activation rows quantized to int8 per block of 32 k (symmetric, round to nearest even):
// the operand of iqgemm. Filled only for the rows of experts that take that path.
struct RowQuant {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scale;
  std::unique_ptr<int32_t[]> sum;
  int64_t k;

  RowQuant(int64_t rows, int64_t k_)
      : q(uninitialized<int8_t>(rows * k_)), scale(uninitialized<float>(rows * k_ / 32)),
        sum(uninitialized<int32_t>(rows * k_ / 32)), k(k_) {}

  void quantize(const uint16_t* a, int64_t row) {
    quantize_row(a, k, q.get() + row * k, scale.get() + row * (k / 32), sum.get() + row * (k / 32), best_quantize_loop());
  }

  // Row `row` of this = row `from` of src (the same k).
  void copy_row(const RowQuant& src, int64_t from, int64_t row) {
    std::memcpy(q.get() + row * k, src.q.get() + from * k, k);
    std::memcpy(scale.get() + row * (k / 32), src.scale.get() + from * (k / 32), k / 32 * sizeof(float));
    std::memcpy(sum.get() + row * (k / 32), src.sum.get() + from * (k / 32), k / 32 * sizeof(int32_t));
  }

  QuantRows at(int64_t row) const {
    return QuantRows{q.get() + row * k, scale.get() + row * (k / 32), sum.get() + row * (k / 32), k};
  }
};

}  // namespace row_quant
}  // namespace moelight
