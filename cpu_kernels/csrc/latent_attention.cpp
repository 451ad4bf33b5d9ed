// Latent (MLA) decode attention over the latent KV cache (one absorbed query per sequence and head).
//
// Work item = (sequence, key chunk), all heads at once, so each cached row is read from DRAM once
// per step whatever the number of heads (latent_kernel.h). Long sequences are split into chunks
// (flash-decoding) so that few long sequences still spread over all threads; the partials
// (unnormalised acc, running max m, sum l per head) are merged afterwards, as decode_attention.cpp
// does. A paged cache (prefix sharing) gives each sequence as runs of consecutive pages (page_runs.h);
// a sequence of several runs is split at the runs too. Registered as torch.ops.moelight.
// latent_decode_attention and paged_latent_decode_attention (a fragment of the library that ops.cpp
// defines).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "latent_kernels.h"
#include "page_runs.h"
#include "rows_out.h"

namespace moelight {
namespace {

struct Chunk {
  int64_t b, row, n;  // sequence, first cache row, keys
  int64_t part;       // -1: the whole sequence, written normalised into the output
  int64_t gather;     // >= 0: the sequence's spans (from Work::gathered[gather]) copied together first
};

// A sequence's keys: (first cache row, keys) runs, one for a ragged cache.
using Spans = std::vector<std::pair<int64_t, int64_t>>;

KvDtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::F32;
    case at::kBFloat16: return KvDtype::BF16;
    case at::kHalf: return KvDtype::F16;
    default: TORCH_CHECK(false, "moelight: latent attention does not support dtype ", t.scalar_type());
  }
}

// The AMX kernel where it applies (a bf16 cache and bf16 queries, the AMX level active: set_isa("avx512bf16")
// runs the AVX-512 path on an AMX machine), else the active ISA's; `amx` says which.
LatentFn latent_fn(KvDtype dtype, KvDtype q_dtype, int64_t dk, int64_t dv, bool& amx) {
  const char* isa = active_isa();
  amx = false;
  if (std::strcmp(isa, "amx") == 0 && q_dtype == KvDtype::BF16) {
    if (LatentFn fn = amx_latent_fn(dtype, dk, dv)) {
      amx = true;
      return fn;
    }
  }
  if (std::strcmp(isa, "amx") == 0 || std::strcmp(isa, "avx512bf16") == 0) return avx512bf16_latent_fn(dtype, dk, dv);
  if (std::strcmp(isa, "avx512") == 0) return avx512_latent_fn(dtype, dk, dv);
  if (std::strcmp(isa, "avx2") == 0) return avx2_latent_fn(dtype, dk, dv);
  return nullptr;
}

// Every sequence's spans -> work items. A sequence of one span no longer than `chunk` is one item written
// straight to the output, and so is a short one (<= kGatherRows keys) of several spans (a paged cache):
// the kernel reads it block by block where every span but the last is whole blocks (pages of 16), else
// its rows are first copied together into the thread's scratch; either costs less than a kernel call
// and a merge per span. Others are cut into parts (at most `chunk` keys of one span each) that
// latent_attend merges.
constexpr int64_t kGatherRows = 256;

struct Work {
  std::vector<Chunk> chunks;
  std::vector<int64_t> split_first, split_seq;  // per split sequence: its first part (parts consecutive)
  std::vector<const Spans*> gathered;           // the spans of the items that gather
  int64_t n_parts = 0, gather_rows = 0;         // most rows an item gathers
};

// Every span but the last is whole blocks of the kernel: the item can be read in place (LatentArgs::blocks).
bool whole_blocks(const Spans& sp) {
  for (size_t i = 0; i + 1 < sp.size(); ++i)
    if (sp[i].second % kLatentBlockKeys != 0) return false;
  return true;
}

Work plan_chunks(const std::vector<Spans>& seqs, int64_t chunk) {
  Work w;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const Spans& sp = seqs[b];
    int64_t keys = 0;
    for (const auto& span : sp) keys += span.second;
    if (sp.size() <= 1 && keys <= chunk) {
      w.chunks.push_back({b, sp.empty() ? 0 : sp[0].first, keys, -1, -1});
      continue;
    }
    if (keys <= std::min(chunk, kGatherRows)) {
      w.chunks.push_back({b, 0, keys, -1, static_cast<int64_t>(w.gathered.size())});
      w.gathered.push_back(&sp);
      w.gather_rows = std::max(w.gather_rows, keys);
      continue;
    }
    w.split_first.push_back(w.n_parts);
    w.split_seq.push_back(b);
    for (const auto& [row, n] : sp)
      for (int64_t s = 0; s < n; s += chunk)
        w.chunks.push_back({b, row + s, std::min(chunk, n - s), w.n_parts++, -1});
  }
  w.split_first.push_back(w.n_parts);
  return w;
}

// This thread's scratch, kept between calls (a fresh vector per call and thread cost page faults and
// zeroing on every decode step)
std::vector<float>& thread_scratch(int64_t floats) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(static_cast<size_t>(floats));
  return scratch;
}

// Chunk length: long enough to stream, short enough for ~4 chunks per thread.
int64_t chunk_length(int64_t total_keys, int nt, bool amx) {
  int64_t chunk = std::max<int64_t>(256, (total_keys + 4 * nt - 1) / (4 * nt));
  chunk = (chunk + 15) / 16 * 16;
  return amx ? std::min(chunk, kAmxMaxKeys) : chunk;  // AMX's two passes over a chunk find it in L2
}

// q [B, H, W] over each sequence's spans of the cache [1, T, W] -> [B, H, latent_dim].
at::Tensor latent_attend(const at::Tensor& q, const at::Tensor& cache, const std::vector<Spans>& seqs,
                         double scale, int64_t latent_dim) {
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), dv = latent_dim;
  TORCH_CHECK(cache.size(2) == W && cache.stride(2) == 1 && cache.stride(1) == W,
              "moelight: latent cache rows must be contiguous and as wide as q");
  TORCH_CHECK(0 < dv && dv <= W && static_cast<int64_t>(seqs.size()) == B, "moelight: latent shapes");
  const bool native = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  const at::Tensor qc = native ? q.contiguous() : q.to(at::kFloat).contiguous();
  const KvDtype io = dtype_of(qc);
  bool amx = false;
  const LatentFn fn = latent_fn(dtype_of(cache), io, W, dv, amx);
  // Messages are built with std::to_string, not TORCH_CHECK's ostream: a build whose libstdc++
  // differs from torch's (Ubuntu g++ against a gcc-toolset torch) crashed formatting ints there.
  TORCH_CHECK(fn != nullptr, "moelight: no latent kernel for this CPU / row width " + std::to_string(W) +
                                 " / latent " + std::to_string(dv));
  at::Tensor out = at::empty({B, H, dv}, qc.options());
  const int nt = at::get_num_threads();
  int64_t total = 0;
  for (const Spans& sp : seqs)
    for (const auto& span : sp) total += span.second;
  const Work w = plan_chunks(seqs, chunk_length(total, nt, amx));

  at::Tensor part_acc = at::empty({w.n_parts, H, dv}, q.options().dtype(at::kFloat));
  at::Tensor part_ml = at::empty({w.n_parts, 2, H}, q.options().dtype(at::kFloat));
  float* pacc = part_acc.data_ptr<float>();
  float* pml = part_ml.data_ptr<float>();
  const int64_t scratch_len = amx ? latent_amx_scratch_floats(W, dv) : latent_scratch_floats(H, W, dv);
  const char* qp = static_cast<const char*>(qc.data_ptr());
  char* outp = static_cast<char*>(out.data_ptr());
  const char* cp = static_cast<const char*>(cache.data_ptr());
  const int64_t qes = qc.element_size(), ces = cache.element_size(), row_bytes = W * ces;
  const int64_t n_chunks = static_cast<int64_t>(w.chunks.size());
  // Every parallel region wakes the OpenMP workers: tiny calls (< 256 KiB of rows) stay on this thread.
  const bool parallel = n_chunks > 1 && total * row_bytes >= (256 << 10);

  // What item i reads, as byte spans (what the kernel prefetches while the item before it runs): its
  // rows, and its queries where the item before was another sequence's
  auto spans_of = [&](int64_t i, int64_t before, std::vector<LatentSpan>& out_spans) {
    out_spans.clear();
    const Chunk& c = w.chunks[i];
    if (w.chunks[before].b != c.b) out_spans.push_back({qp + c.b * H * W * qes, H * W * qes});
    if (c.gather < 0) {
      out_spans.push_back({cp + c.row * row_bytes, c.n * row_bytes});
    } else {
      for (const auto& [row, n] : *w.gathered[c.gather]) out_spans.push_back({cp + row * row_bytes, n * row_bytes});
    }
  };

  // Each thread takes the items in turn from a shared counter, one ahead of the one it runs: it knows
  // its next item, and the AMX kernel prefetches that item's rows while it computes this one.
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(nt) if (parallel)
  {
    std::vector<float>& scratch = thread_scratch(scratch_len);
    std::vector<char> gather_buf;
    std::vector<const void*> blocks;
    std::vector<LatentSpan> next_spans;
    int64_t i = counter.fetch_add(1);
    while (i < n_chunks) {
      const int64_t next = counter.fetch_add(1);
      const Chunk& c = w.chunks[i];
      LatentArgs a{};
      a.q = qp + c.b * H * W * qes;
      a.q_dtype = io;
      a.rows = cp + c.row * row_bytes;
      if (c.gather >= 0) {  // a short sequence in several spans: read block by block, or copied together
        const Spans& sp = *w.gathered[c.gather];
        if (whole_blocks(sp)) {
          blocks.clear();
          for (const auto& [row, n] : sp)
            for (int64_t s = 0; s < n; s += kLatentBlockKeys) blocks.push_back(cp + (row + s) * row_bytes);
          a.blocks = blocks.data();
        } else {
          gather_buf.resize(static_cast<size_t>(w.gather_rows * row_bytes));
          char* dst = gather_buf.data();
          a.rows = dst;
          for (const auto& [row, n] : sp) {
            std::memcpy(dst, cp + row * row_bytes, static_cast<size_t>(n * row_bytes));
            dst += n * row_bytes;
          }
        }
      }
      a.n_keys = c.n;
      a.heads = static_cast<int>(H);
      a.scale = static_cast<float>(scale);
      a.bf16_p = io != KvDtype::F32;
      a.scratch = scratch.data();
      if (c.part < 0) {
        a.out = outp + c.b * H * dv * qes;
        a.out_dtype = io;
      } else {
        a.out = pacc + c.part * H * dv;
        a.out_dtype = KvDtype::F32;
        a.m = pml + c.part * 2 * H;
        a.l = a.m + H;
      }
      if (next < n_chunks) {
        spans_of(next, i, next_spans);
        a.next = next_spans.data();
        a.n_next = static_cast<int>(next_spans.size());
      }
      fn(a);
      i = next;
    }
  }

  // Merge split sequences: rescale each part to the common max, then normalise.
  const int64_t n_splits = static_cast<int64_t>(w.split_seq.size());
  const at::ScalarType out_t = out.scalar_type();
#pragma omp parallel for num_threads(nt) schedule(static) if (n_splits > 1 && parallel)
  for (int64_t s = 0; s < n_splits; ++s) {
    std::vector<float> row(dv);
    for (int64_t h = 0; h < H; ++h) {
      float mx = -INFINITY;
      for (int64_t p = w.split_first[s]; p < w.split_first[s + 1]; ++p) mx = std::max(mx, pml[p * 2 * H + h]);
      std::fill(row.begin(), row.end(), 0.0f);
      float denom = 0.0f;
      for (int64_t p = w.split_first[s]; p < w.split_first[s + 1]; ++p) {
        const float wt = std::exp(pml[p * 2 * H + h] - mx);
        denom += wt * pml[p * 2 * H + H + h];
        const float* src = pacc + (p * H + h) * dv;
        for (int64_t c = 0; c < dv; ++c) row[c] += wt * src[c];
      }
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
      for (int64_t c = 0; c < dv; ++c) row[c] *= inv;
      store_row(outp, out_t, (w.split_seq[s] * H + h) * dv, row.data(), dv);
    }
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace

at::Tensor latent_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& offsets,
                                   const at::Tensor& lengths, double scale, int64_t latent_dim) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && cache.size(0) == 1, "moelight: q [B, H, W], cache [1, T, W]");
  const int64_t B = q.size(0), T = cache.size(1);
  TORCH_CHECK(offsets.numel() == B && lengths.numel() == B, "moelight: latent shapes");
  const at::Tensor offs = offsets.to(at::kLong).contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  const int64_t* op = offs.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<Spans> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && op[b] >= 0 && op[b] + lp[b] <= T, "moelight: sequence " + std::to_string(b) + " out of cache");
    if (lp[b] > 0) seqs[b].push_back({op[b], lp[b]});
  }
  return latent_attend(q, cache, seqs, scale, latent_dim);
}

at::Tensor paged_latent_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                         const at::Tensor& lengths, int64_t page_size, double scale,
                                         int64_t latent_dim) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && cache.size(0) == 1 && block_table.dim() == 2 && page_size > 0,
              "moelight: q [B, H, W], cache [1, T, W], block table [B, pages]");
  const int64_t B = q.size(0);
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(table.size(0) == B && lens.numel() == B, "moelight: block table / lengths size");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<Spans> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0, "moelight: negative length");
    for (const Run& r : runs_of(tp + b * table.size(1), table.size(1), lp[b], page_size, cache.size(1)))
      seqs[b].push_back({r.slot, r.n});
  }
  return latent_attend(q, cache, seqs, scale, latent_dim);
}

}  // namespace moelight

TORCH_LIBRARY_FRAGMENT(moelight, m) {
  m.def("latent_decode_attention(Tensor q, Tensor cache, Tensor offsets, Tensor lengths, float scale, "
        "int latent_dim) -> Tensor");
  m.def("paged_latent_decode_attention(Tensor q, Tensor cache, Tensor block_table, Tensor lengths, int page_size, "
        "float scale, int latent_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(moelight, CPU, m) {
  m.impl("latent_decode_attention", &moelight::latent_decode_attention);
  m.impl("paged_latent_decode_attention", &moelight::paged_latent_decode_attention);
}
