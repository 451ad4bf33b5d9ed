// Top-k of every row of a float32 matrix (the sampler's greedy argmax and its top-k threshold over a
// large vocabulary): rows in parallel, each read once. Per row, 16 lanes of running maxima (an
// element-wise max the compiler vectorises) give k = 1 in one pass plus a short search for the
// first index holding the maximum (torch.argmax's tie rule); for k > 1 a chunk of 16 values is
// looked at one by one only when one of them beats the k-th best so far.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace moelight {
namespace {

constexpr int64_t kLanes = 16;

int64_t argmax_row(const float* x, int64_t n, float& best) {
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = lane[l] < x[i + l] ? x[i + l] : lane[l];
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, lane[l]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  best = m;
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // every value NaN or -inf-less: as torch, index 0 of an all-NaN row is not specified
}

// k best (value, index) of a row, value descending then index ascending.
void topk_row(const float* x, int64_t n, int64_t k, float* vals, int64_t* idx) {
  using P = std::pair<float, int64_t>;
  auto worse = [](const P& a, const P& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::vector<P> heap;  // min-heap under `worse`: heap.front() is the k-th best
  heap.reserve(k + 1);
  float thresh = -std::numeric_limits<float>::infinity();
  auto offer = [&](int64_t j) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(x[j], j);
      std::push_heap(heap.begin(), heap.end(), worse);
      if (static_cast<int64_t>(heap.size()) == k) thresh = heap.front().first;
    } else if (x[j] > thresh) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = P(x[j], j);
      std::push_heap(heap.begin(), heap.end(), worse);
      thresh = heap.front().first;
    }
  };
  int64_t i = 0;
  for (; i < std::min(n, k); ++i) offer(i);
  for (; i + kLanes <= n; i += kLanes) {
    bool any = false;
    for (int64_t l = 0; l < kLanes; ++l) any |= x[i + l] > thresh;
    if (any)
      for (int64_t l = 0; l < kLanes; ++l) offer(i + l);
  }
  for (; i < n; ++i) offer(i);
  std::sort(heap.begin(), heap.end(), worse);
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = heap[j].first;
    idx[j] = heap[j].second;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "moelight: topk_rows wants contiguous float32 [B, V]");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "moelight: topk_rows k = ", k, " must be in [1, ", V, "]");
  auto vals = at::empty({B, k}, x.options());
  auto idx = at::empty({B, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (k == 1) {
        ip[b] = argmax_row(xp + b * V, V, vp[b]);
      } else {
        topk_row(xp + b * V, V, k, vp + b * k, ip + b * k);
      }
    }
  });
  return {vals, idx};
}

}  // namespace moelight
