// Helpers shared by the torch-free expert drivers (expert_vnni_stream_ceiling.cpp, expert_vnni_variants.cpp):
// a buffer on 2 MiB pages, touched once so its first timed read pays no page faults (as the engine's packed
// experts, fused_experts.on_huge_pages), and a wall clock in seconds.
#pragma once
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>

static void* huge(size_t n) {
  void* p = mmap(nullptr, n + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  p = (void*)(((uintptr_t)p + (2 << 20) - 1) & ~((uintptr_t)(2 << 20) - 1));
  madvise(p, n, MADV_HUGEPAGE);
  memset(p, 1, n);
  return p;
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
