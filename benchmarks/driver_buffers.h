// Helpers shared by the torch-free expert drivers (expert_vnni_stream_ceiling.cpp, expert_vnni_variants.cpp):
// a buffer on 2 MiB pages, touched once so its first timed read pays no page faults (as the engine's packed
// experts, fused_experts.on_huge_pages), a wall clock in seconds, and the timed read of a large buffer that
// evicts the caches before a pass (its time is the same run's read bandwidth).
#pragma once
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>

#include <omp.h>

static void* huge(size_t n) {
  void* p = mmap(nullptr, n + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  p = (void*)(((uintptr_t)p + (2 << 20) - 1) & ~((uintptr_t)(2 << 20) - 1));
  madvise(p, n, MADV_HUGEPAGE);
  memset(p, 1, n);
  return p;
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
// Reads `bytes` of `buf` on two threads (evicting the caches) and returns the seconds it took.
static double flush_read(const uint64_t* buf, size_t bytes) {
  uint64_t acc = 0;
  const double t0 = now();
#pragma omp parallel for num_threads(2) reduction(^ : acc)
  for (size_t i = 0; i < bytes / 8; ++i) acc ^= buf[i];
  const double t1 = now();
  if (acc == 42) printf("x");  // keeps the read
  return t1 - t0;
}
