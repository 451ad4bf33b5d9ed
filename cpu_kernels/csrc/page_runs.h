// A sequence's keys in a paged cache as runs of consecutive slots: pages whose ids follow each other
// coalesce, so a sequence the block manager placed in order is one contiguous block, as in the ragged
// layout. Shared by the paged GQA kernels and the paged latent (MLA) decode.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moelight {

struct Run {
  int64_t pos, slot, n;  // first position, first cache slot, keys
};

// Runs of keys [0, n) of one sequence whose block-table row is `table` (max_pages ids of pages of
// `ps` slots, in a cache of `slots` slots).
inline std::vector<Run> runs_of(const int64_t* table, int64_t max_pages, int64_t n, int64_t ps, int64_t slots) {
  std::vector<Run> runs;
  for (int64_t pos = 0; pos < n; pos += ps) {
    TORCH_CHECK(pos / ps < max_pages, "moelight: block table shorter than the sequence");
    const int64_t page = table[pos / ps];
    TORCH_CHECK(page >= 0 && (page + 1) * ps <= slots, "moelight: block table out of cache");
    const int64_t take = std::min(ps, n - pos);
    if (!runs.empty() && runs.back().slot + runs.back().n == page * ps && runs.back().n % ps == 0) {
      runs.back().n += take;
    } else {
      runs.push_back({pos, page * ps, take});
    }
  }
  return runs;
}

}  // namespace moelight
