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
at::Tensor expert_mix(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const c10::optional<at::Tensor>& s13,
                      const c10::optional<at::Tensor>& z13, const at::Tensor& w2,
                      const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& z2,
                      const c10::optional<at::Tensor>& bias13, const c10::optional<at::Tensor>& bias2,
                      int64_t fmt13, int64_t group13, int64_t fmt2, int64_t group2, int64_t act_kind, double limit,
                      double alpha, bool int8_activations);
const char* set_expert_schedule(const char* name);
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k);
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor strip_linear(const at::Tensor& x, const at::Tensor& strips, const c10::optional<at::Tensor>& bias,
                        int64_t n);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps);
void kv_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots);
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_quant_int8(const at::Tensor& x, const std::string& loop_name);
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& x, const at::Tensor& gate_weight, int64_t k,
                                              bool normalize);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& lengths, int64_t page_size,
                                  double scale);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& starts,
                                   const at::Tensor& cu_seqlens, int64_t page_size, double scale);
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
  m.def("expert_mix(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor? s13, Tensor? z13, Tensor w2, "
        "Tensor? s2, Tensor? z2, Tensor? bias13, Tensor? bias2, int fmt13, int group13, int fmt2, int group2, "
        "int act, float limit, float alpha, bool int8_activations=True) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("strip_linear(Tensor x, Tensor strips, Tensor? bias, int n) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("row_quant_int8(Tensor x, str loop) -> (Tensor, Tensor, Tensor)");
  m.def("route_topk(Tensor x, Tensor gate_weight, int k, bool normalize) -> (Tensor, Tensor)");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths, "
        "int page_size, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor starts, "
        "Tensor cu_seqlens, int page_size, float scale) -> Tensor");
  m.def("kernel_isa() -> str", []() { return std::string(moelight::active_isa()); });
  m.def("set_expert_schedule(str name) -> str",
        [](const std::string& name) { return std::string(moelight::set_expert_schedule(name.c_str())); });
  m.def("set_isa(str name) -> str",
        [](const std::string& name) { return std::string(moelight::set_isa(name.c_str())); });
}

TORCH_LIBRARY_IMPL(moelight, CPU, m) {
  m.impl("decode_attention", &moelight::decode_attention);
  m.impl("prefill_attention", &moelight::prefill_attention);
  m.impl("stream_read", &moelight::stream_read);
  m.impl("expert_mix", &moelight::expert_mix);
  m.impl("topk_rows", &moelight::topk_rows);
  m.impl("small_linear", &moelight::small_linear);
  m.impl("strip_linear", &moelight::strip_linear);
  m.impl("rotary", &moelight::rotary);
  m.impl("rms_norm", &moelight::rms_norm);
  m.impl("add_rms_norm", &moelight::add_rms_norm);
  m.impl("kv_write", &moelight::kv_write);
  m.impl("row_quant_int8", &moelight::row_quant_int8);
  m.impl("route_topk", &moelight::route_topk);
  m.impl("paged_decode_attention", &moelight::paged_decode_attention);
  m.impl("paged_prefill_attention", &moelight::paged_prefill_attention);
}
