// Grouped-query decode attention over a ragged KV cache (one query token per sequence).
//
// Work item = (sequence, KV head, key chunk). Each item reads its [n, d] K and V block
// once for all Hq/Hkv query heads of the group. Long sequences are split into chunks
// (flash-decoding) so that few long sequences still spread over all threads; partial
// results (unnormalised acc, running max m, sum l) are merged afterwards. Items run
// in contiguous runs of shrinking size under dynamic scheduling (contiguous_runs).
//
// Attention sinks (GPT-OSS: one learned logit per query head in every softmax denominator,
// with no value) ride on the split-K merge: with sinks every sequence goes through the
// partial path, and the merge counts the sink as one more part with max = sink, sum = 1,
// acc = 0. The inner kernel is unchanged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "rows_out.h"

namespace moelight {
namespace {

struct Item {
  int64_t b, h, start, n;
  int64_t part;  // -1: whole sequence, written normalised into the output
  int64_t addr;  // first K element: items run in memory order
};

// q / output dtype the kernel handles directly; anything else goes through float32.
bool io_native(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Splits items (in memory order) into contiguous runs for dynamic scheduling: the first
// runs are 1/(4 nt) of the remaining work, shrinking to 1/(64 nt) of the total, so each
// thread streams long runs while the last runs are short. With equal runs of 1/(8 nt), the
// thread finishing last left the other idle for 2-7% of a call on average (measured),
// up to 17% when one core was slowed by the host; shrinking runs: 0.3% (1% at worst).
// Returns the first item of every run, then items.size().
std::vector<int64_t> contiguous_runs(const std::vector<Item>& items, int nt) {
  constexpr int64_t kItemOverhead = 32;  // fixed cost of an item, in keys
  int64_t work = 0;
  for (const Item& it : items) work += it.n + kItemOverhead;
  const int64_t min_run = std::max<int64_t>(1, work / (64 * nt));
  int64_t left = work;
  int64_t per_run = std::max(min_run, left / (4 * nt));
  std::vector<int64_t> run_start{0};
  int64_t acc_work = 0;
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t w = 0; w < n; ++w) {
    acc_work += items[w].n + kItemOverhead;
    if (acc_work >= per_run && w + 1 < n) {
      run_start.push_back(w + 1);
      left -= acc_work;
      acc_work = 0;
      per_run = std::max(min_run, left / (4 * nt));
    }
  }
  run_start.push_back(n);
  return run_start;
}

KvDtype kv_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::F32;
    case at::kBFloat16: return KvDtype::BF16;
    case at::kHalf: return KvDtype::F16;
    default: TORCH_CHECK(false, "moelight: unsupported KV dtype ", t.scalar_type());
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& offsets, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "moelight: bad ranks");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "moelight: K and V caches must match");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(2) == 1,
              "moelight: K/V caches need equal strides and contiguous head dim");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2);
  const int64_t Hkv = k_cache.size(0), T = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && Hkv > 0 && Hq % Hkv == 0, "moelight: head shapes");
  TORCH_CHECK(offsets.numel() == B && lengths.numel() == B, "moelight: offsets/lengths size");
  const AttnFn fn = attn_fn(kv_dtype(k_cache), d);
  TORCH_CHECK(fn != nullptr, "moelight: no kernel for this CPU / head dim ", d);

  const int64_t g = Hq / Hkv;
  at::Tensor sinks_f;
  const float* sp = sinks_f32(sinks, Hq, sinks_f);
  const bool with_sinks = sp != nullptr;
  // q and the output stay in the caller's dtype: no float32 copies (they cost a pass over
  // B x Hq x d and, for large B, most of the fixed per-sequence time).
  const at::Tensor qc = io_native(q.scalar_type()) ? q.contiguous() : q.to(at::kFloat).contiguous();
  const KvDtype io = kv_dtype(qc);
  const at::Tensor offs = offsets.to(at::kLong).contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  const int64_t* op = offs.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  at::Tensor out = at::empty({B, Hq, d}, qc.options());

  // Chunk length: long enough to stream efficiently, short enough for ~4 items per thread.
  const int nt = at::get_num_threads();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && op[b] >= 0 && op[b] + lp[b] <= T, "moelight: sequence ", b, " out of cache");
    total += lp[b];
  }
  int64_t chunk = std::max<int64_t>(256, (total * Hkv + 4 * nt - 1) / (4 * nt));
  chunk = (chunk + 15) / 16 * 16;

  std::vector<Item> items;
  items.reserve(B * Hkv);
  std::vector<int64_t> split_first;  // per split (b, h): first part index; parts are consecutive
  std::vector<std::pair<int64_t, int64_t>> split_bh;
  int64_t n_parts = 0;
  // Items in memory order, then contiguous runs (contiguous_runs): a thread walks a run as
  // one long stream per K and V, so the hardware prefetcher is not restarted at every item,
  // and dynamic scheduling of shrinking runs balances ragged lengths. Generated
  // head-major for a head-major cache (the engine's [Hkv, T, d]), so the sort is usually
  // skipped.
  const int64_t sh = k_cache.stride(0), st = k_cache.stride(1);
  auto add_items = [&](int64_t b, int64_t h) {
    const int64_t n = lp[b];
    if (n <= chunk && !with_sinks) {
      items.push_back({b, h, 0, n, -1, h * sh + op[b] * st});
      return;
    }
    split_first.push_back(n_parts);
    split_bh.emplace_back(b, h);
    for (int64_t s = 0; s < n; s += chunk)
      items.push_back({b, h, s, std::min(chunk, n - s), n_parts++, h * sh + (op[b] + s) * st});
  };
  if (sh >= T * st) {
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t b = 0; b < B; ++b) add_items(b, h);
  } else {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hkv; ++h) add_items(b, h);
  }
  split_first.push_back(n_parts);
  auto by_addr = [](const Item& x, const Item& y) { return x.addr < y.addr; };
  if (!std::is_sorted(items.begin(), items.end(), by_addr)) std::sort(items.begin(), items.end(), by_addr);
  const std::vector<int64_t> run_start = contiguous_runs(items, nt);

  at::Tensor part_acc = at::empty({n_parts, g, d}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({n_parts, 2, g}, q.options().dtype(at::kFloat));
  const void* qp = qc.data_ptr();
  void* outp = out.data_ptr();
  const at::ScalarType out_t = out.scalar_type();
  const int64_t ios = qc.element_size();
  float* pacc = part_acc.data_ptr<float>();
  float* pml = part_ml.data_ptr<float>();
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const int64_t es = k_cache.element_size();
  const int64_t n_runs = static_cast<int64_t>(run_start.size()) - 1;

  auto run_item = [&](const Item& it) {
    AttnArgs a{};
    const int64_t row0 = (it.b * Hq + it.h * g) * d;  // first q / output element of the item
    a.q = static_cast<const char*>(qp) + row0 * ios;
    a.q_dtype = io;
    a.bf16_p = io != KvDtype::F32;
    a.q_stride_i = 0;
    const int64_t kv_off = (it.h * sh + (op[it.b] + it.start) * st) * es;
    a.k = kp + kv_off;
    a.v = vp + kv_off;
    a.kv_stride_t = st;
    a.n_keys = it.n;
    a.n_queries = 1;
    a.group = static_cast<int>(g);
    a.causal_first = -1;
    a.scale = static_cast<float>(scale);
    if (it.part < 0) {
      a.out = static_cast<char*>(outp) + row0 * ios;
      a.out_dtype = io;
    } else {
      a.out = pacc + it.part * g * d;
      a.out_dtype = KvDtype::F32;
      a.m = pml + it.part * 2 * g;
      a.l = a.m + g;
    }
    fn(a);
  };

  // Every parallel region wakes the OpenMP workers, which costs a scheduler tick on a busy
  // machine: tiny calls (< ~256 KiB of K+V) stay on the calling thread.
  const bool parallel = n_runs > 1 && total * Hkv * d * es * 2 >= (256 << 10);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (parallel)
  for (int64_t run = 0; run < n_runs; ++run) {
    for (int64_t w = run_start[run]; w < run_start[run + 1]; ++w) run_item(items[w]);
  }

  // Merge split-K partials: rescale each part to the common max, then normalise.
  const int64_t n_splits = static_cast<int64_t>(split_bh.size());
#pragma omp parallel for num_threads(nt) schedule(static) if (n_splits > 1 && (!with_sinks || parallel))
  for (int64_t s = 0; s < n_splits; ++s) {
    const int64_t b = split_bh[s].first, h = split_bh[s].second;
    std::vector<float> row(d);
    for (int64_t j = 0; j < g; ++j) {
      float mx = -INFINITY;
      for (int64_t p = split_first[s]; p < split_first[s + 1]; ++p) mx = std::max(mx, pml[p * 2 * g + j]);
      const float sink = with_sinks ? sp[h * g + j] : -INFINITY;
      mx = std::max(mx, sink);
      float* dst = row.data();
      std::fill(dst, dst + d, 0.0f);
      float denom = with_sinks ? std::exp(sink - mx) : 0.0f;
      for (int64_t p = split_first[s]; p < split_first[s + 1]; ++p) {
        const float w = std::exp(pml[p * 2 * g + j] - mx);
        denom += w * pml[p * 2 * g + g + j];
        const float* src = pacc + (p * g + j) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] += w * src[c];
      }
      const float inv = 1.0f / denom;
      for (int64_t c = 0; c < d; ++c) dst[c] *= inv;
      store_row(outp, out_t, (b * Hq + h * g + j) * d, dst, d);
    }
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace moelight
