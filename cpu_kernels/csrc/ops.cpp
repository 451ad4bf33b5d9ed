// Registers the moelight CPU ops with the dispatcher (torch.ops.moelight.*). Ops called
// through torch.ops release the GIL while they run.
#include <torch/library.h>

#include <string>

#include "kernels.h"

namespace moelight {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& offsets, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& sinks);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens, double scale, int64_t window,
                             const c10::optional<at::Tensor>& sinks);
double stream_read(const at::Tensor& x);
}  // namespace moelight

#ifdef MOELIGHT_SOURCE_HASH
// Stamps the library with the hash of the sources it was built from (setup.py passes it), so
// cpu_kernels/build.py can refuse a stale install-time build without loading it.
#define MOELIGHT_STR2(x) #x
#define MOELIGHT_STR(x) MOELIGHT_STR2(x)
extern "C" __attribute__((used)) const char moelight_source_hash[] =
    "moelight-source-hash=" MOELIGHT_STR(MOELIGHT_SOURCE_HASH) ";";
#endif

TORCH_LIBRARY(moelight, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor offsets, Tensor lengths, "
        "float scale, Tensor? sinks=None) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, int window=0, "
        "Tensor? sinks=None) -> Tensor");
  m.def("stream_read(Tensor x) -> float");
  m.def("kernel_isa() -> str", []() { return std::string(moelight::active_isa()); });
  m.def("set_isa(str name) -> str",
        [](const std::string& name) { return std::string(moelight::set_isa(name.c_str())); });
}

TORCH_LIBRARY_IMPL(moelight, CPU, m) {
  m.impl("decode_attention", &moelight::decode_attention);
  m.impl("prefill_attention", &moelight::prefill_attention);
  m.impl("stream_read", &moelight::stream_read);
}
