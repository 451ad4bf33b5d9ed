// torch.ops.moelight.route_topk: a decode step's router for its few bf16 rows in one op call: logits by
// small_linear, then softmax in float32, top-k and the renormalisation by the same ATen calls that
// models/moe.route makes from Python (so the same kernels, the same numbers), without a Python round
// trip through the dispatcher for each of the five (~3-5 us each, 8 routers a bench-1b step).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace moelight {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// x [T, h] bf16 (T <= small_linear's rows), gate weight [E, h] bf16 -> (weights [T, k] float32, experts [T, k]).
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& x, const at::Tensor& gate_weight, int64_t k,
                                              bool normalize) {
  const at::Tensor probs = at::softmax(small_linear(x, gate_weight, c10::nullopt).to(at::kFloat), -1);
  auto [weights, experts] = at::topk(probs, k, -1);
  if (normalize) weights = weights / weights.sum(-1, true);
  return {weights, experts};
}

}  // namespace moelight
