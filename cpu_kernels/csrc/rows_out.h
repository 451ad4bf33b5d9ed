// Writing a float32 row into the caller's dtype, rounded as at::Tensor::to rounds. Shared by the
// torch-facing ops (the ISA units never include it: no torch headers there, see kernels.h).
#pragma once
#include <ATen/ATen.h>

namespace moelight {

inline void store_row(void* out, at::ScalarType t, int64_t off, const float* row, int64_t d) {
  for (int64_t c = 0; c < d; ++c) {
    if (t == at::kFloat) static_cast<float*>(out)[off + c] = row[c];
    else if (t == at::kBFloat16) static_cast<c10::BFloat16*>(out)[off + c] = c10::BFloat16(row[c]);
    else static_cast<c10::Half*>(out)[off + c] = c10::Half(row[c]);
  }
}

}  // namespace moelight
