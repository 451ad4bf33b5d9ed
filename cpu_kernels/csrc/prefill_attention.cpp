// Causal attention over packed prompts (prefill), flash-style on the CPU.
//
// Work item = (sequence, KV head, block of queries). A block holds up to 64 rows
// (queries x the Hq/Hkv heads sharing the KV head), so each K/V block loaded into L1 is
// used by every row; keys past the block's last query are never visited. Items are run
// in order of decreasing work (later query blocks see more keys) under dynamic scheduling.
//
// Sliding window (GPT-OSS): query i sees keys (i - window, i]. A sequence no longer than the
// window is plain causal; a longer one runs one query per tile over exactly its window. Sinks
// (one logit per query head in every softmax's denominator): tiles write unnormalised rows with
// their max and sum, and each row is normalised with its head's sink right after its tile.
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

struct Tile {
  int64_t start, h, i0, nq;  // sequence start in the packed tensor, KV head, first query, count
  int64_t ks;                // first key (relative to the sequence): > 0 only for a windowed query
  bool windowed;             // one query over exactly its window: no causal mask
};

KvDtype prefill_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::F32;
    case at::kBFloat16: return KvDtype::BF16;
    case at::kHalf: return KvDtype::F16;
    default: TORCH_CHECK(false, "moelight: unsupported K/V dtype ", t.scalar_type());
  }
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& cu_seqlens, double scale, int64_t window,
                             const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3, "moelight: bad ranks");
  TORCH_CHECK(k_in.sizes() == v_in.sizes() && k_in.scalar_type() == v_in.scalar_type(), "moelight: K/V mismatch");
  const int64_t Tn = q.size(0), Hq = q.size(1), d = q.size(2), Hkv = k_in.size(1);
  TORCH_CHECK(k_in.size(0) == Tn && k_in.size(2) == d && Hkv > 0 && Hq % Hkv == 0, "moelight: head shapes");
  const AttnFn fn = attn_fn(prefill_dtype(k_in), d);
  TORCH_CHECK(fn != nullptr, "moelight: no kernel for this CPU / head dim ", d);

  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const bool native = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  const at::Tensor qc = native ? q.contiguous() : q.to(at::kFloat).contiguous();  // q / out in q's dtype
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* cp = cu.data_ptr<int64_t>();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(B >= 0 && cp[0] == 0 && cp[B] == Tn, "moelight: cu_seqlens must span q");
  const int64_t g = Hq / Hkv;
  const int64_t qb = std::max<int64_t>(1, 64 / g);  // queries per tile -> <= 64 rows
  at::Tensor sinks_f;
  const float* sp = sinks_f32(sinks, Hq, sinks_f);
  const bool with_sinks = sp != nullptr;

  std::vector<Tile> tiles;
  for (int64_t s = 0; s < B; ++s) {
    const int64_t n = cp[s + 1] - cp[s];
    TORCH_CHECK(n >= 0, "moelight: cu_seqlens must be non-decreasing");
    const bool windowed = window > 0 && n > window;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (windowed) {
        for (int64_t i = 0; i < n; ++i) tiles.push_back({cp[s], h, i, 1, std::max<int64_t>(0, i - window + 1), true});
      } else {
        for (int64_t i0 = 0; i0 < n; i0 += qb) tiles.push_back({cp[s], h, i0, std::min(qb, n - i0), 0, false});
      }
    }
  }
  auto work = [](const Tile& t) { return (t.i0 + t.nq - t.ks) * t.nq; };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& x, const Tile& y) { return work(x) > work(y); });

  at::Tensor out = at::empty({Tn, Hq, d}, qc.options());
  const char* qp = static_cast<const char*>(qc.data_ptr());
  char* outp = static_cast<char*>(out.data_ptr());
  const KvDtype io = prefill_dtype(qc);
  const int64_t ios = qc.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int nt = at::get_num_threads();
  // with sinks: per tile, unnormalised rows and their max / sum (at most 64 rows a tile)
  at::Tensor part = with_sinks ? at::empty({n_tiles, 64, d}, q.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor ml = with_sinks ? at::empty({n_tiles, 2, 64}, q.options().dtype(at::kFloat)) : at::Tensor();
  float* partp = with_sinks ? part.data_ptr<float>() : nullptr;
  float* mlp = with_sinks ? ml.data_ptr<float>() : nullptr;
  const at::ScalarType out_t = out.scalar_type();

#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t w = 0; w < n_tiles; ++w) {
    const Tile& t = tiles[w];
    AttnArgs a{};
    a.q = qp + ((t.start + t.i0) * Hq + t.h * g) * d * ios;
    a.q_dtype = io;
    a.bf16_p = io != KvDtype::F32;
    a.q_stride_i = Hq * d;
    const int64_t kv_off = ((t.start + t.ks) * Hkv + t.h) * d * es;
    a.k = kp + kv_off;
    a.v = vp + kv_off;
    a.kv_stride_t = Hkv * d;
    a.n_keys = t.i0 + t.nq - t.ks;
    a.n_queries = static_cast<int>(t.nq);
    a.group = static_cast<int>(g);
    a.causal_first = t.windowed ? -1 : t.i0;
    a.scale = static_cast<float>(scale);
    const int64_t out_row0 = ((t.start + t.i0) * Hq + t.h * g) * d;
    if (!with_sinks) {
      a.out = outp + out_row0 * ios;
      a.out_dtype = io;
      a.out_stride_i = Hq * d;
      fn(a);
      continue;
    }
    float* rows = partp + w * 64 * d;
    float* m = mlp + w * 2 * 64;
    a.out = rows;
    a.out_dtype = KvDtype::F32;
    a.out_stride_i = g * d;
    a.m = m;
    a.l = m + 64;
    fn(a);
    for (int64_t r = 0; r < t.nq * g; ++r) {  // row r = (query r / g, head r % g of the group)
      const float sink = sp[t.h * g + r % g];
      const float mx = std::max(m[r], sink);
      const float e = std::exp(m[r] - mx);
      const float inv = e / (a.l[r] * e + std::exp(sink - mx));
      float* row = rows + r * d;
      for (int64_t c = 0; c < d; ++c) row[c] *= inv;
      store_row(outp, out_t, out_row0 + (r / g) * Hq * d + (r % g) * d, row, d);
    }
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace moelight
