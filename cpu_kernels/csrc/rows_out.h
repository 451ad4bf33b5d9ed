// Helpers of the torch-facing ops (the ISA units never include them: no torch headers there, see
// kernels.h): writing a float32 row in the caller's dtype, reading the optional attention sinks.
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

// Attention sinks as float32 [Hq], or nullptr without them; `keep` holds the converted copy.
inline const float* sinks_f32(const c10::optional<at::Tensor>& sinks, int64_t hq, at::Tensor& keep) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->numel() == hq, "moelight: sinks need one value per query head");
  keep = sinks->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

}  // namespace moelight
