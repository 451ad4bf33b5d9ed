// Issue #31's staged experiment (benchmarks/results/latent_attention_staged.md): the two-pass AMX kernel
// fed from a per-thread staging buffer instead of the cache. While the tiles work on item i, the thread's
// next item's rows are COPIED (AVX-512 loads in address order, so the L2 streamer can follow them, and
// stores into an L2-resident buffer) a few lines per Next::fetch() call, instead of prefetched line by line
// into the core's fill buffers; item i + 1 then runs from that buffer (its tiles read rows already in
// L2 / L1, laid out row-major or tile-major). A fragment of latent_amx_onepass.cpp (inside its namespace,
// after latent_amx.cpp). Driver-only: the engine does not call it.
// Knobs (environment, read once): LATENT_STAGE_STREAMS=8 (copy cursors over the next item, each in
// address order), LATENT_STAGE_AHEAD=8 (lines: a T0 prefetch that far ahead of each cursor),
// LATENT_STAGE_TM=0 (1: the buffer tile-major, each block as DK / 32 contiguous 1 KiB tiles).
// LATENT_STAGE_BLOCKS=1: instead, the item's OWN rows copied one group of 3 blocks ahead of the scores
// (group 0 during the query transposes, group g + 1 during group g's scores), nothing staged across
// calls; LATENT_STAGE_PF=1 adds the next item's prefetch (NextItem) beside it.
#pragma once

#include <cstdlib>

struct StageKnobs {
  int streams = 8, ahead = 8;
  bool tile_major = false;
  bool block_ahead = false, block_ahead_pf = false;
};

inline const StageKnobs& stage_knobs() {
  static const StageKnobs k = [] {
    StageKnobs s;
    auto get = [](const char* name, int dflt) {
      const char* e = std::getenv(name);
      return e != nullptr ? std::atoi(e) : dflt;
    };
    s.streams = get("LATENT_STAGE_STREAMS", 8);
    s.streams = s.streams < 1 ? 1 : (s.streams > 16 ? 16 : s.streams);
    s.ahead = get("LATENT_STAGE_AHEAD", 8);
    s.tile_major = get("LATENT_STAGE_TM", 0) != 0;
    s.block_ahead = get("LATENT_STAGE_BLOCKS", 0) != 0;
    s.block_ahead_pf = get("LATENT_STAGE_PF", 0) != 0;
    return s;
  }();
  return k;
}

// Element offset in the staging buffer of line j (columns 32j..32j+31) of row t
template <int DK>
inline int64_t stage_offset(int64_t t, int64_t j, bool tm) {
  return tm ? (t / kBlock) * kBlock * DK + j * 512 + (t % kBlock) * 32 : t * DK + j * 32;
}

// Copies rows [0, rows) of a row-major source into a staging buffer, a few lines per fetch() call spread
// over `slots` calls in `streams` cursors, each in address order; the other spans of LatentArgs::next (the
// next item's queries) are prefetched as NextItem does.
template <int DK>
class StageCopy {
 public:
  StageCopy(const moelight::LatentArgs& a, int64_t slots, uint16_t* dst, const StageKnobs& k)
      : pf_(queries_only(a), slots), dst_(dst), tm_(k.tile_major), ahead_(k.ahead * 64) {
    if (a.n_next == 0 || slots <= 0) return;
    const moelight::LatentSpan& rows = a.next[a.n_next - 1];
    src_ = static_cast<const char*>(rows.p);
    lines_ = rows.bytes / 64;
    streams_ = k.streams;
    for (int s = 0; s < streams_; ++s) {
      pos_[s] = s * lines_ / streams_;
      end_[s] = (s + 1) * lines_ / streams_;
    }
    const int64_t per_stream = (lines_ + streams_ - 1) / streams_;
    rate_ = static_cast<uint32_t>((per_stream << 16) / slots + 1);
  }

  void fetch() {
    pf_.fetch();
    if (rate_ == 0) return;
    acc_ += rate_;
    const int64_t m = acc_ >> 16;
    acc_ &= 0xffff;
    for (int s = 0; s < streams_; ++s) copy(s, m);
  }

  // the lines the calls left (rounding), before the buffer is used
  void finish() {
    for (int s = 0; s < streams_; ++s) copy(s, end_[s] - pos_[s]);
  }

 private:
  static moelight::LatentArgs queries_only(const moelight::LatentArgs& a) {
    moelight::LatentArgs q = a;
    q.n_next = a.n_next > 0 ? a.n_next - 1 : 0;
    return q;
  }

  void copy(int s, int64_t m) {
    int64_t i = pos_[s];
    const int64_t e = i + m < end_[s] ? i + m : end_[s];
    for (; i < e; ++i) {
      const char* p = src_ + i * 64;
      if (ahead_ != 0) _mm_prefetch(p + ahead_, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(p);
      const int64_t off = tm_ ? stage_offset<DK>(i / (DK / 32), i % (DK / 32), true) : i * 32;
      _mm512_store_si512(dst_ + off, v);
    }
    pos_[s] = e;
  }

  NextItem pf_;
  uint16_t* dst_;
  bool tm_;
  int64_t ahead_;
  const char* src_ = nullptr;
  int64_t lines_ = 0;
  int streams_ = 0;
  int64_t pos_[16] = {}, end_[16] = {};
  uint32_t rate_ = 0, acc_ = 0;
};

// The item's own rows, one group of 3 blocks ahead of the scores: latent_attend_amx_blocks calls fetch()
// DK / 32 times in the query transposes (group 0 copied there), then DK / 64 times per score group of 3
// blocks (the next group copied there); all rows are copied before the softmax. Copies `rows` rows.
template <int DK>
class BlockAheadCopy {
 public:
  BlockAheadCopy(const moelight::LatentArgs& a, int64_t slots, uint16_t* dst, bool tm, bool pf)
      : pf_(a, pf ? slots : 0), src_(static_cast<const char*>(a.rows)), dst_(dst), tm_(tm),
        lines_(a.n_keys * (DK / 32)) {}

  void fetch() {
    pf_.fetch();
    ++call_;
    constexpr int64_t kQ = DK / 32, kS = DK / 64, kGroupLines = 3 * kBlock * (DK / 32);
    int64_t target;
    if (call_ <= kQ) {
      target = (call_ * min64(kGroupLines, lines_) + kQ - 1) / kQ;
    } else {
      const int64_t g = (call_ - kQ - 1) / kS, k = (call_ - kQ - 1) % kS + 1;  // group g's k-th call
      target = (g + 1) * kGroupLines + (k * kGroupLines + kS - 1) / kS;
    }
    copy_to(min64(target, lines_));
  }

  void finish() { copy_to(lines_); }

 private:
  static int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
  void copy_to(int64_t e) {
    for (; pos_ < e; ++pos_) {
      const __m512i v = _mm512_loadu_si512(src_ + pos_ * 64);
      const int64_t off = tm_ ? stage_offset<DK>(pos_ / (DK / 32), pos_ % (DK / 32), true) : pos_ * 32;
      _mm512_store_si512(dst_ + off, v);
    }
  }

  NextItem pf_;
  const char* src_;
  uint16_t* dst_;
  bool tm_;
  int64_t lines_, pos_ = 0, call_ = 0;
};

// Two buffers per thread: the current item's rows (staged during the previous call, or copied now) and
// the next item's, being copied. A buffer is used only for the (rows, n_keys) it was filled from.
template <int DK>
struct StageBuffers {
  uint16_t* buf[2] = {nullptr, nullptr};
  const void* src[2] = {nullptr, nullptr};
  int64_t n[2] = {0, 0};
  bool tm[2] = {false, false};

  StageBuffers() {
    const size_t bytes = static_cast<size_t>(moelight::kAmxMaxKeys) * DK * 2;
    for (uint16_t*& b : buf) b = static_cast<uint16_t*>(std::aligned_alloc(64, bytes));
  }
  ~StageBuffers() {
    for (uint16_t* b : buf) std::free(b);
  }
};

// zero the staged rows from key n to the end of its last block (the tiles read whole blocks)
template <int DK>
inline void zero_stage_tail(uint16_t* rows, int64_t n, int nb, bool tm) {
  for (int64_t t = n; t < static_cast<int64_t>(nb) * kBlock; ++t)
    for (int j = 0; j < DK / 32; ++j) _mm512_store_si512(rows + stage_offset<DK>(t, j, tm), _mm512_setzero_si512());
}

// the two-pass kernel over nb staged blocks, in the buffer's layout, beside `next`'s copy
template <int DK, int DV, class Next>
inline void attend_staged_blocks(const moelight::LatentArgs& a, const uint16_t* rows, int nb, bool tm, Next& next) {
  const uint16_t* blk[moelight::kAmxMaxKeys / kBlock];
  for (int i = 0; i < nb; ++i) blk[i] = rows + static_cast<int64_t>(i) * kBlock * DK;
  if (tm) {
    latent_attend_amx_blocks<DK, DV, true>(a, blk, next);
  } else {
    latent_attend_amx_blocks<DK, DV, false>(a, blk, next);
  }
}

template <int DK, int DV>
void latent_attend_amx_staged(const moelight::LatentArgs& a) {
  const StageKnobs& k = stage_knobs();
  if (a.tile_major || a.blocks != nullptr) {  // row-major contiguous rows only
    latent_attend_amx<DK, DV, false>(a);
    return;
  }
  thread_local StageBuffers<DK> sb;
  const int64_t n = a.n_keys;
  const int nb = static_cast<int>((n + kBlock - 1) / kBlock);
  if (k.block_ahead) {
    uint16_t* rows = sb.buf[0];
    sb.src[0] = sb.src[1] = nullptr;
    zero_stage_tail<DK>(rows, n, nb, k.tile_major);
    BlockAheadCopy<DK> next(a, two_pass_fetches<DK, DV>(a.heads, nb), rows, k.tile_major, k.block_ahead_pf);
    attend_staged_blocks<DK, DV>(a, rows, nb, k.tile_major, next);
    return;
  }
  int cur = 0;
  if (sb.src[1] == a.rows && sb.n[1] == n && sb.tm[1] == k.tile_major) cur = 1;
  const bool staged = sb.src[cur] == a.rows && sb.n[cur] == n && sb.tm[cur] == k.tile_major;
  uint16_t* rows = sb.buf[cur];
  const char* src = static_cast<const char*>(a.rows);
  if (!staged) {  // copy it now
    for (int64_t i = 0; i < n * DK / 32; ++i) {
      const __m512i v = _mm512_loadu_si512(src + i * 64);
      _mm512_store_si512(rows + stage_offset<DK>(i / (DK / 32), i % (DK / 32), k.tile_major), v);
    }
  }
  zero_stage_tail<DK>(rows, n, nb, k.tile_major);
  sb.src[cur] = nullptr;  // consumed: a later call re-stages
  const int other = 1 - cur;
  const bool has_rows = a.n_next > 0 && a.next[a.n_next - 1].bytes % (DK * 2) == 0;
  sb.src[other] = has_rows ? a.next[a.n_next - 1].p : nullptr;
  sb.n[other] = has_rows ? a.next[a.n_next - 1].bytes / (DK * 2) : 0;
  sb.tm[other] = k.tile_major;
  moelight::LatentArgs b = a;
  if (!has_rows) b.n_next = 0;
  StageCopy<DK> next(b, two_pass_fetches<DK, DV>(a.heads, nb), sb.buf[other], k);
  attend_staged_blocks<DK, DV>(a, rows, nb, k.tile_major, next);
  next.finish();
}
