// Attention over a paged KV cache: each sequence's keys live in fixed-size pages named by its block
// table (prefix sharing: sequences with a common prefix point at the same pages).
//
// The cache is the engine's [Hkv, pages * page_size, d] per layer; page p of a sequence holds its
// positions [p * page_size, (p + 1) * page_size). Consecutive page ids are coalesced into runs, so
// a sequence whose pages follow each other is one contiguous block per head, as in the ragged
// kernel. Both ops run the same per-ISA tile kernel (attend_kernel.h) over each run and merge the
// runs' partial results (running max, sum, unnormalised accumulator) in float32.
//
// - paged_decode_attention: one query per sequence over its `lengths[b]` keys. Work item =
//   (sequence, KV head, run chunk); a sequence of one short run writes its output directly,
//   longer ones go through split-K partials merged afterwards (flash-decoding).
// - paged_prefill_attention: the new tokens of each sequence (queries at positions
//   starts[b] .. starts[b] + n_b - 1, their K/V already written to the cache) over every key
//   before them: a cached prefix plus themselves, causal. Work item = (sequence, KV head, block of
//   queries); its thread walks the runs and merges as it goes.
// Sliding windows and sinks are not served here (the caller falls back to the torch reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "page_runs.h"
#include "rows_out.h"

namespace moelight {
namespace {

KvDtype paged_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::F32;
    case at::kBFloat16: return KvDtype::BF16;
    case at::kHalf: return KvDtype::F16;
    default: TORCH_CHECK(false, "moelight: unsupported dtype ", t.scalar_type());
  }
}

// Merge a partial (m2, l2, acc2 of `rows` x d) into the running one (m, l, acc).
void merge_rows(float* m, float* l, float* acc, const float* m2, const float* l2, const float* acc2,
                int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    if (l2[r] == 0.0f) continue;
    const float mx = std::max(m[r], m2[r]);
    const float a = m[r] == -INFINITY ? 0.0f : std::exp(m[r] - mx), b = std::exp(m2[r] - mx);
    for (int64_t c = 0; c < d; ++c) acc[r * d + c] = acc[r * d + c] * a + acc2[r * d + c] * b;
    l[r] = l[r] * a + l2[r] * b;
    m[r] = mx;
  }
}

struct Common {
  AttnFn fn;
  const char* kp;
  const char* vp;
  int64_t es, sh, st, Hq, Hkv, g, d;
  KvDtype io;
  int64_t ios;
  float scale;
};

Common common_of(const at::Tensor& qc, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  k.stride(2) == 1 && k.scalar_type() == v.scalar_type(),
              "moelight: paged K/V caches must match, head dim contiguous");
  Common c{};
  c.d = qc.size(-1);
  c.Hq = qc.size(-2);
  c.Hkv = k.size(0);
  TORCH_CHECK(k.size(2) == c.d && c.Hkv > 0 && c.Hq % c.Hkv == 0, "moelight: head shapes");
  c.fn = attn_fn(paged_dtype(k), c.d);
  TORCH_CHECK(c.fn != nullptr, "moelight: no kernel for this CPU / head dim ", c.d);
  c.kp = static_cast<const char*>(k.data_ptr());
  c.vp = static_cast<const char*>(v.data_ptr());
  c.es = k.element_size();
  c.sh = k.stride(0);
  c.st = k.stride(1);
  c.g = c.Hq / c.Hkv;
  c.io = paged_dtype(qc);
  c.ios = qc.element_size();
  c.scale = static_cast<float>(scale);
  return c;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& lengths, int64_t page_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && block_table.dim() == 2 && page_size > 0, "moelight: bad paged decode arguments");
  const bool native = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  const at::Tensor qc = native ? q.contiguous() : q.to(at::kFloat).contiguous();
  const Common c = common_of(qc, k_cache, v_cache, scale);
  const int64_t B = q.size(0), d = c.d, g = c.g;
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(table.size(0) == B && lens.numel() == B, "moelight: block table / lengths size");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t max_pages = table.size(1), slots = k_cache.size(1);

  struct Item { int64_t b, h, slot, n, part; };
  std::vector<Item> items;
  std::vector<int64_t> first_part(B * c.Hkv + 1, 0);
  const int nt = at::get_num_threads();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lp[b];
  int64_t chunk = std::max<int64_t>(256, (total * c.Hkv + 4 * nt - 1) / (4 * nt));
  chunk = (chunk + 15) / 16 * 16;
  int64_t n_parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<Run> runs = runs_of(tp + b * max_pages, max_pages, lp[b], page_size, slots);
    for (int64_t h = 0; h < c.Hkv; ++h) {
      first_part[b * c.Hkv + h] = n_parts;
      if (runs.size() == 1 && runs[0].n <= chunk) {
        items.push_back({b, h, runs[0].slot, runs[0].n, -1});
        continue;
      }
      for (const Run& r : runs)
        for (int64_t s = 0; s < r.n; s += chunk) items.push_back({b, h, r.slot + s, std::min(chunk, r.n - s), n_parts++});
    }
  }
  first_part[B * c.Hkv] = n_parts;
  at::Tensor out = at::empty({B, c.Hq, d}, qc.options());
  at::Tensor part_acc = at::empty({std::max<int64_t>(n_parts, 1), g, d}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({std::max<int64_t>(n_parts, 1), 2, g}, q.options().dtype(at::kFloat));
  float* pacc = part_acc.data_ptr<float>();
  float* pml = part_ml.data_ptr<float>();
  const char* qp = static_cast<const char*>(qc.data_ptr());
  char* outp = static_cast<char*>(out.data_ptr());
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (n_items > 1)
  for (int64_t w = 0; w < n_items; ++w) {
    const Item& it = items[w];
    AttnArgs a{};
    const int64_t row0 = (it.b * c.Hq + it.h * g) * d;
    a.q = qp + row0 * c.ios;
    a.q_dtype = c.io;
    a.bf16_p = c.io != KvDtype::F32;
    const int64_t off = (it.h * c.sh + it.slot * c.st) * c.es;
    a.k = c.kp + off;
    a.v = c.vp + off;
    a.kv_stride_t = c.st;
    a.n_keys = it.n;
    a.n_queries = 1;
    a.group = static_cast<int>(g);
    a.causal_first = -1;
    a.scale = c.scale;
    if (it.part < 0) {
      a.out = outp + row0 * c.ios;
      a.out_dtype = c.io;
    } else {
      a.out = pacc + it.part * g * d;
      a.out_dtype = KvDtype::F32;
      a.m = pml + it.part * 2 * g;
      a.l = a.m + g;
    }
    c.fn(a);
  }
  const at::ScalarType out_t = out.scalar_type();
#pragma omp parallel for num_threads(nt) schedule(static) if (B * c.Hkv > 1)
  for (int64_t bh = 0; bh < B * c.Hkv; ++bh) {
    const int64_t p0 = first_part[bh], p1 = first_part[bh + 1];
    if (p0 == p1) continue;
    std::vector<float> m(g, -INFINITY), l(g, 0.0f), acc(g * d, 0.0f);
    for (int64_t p = p0; p < p1; ++p) merge_rows(m.data(), l.data(), acc.data(), pml + p * 2 * g, pml + p * 2 * g + g,
                                                 pacc + p * g * d, g, d);
    for (int64_t j = 0; j < g; ++j) {
      const float inv = 1.0f / l[j];
      for (int64_t cidx = 0; cidx < d; ++cidx) acc[j * d + cidx] *= inv;
      store_row(outp, out_t, ((bh / c.Hkv) * c.Hq + (bh % c.Hkv) * g + j) * d, acc.data() + j * d, d);
    }
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& starts,
                                   const at::Tensor& cu_seqlens, int64_t page_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && block_table.dim() == 2 && page_size > 0, "moelight: bad paged prefill arguments");
  const bool native = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  const at::Tensor qc = native ? q.contiguous() : q.to(at::kFloat).contiguous();
  const Common c = common_of(qc, k_cache, v_cache, scale);
  const int64_t d = c.d, g = c.g, Hq = c.Hq;
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor st = starts.to(at::kLong).contiguous();
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(table.size(0) == B && st.numel() == B, "moelight: block table / starts size");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(cp[0] == 0 && cp[B] == q.size(0), "moelight: cu_seqlens must span q");
  const int64_t max_pages = table.size(1), slots = k_cache.size(1);
  const int64_t qb = std::max<int64_t>(1, 64 / g);

  struct Tile { int64_t b, h, i0, nq; };
  std::vector<Tile> tiles;
  std::vector<std::vector<Run>> runs(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cp[b + 1] - cp[b];
    runs[b] = runs_of(tp + b * max_pages, max_pages, sp[b] + n, page_size, slots);
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t i0 = 0; i0 < n; i0 += qb) tiles.push_back({b, h, i0, std::min(qb, n - i0)});
  }
  at::Tensor out = at::empty_like(qc);
  const char* qp = static_cast<const char*>(qc.data_ptr());
  char* outp = static_cast<char*>(out.data_ptr());
  const at::ScalarType out_t = out.scalar_type();
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int nt = at::get_num_threads();

#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t w = 0; w < n_tiles; ++w) {
    const Tile& t = tiles[w];
    const int64_t rows = t.nq * g, q_pos0 = sp[t.b] + t.i0;  // position of the tile's first query
    std::vector<float> m(rows, -INFINITY), l(rows, 0.0f), acc(rows * d, 0.0f);
    std::vector<float> m2(rows), l2(rows), acc2(rows * d);
    for (const Run& r : runs[t.b]) {
      if (r.pos > q_pos0 + t.nq - 1) break;  // keys after the tile's last query
      // queries before the run's first key see none of it (a run may start inside the tile)
      const int64_t skip = std::max<int64_t>(0, r.pos - q_pos0), q0 = q_pos0 + skip;
      AttnArgs a{};
      a.q = qp + ((cp[t.b] + t.i0 + skip) * Hq + t.h * g) * d * c.ios;
      a.q_dtype = c.io;
      a.bf16_p = false;  // partials are merged in float32
      a.q_stride_i = Hq * d;
      const int64_t n_keys = std::min(r.n, q_pos0 + t.nq - r.pos);
      const int64_t off = (t.h * c.sh + r.slot * c.st) * c.es;
      a.k = c.kp + off;
      a.v = c.vp + off;
      a.kv_stride_t = c.st;
      a.n_keys = n_keys;
      a.n_queries = static_cast<int>(t.nq - skip);
      a.group = static_cast<int>(g);
      // query i (position q0 + i) sees this run's keys [0, q0 - r.pos + i]
      a.causal_first = r.pos + n_keys - 1 <= q0 ? -1 : q0 - r.pos;
      a.scale = c.scale;
      a.out = acc2.data();
      a.out_dtype = KvDtype::F32;
      a.out_stride_i = g * d;
      a.m = m2.data();
      a.l = l2.data();
      c.fn(a);
      const int64_t r0 = skip * g;
      merge_rows(m.data() + r0, l.data() + r0, acc.data() + r0 * d, m2.data(), l2.data(), acc2.data(), rows - r0, d);
    }
    for (int64_t r = 0; r < rows; ++r) {  // row r = (query r / g, head r % g of the group)
      const float inv = 1.0f / l[r];
      float* row = acc.data() + r * d;
      for (int64_t cidx = 0; cidx < d; ++cidx) row[cidx] *= inv;
      store_row(outp, out_t, ((cp[t.b] + t.i0 + r / g) * Hq + t.h * g + r % g) * d, row, d);
    }
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace moelight
