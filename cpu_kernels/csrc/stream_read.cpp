// Streaming read of a tensor's bytes: the machine's achievable read bandwidth, measured
// the same way the attention kernel reads (OpenMP threads, sequential 64-bit loads).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace moelight {

double stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous(), "moelight: stream_read wants a contiguous tensor");
  const auto* p = static_cast<const uint64_t*>(x.data_ptr());
  const int64_t n = x.numel() * x.element_size() / 8;
  uint64_t acc = 0;
  const int nt = at::get_num_threads();
#pragma omp parallel for num_threads(nt) schedule(static) reduction(^ : acc)
  for (int64_t i = 0; i < n; ++i) acc ^= p[i];
  return static_cast<double>(acc & 0xFFFF);  // returned so the loads are not optimised away
}

}  // namespace moelight
