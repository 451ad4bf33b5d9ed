// Where the AMX latent decode kernel's time goes: the kernel against its own read pattern without
// compute, and its compute with the rows hot, at the bench's shapes (16 heads, rows of 512 + 64 bf16,
// every sequence at one context, regions of context + 64 rows on huge pages), scheduled as
// latent_attention.cpp schedules it (2 OpenMP threads, items from a shared counter, the next item's
// rows prefetched). No torch: it links cpu_kernels/csrc/latent_amx.cpp alone.
//
//   g++ -O3 -fopenmp -fno-math-errno -Icpu_kernels/csrc benchmarks/latent_amx_ceiling.cpp
//       benchmarks/latent_amx_onepass.cpp -o /tmp/latent_amx_ceiling   (one line; it includes latent_amx.cpp)
//   flock /tmp/cpu.lock /tmp/latent_amx_ceiling 256 117 kernel    # or 16 2048, and the modes below
//
// Modes: kernel (as latent_attend runs it), nonext (no prefetch of the next item), hot (each thread
// repeats one item: compute with the rows in L2), hotpf (hot, and the real next item prefetched), read (each item's bytes in address order, 64-byte
// loads), tiles (each item's lines in the scores' tile order: 32-dim steps over three blocks of 16
// rows, one 8-byte load per line, no compute). Each timed call follows the read-bandwidth probe
// (stream_read's loop over 512 MiB on 2 threads), which also evicts the rows from the caches.
// Tile-major (LatentArgs::tile_major): the modes prefixed "t" (tkernel, tnonext, thot, tread, ttiles) run
// on a copy of the cache stored as tiles (each block of 16 keys as 18 contiguous [16 x 32] tiles; every
// sequence's region rounded up to whole blocks); `check` compares the two layouts' outputs bit for bit.
// One pass (latent_amx_onepass.cpp): the modes prefixed "o" (okernel, ohot, ohotpf, ...) run that kernel;
// `ocheck` compares it and the two-pass kernel with a float64 reference (queries 160x larger than the
// timed modes', so the softmax is peaked and the online rescale matters). LATENT_CHUNK=<keys> overrides
// the items' length (split-K chunks) in every mode.
// Staged (latent_amx_staged.h, in latent_amx_onepass.cpp): the modes prefixed "s" (skernel, shot, ...)
// run the two-pass kernel from a per-thread buffer the previous call copied the rows into; `scheck` as
// `ocheck` (each item with the next one's rows as LatentArgs::next, so the staged copy is what is used).
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <vector>

#include "latent_kernels.h"

using namespace moelight;

namespace moelight {
LatentFn amx_latent_onepass_fn(KvDtype dtype, int64_t dk, int64_t dv);  // latent_amx_onepass.cpp
LatentFn amx_latent_staged_fn(KvDtype dtype, int64_t dk, int64_t dv);   // latent_amx_staged.h there
}

namespace {

constexpr int kHeads = 16, kDk = 576, kDv = 512, kThreads = 2;
constexpr int64_t kRowBytes = kDk * 2;

void* huge_alloc(size_t n) {
  n = (n + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, n, MADV_HUGEPAGE);
  return p;
}

void fill_bf16(uint16_t* p, int64_t n, float amp) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = (rand() / static_cast<float>(RAND_MAX) - 0.5f) * amp;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    p[i] = static_cast<uint16_t>(u >> 16);
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Item {
  int64_t b, row, n, part;  // sequence, first cache row, keys, partial index (-1: whole sequence)
};

// the call's fixed arguments for item `c` of queries `q` over the rows at `cache` (the modes set the rest)
LatentArgs item_args(const uint16_t* q, const uint16_t* cache, const Item& c, float* scratch) {
  LatentArgs a{};
  a.q = q + c.b * kHeads * kDk;
  a.q_dtype = KvDtype::BF16;
  a.rows = cache + c.row * kDk;
  a.n_keys = c.n;
  a.heads = kHeads;
  a.scale = 0.07f;
  a.bf16_p = true;
  a.scratch = scratch;
  return a;
}

__attribute__((target("avx512f"))) uint64_t read_in_order(const char* p, int64_t bytes) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < bytes; i += 64) acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, acc);
  return lanes[0] ^ lanes[7];
}

uint64_t read_in_tile_order(const char* p, int64_t n) {
  uint64_t s = 0;
  const int nb = static_cast<int>((n + 15) / 16);
  for (int b0 = 0; b0 < nb; b0 += 3)
    for (int step = 0; step < kDk / 32; ++step)
      for (int b = b0; b < std::min(nb, b0 + 3); ++b)
        for (int r = 0; r < 16 && b * 16 + r < n; ++r)
          s += *reinterpret_cast<const volatile uint64_t*>(p + (b * 16 + r) * kRowBytes + step * 64);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s sequences context [t|o|s]kernel|[t|o|s]nonext|[t|o|s]hot|[t|o|s]hotpf|[t]read|[t]tiles|check|ocheck|scheck [reps]\n", argv[0]);
    return 2;
  }
  const int B = std::atoi(argv[1]), ctx = std::atoi(argv[2]);
  const bool tm = argv[3][0] == 't' && std::string(argv[3]) != "tiles";
  const bool op = argv[3][0] == 'o';  // the one-pass kernel (amx_latent_onepass_fn)
  const bool sp = argv[3][0] == 's';  // the staged kernel (amx_latent_staged_fn)
  const std::string mode = tm || op || sp ? std::string(argv[3] + 1) : std::string(argv[3]);
  const int reps = argc > 4 ? std::atoi(argv[4]) : 30;
  const int64_t rm_cap = ctx + 64, tm_cap = (ctx + 64 + 15) / 16 * 16;
  srand(1);
  auto* rm_cache = static_cast<uint16_t*>(huge_alloc(B * rm_cap * kRowBytes));
  fill_bf16(rm_cache, B * rm_cap * kDk, 1.0f);
  // the same rows, tile-major, in regions of whole blocks
  auto* tm_cache = static_cast<uint16_t*>(huge_alloc(B * tm_cap * kRowBytes));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < tm_cap; ++t)
      for (int64_t c = 0; c < kDk; ++c)
        tm_cache[(b * tm_cap + t / 16 * 16) * kDk + latent_tile_major_offset(t % 16, c)] =
            t < rm_cap ? rm_cache[(b * rm_cap + t) * kDk + c] : 0;
  const int64_t cap = tm ? tm_cap : rm_cap;
  uint16_t* cache = tm ? tm_cache : rm_cache;
  auto* q = static_cast<uint16_t*>(huge_alloc(B * kHeads * kDk * 2));
  fill_bf16(q, B * kHeads * kDk, 0.1f);
  auto* out = static_cast<uint16_t*>(huge_alloc(B * kHeads * kDv * 2));

  // items as latent_attend cuts them (chunk_length with AMX)
  const int64_t total = static_cast<int64_t>(B) * ctx;
  int64_t chunk = std::max<int64_t>(256, (total + 4 * kThreads - 1) / (4 * kThreads));
  chunk = std::min((chunk + 15) / 16 * 16, kAmxMaxKeys);
  if (const char* e = std::getenv("LATENT_CHUNK")) chunk = std::atoi(e);  // experiment
  std::vector<Item> items;
  int64_t n_parts = 0;
  for (int b = 0; b < B; ++b) {
    if (ctx <= chunk) {
      items.push_back({b, b * cap, ctx, -1});
      continue;
    }
    for (int64_t s = 0; s < ctx; s += chunk) items.push_back({b, b * cap + s, std::min(chunk, ctx - s), n_parts++});
  }
  auto* pacc = static_cast<float*>(huge_alloc(std::max<int64_t>(1, n_parts) * kHeads * kDv * 4));
  auto* pml = static_cast<float*>(huge_alloc(std::max<int64_t>(1, n_parts) * 2 * kHeads * 4));
  const LatentFn fn = (op ? amx_latent_onepass_fn : sp ? amx_latent_staged_fn : amx_latent_fn)(KvDtype::BF16, kDk, kDv);
  if (fn == nullptr) {
    std::fprintf(stderr, "no AMX latent kernel on this CPU\n");
    return 1;
  }
  const size_t probe_bytes = 512u << 20;
  auto* probe_buf = static_cast<char*>(huge_alloc(probe_bytes));
  std::memset(probe_buf, 1, probe_bytes);
  std::vector<std::vector<float>> scratch(kThreads, std::vector<float>(latent_amx_scratch_floats(kDk, kDv) + 16));
  const int64_t n_items = static_cast<int64_t>(items.size());
  volatile uint64_t sink = 0;

  // an item's bytes: tile-major items span whole blocks
  auto item_bytes = [&](const Item& c) { return (tm ? (c.n + 15) / 16 * 16 : c.n) * kRowBytes; };
  auto run = [&] {
    std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(kThreads)
    {
      const int tid = omp_get_thread_num();
      std::vector<LatentSpan> next_spans;
      uint64_t s = 0;
      int64_t i = counter.fetch_add(1);
      while (i < n_items) {
        const int64_t next = counter.fetch_add(1);
        const Item& c = items[i];
        const char* rows = reinterpret_cast<const char*>(cache + c.row * kDk);
        if (mode == "read") {
          s += read_in_order(rows, item_bytes(c));
        } else if (mode == "tiles") {
          s += tm ? read_in_order(rows, item_bytes(c)) : read_in_tile_order(rows, c.n);
        } else {
          const Item& src = mode == "hot" || mode == "hotpf" ? items[tid] : c;
          LatentArgs a = item_args(q, cache, src, scratch[tid].data());
          a.tile_major = tm;
          if (c.part < 0) {
            a.out = out + c.b * kHeads * kDv;
            a.out_dtype = KvDtype::BF16;
          } else {
            a.out = pacc + c.part * kHeads * kDv;
            a.out_dtype = KvDtype::F32;
            a.m = pml + c.part * 2 * kHeads;
            a.l = a.m + kHeads;
          }
          if (next < n_items && (mode == "kernel" || mode == "hotpf")) {
            const Item& n2 = items[next];
            next_spans.clear();
            if (n2.b != c.b) next_spans.push_back({q + n2.b * kHeads * kDk, kHeads * kDk * 2});
            next_spans.push_back({cache + n2.row * kDk, item_bytes(n2)});
            a.next = next_spans.data();
            a.n_next = static_cast<int>(next_spans.size());
          }
          fn(a);
        }
        i = next;
      }
      sink += s;
    }
  };
  auto probe = [&] {  // stream_read's loop
    const auto* p = reinterpret_cast<const uint64_t*>(probe_buf);
    const int64_t n = probe_bytes / 8;
    uint64_t acc = 0;
#pragma omp parallel for num_threads(kThreads) schedule(static) reduction(^ : acc)
    for (int64_t i = 0; i < n; ++i) acc ^= p[i];
    sink += acc;
  };

  if ((op || sp) && mode == "check") {  // both kernels against a float64 reference, normalised outputs
    const LatentFn fns[2] = {amx_latent_fn(KvDtype::BF16, kDk, kDv), fn};
    fill_bf16(q, B * kHeads * kDk, 16.0f);
    double err[2] = {0, 0}, big = 0;
    auto bf = [](uint16_t u) { uint32_t x = uint32_t(u) << 16; float f; std::memcpy(&f, &x, 4); return double(f); };
    std::vector<double> ref(kHeads * kDv), s(ctx);
    for (int i = 0; i < n_items; ++i) {
      const Item& c = items[i];
      for (int h = 0; h < kHeads; ++h) {
        double m = -1e300, l = 0;
        for (int64_t t = 0; t < c.n; ++t) {
          double d = 0;
          for (int k = 0; k < kDk; ++k) d += bf(q[(c.b * kHeads + h) * kDk + k]) * bf(cache[(c.row + t) * kDk + k]);
          s[t] = double(0.07f) * d;
          m = std::max(m, s[t]);
        }
        for (int k = 0; k < kDv; ++k) ref[h * kDv + k] = 0;
        for (int64_t t = 0; t < c.n; ++t) {
          const double p = std::exp(s[t] - m);
          l += p;
          for (int k = 0; k < kDv; ++k) ref[h * kDv + k] += p * bf(cache[(c.row + t) * kDk + k]);
        }
        for (int k = 0; k < kDv; ++k) {
          ref[h * kDv + k] /= l;
          big = std::max(big, std::fabs(ref[h * kDv + k]));
        }
      }
      for (int f = 0; f < 2; ++f) {
        LatentArgs a = item_args(q, cache, c, scratch[0].data());
        a.out = c.part < 0 ? static_cast<void*>(out + c.b * kHeads * kDv) : pacc + c.part * kHeads * kDv;
        a.out_dtype = c.part < 0 ? KvDtype::BF16 : KvDtype::F32;
        if (c.part >= 0) {
          a.m = pml + c.part * 2 * kHeads;
          a.l = a.m + kHeads;
        }
        LatentSpan next_rows{};  // the staged kernel copies the next item's rows during this call
        if (i + 1 < n_items) {
          next_rows = {cache + items[i + 1].row * kDk, items[i + 1].n * kRowBytes};
          a.next = &next_rows;
          a.n_next = 1;
        }
        fns[f](a);
        for (int h = 0; h < kHeads; ++h)
          for (int k = 0; k < kDv; ++k) {
            const double o = c.part < 0 ? bf(out[(c.b * kHeads + h) * kDv + k])
                                        : pacc[(c.part * kHeads + h) * kDv + k] / pml[c.part * 2 * kHeads + kHeads + h];
            err[f] = std::max(err[f], std::fabs(o - ref[h * kDv + k]));
          }
      }
    }
    const bool ok = err[1] <= 2 * err[0] + 1e-3 * big;
    std::printf("%dx%d %s: max |out - float64| kernel %.3g, %s %.3g (max |ref| %.3g): %s\n", B, ctx, argv[3], err[0],
                sp ? "staged" : "one-pass", err[1], big, ok ? "ok" : "WORSE");
    return ok ? 0 : 1;
  }
  if (mode == "check") {  // both layouts' outputs (and partials), bit for bit
    const int64_t out_n = B * kHeads * kDv, part_n = std::max<int64_t>(1, n_parts) * kHeads * kDv;
    std::vector<uint16_t> outs[2];
    std::vector<float> parts[2];
    for (int l = 0; l < 2; ++l) {
      for (int i = 0; i < n_items; ++i) {
        Item c = items[i];  // its first row at this layout's region offsets
        c.row = c.b * (l ? tm_cap : rm_cap) + (c.row - c.b * cap);
        LatentArgs a = item_args(q, l ? tm_cache : rm_cache, c, scratch[0].data());
        a.tile_major = l == 1;
        a.out = c.part < 0 ? static_cast<void*>(out + c.b * kHeads * kDv) : pacc + c.part * kHeads * kDv;
        a.out_dtype = c.part < 0 ? KvDtype::BF16 : KvDtype::F32;
        if (c.part >= 0) {
          a.m = pml + c.part * 2 * kHeads;
          a.l = a.m + kHeads;
        }
        fn(a);
      }
      outs[l].assign(out, out + out_n);
      parts[l].assign(pacc, pacc + part_n);
      std::memset(out, 0, out_n * 2);
      std::memset(pacc, 0, part_n * 4);
    }
    const bool same = outs[0] == outs[1] && std::memcmp(parts[0].data(), parts[1].data(), part_n * 4) == 0;
    std::printf("%dx%d check: tile-major output %s the row-major one\n", B, ctx, same ? "equals" : "DIFFERS from");
    return same ? 0 : 1;
  }
  run();
  std::vector<double> ratios, times;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_s();
    probe();
    const double bw = probe_bytes / (now_s() - t0);
    t0 = now_s();
    run();
    const double t = now_s() - t0;
    times.push_back(t);
    ratios.push_back(total * kRowBytes / t / bw);
  }
  std::sort(times.begin(), times.end());
  std::sort(ratios.begin(), ratios.end());
  std::printf("%dx%d %-7s median %.3f ms (min %.3f), %.1f GB/s; share of the probe's read rate: median %.2f (%.2f-%.2f)\n",
              B, ctx, argv[3], times[reps / 2] * 1e3, times[0] * 1e3, total * kRowBytes / times[reps / 2] / 1e9,
              ratios[reps / 2], ratios[0], ratios.back());
  return 0;
}
