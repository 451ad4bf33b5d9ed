// The next work item's prefetch for the AMX latent kernel (latent_amx.cpp): why eight address-ordered
// streams spread evenly over the current item is in latent_amx.cpp's header comment. A fragment of
// latent_amx.cpp: included inside its AMX target region and anonymous namespace.
#pragma once

// The thread's next work item, prefetched a few lines per call of fetch() (`slots` calls for the item):
// kStreams cursors, each over its share of the item's bytes in address order. The rate is a 16.16 fixed-
// point count of lines per stream and call, so the prefetches spread evenly over all the item's calls
// and end with its last (whole lines per call ended at ~88% of the calls, in bursts of up to 24 lines at
// 512 keys: measured slower at 16 x 2048).
class NextItem {
 public:
  static constexpr int kStreams = 8;

  NextItem(const moelight::LatentArgs& a, int64_t slots) {
    int64_t lines = 0;
    for (int i = 0; i < a.n_next; ++i) lines += (a.next[i].bytes + 63) / 64;
    if (lines == 0 || slots <= 0) return;
    int span = 0;
    int64_t before = 0;  // lines of the spans before `span`
    for (int k = 0; k < kStreams; ++k) {  // stream k: lines [k * lines / S, (k + 1) * lines / S) end to end
      const int64_t first = k * lines / kStreams, last = (k + 1) * lines / kStreams;
      while (before + (a.next[span].bytes + 63) / 64 <= first) before += (a.next[span++].bytes + 63) / 64;
      const char* start = static_cast<const char*>(a.next[span].p);
      c_[k] = {a.next + span, start + (first - before) * 64, start + a.next[span].bytes, last - first};
    }
    const int64_t per_stream = (lines + kStreams - 1) / kStreams;
    rate_ = static_cast<uint32_t>((per_stream << 16) / slots + 1);
    live_ = true;
  }

  // inlined at every call (the kernels call it in their inner loops; GCC outlined it once the staged
  // experiment's copy also called it, and the driver's kernel lost ~4%)
  __attribute__((always_inline)) void fetch() {
    if (!live_) return;
    acc_ += rate_;
    const int64_t n = acc_ >> 16;
    acc_ &= 0xffff;
    bool any = false;
    for (Cursor& c : c_) {
      int64_t m = n < c.left ? n : c.left;
      c.left -= m;
      any |= c.left > 0;
      for (; m > 0; --m) {
        if (c.p >= c.end) {  // on into the next span
          ++c.span;
          c.p = static_cast<const char*>(c.span->p);
          c.end = c.p + c.span->bytes;
        }
        _mm_prefetch(c.p, _MM_HINT_T0);
        c.p += 64;
      }
    }
    live_ = any;
  }

 private:
  struct Cursor {
    const moelight::LatentSpan* span;
    const char* p;    // the next line to prefetch
    const char* end;  // the end of span's bytes
    int64_t left;     // lines left
  };
  Cursor c_[kStreams] = {};
  uint32_t rate_ = 0, acc_ = 0;
  bool live_ = false;
};
