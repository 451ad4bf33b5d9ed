"""What first touches of fresh anonymous memory cost on this host, on 4 KiB pages and on 2 MiB THP.

Why: since the weights the decode step streams are copied onto THP-advised mappings
(moelight/runtime/host_memory.py), loading the README job took ~2.4 s longer, ~0.2 GB/s for the copy.
This separates that into its parts. Each case maps N MiB (2 MiB-aligned), times the named step with
torch ops (the engine's own fill / copy, on all its threads), reads the mapping's AnonHugePages from
/proc/self/smaps, and unmaps. Cases run in the order listed, so "again" cases reuse memory the
previous case just freed.

    python benchmarks/probe_page_faults.py --mib 512 --rounds 2
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time

import torch

HUGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the VMA holding `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return -1


class Mapping:
    """An anonymous private mapping of `nbytes`, its tensor view starting on a 2 MiB boundary."""

    def __init__(self, nbytes: int, *, populate: bool = False) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
        t0 = time.perf_counter()
        self.mm = mmap.mmap(-1, nbytes + HUGE, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.map_s = time.perf_counter() - t0
        raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.start = -raw.data_ptr() % HUGE
        self.t = raw[self.start:self.start + nbytes]
        self.addr = self.t.data_ptr()
        self.nbytes = nbytes

    def madvise(self, advice: int) -> float:
        t0 = time.perf_counter()
        if libc.madvise(self.addr, self.nbytes, advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice})")
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.t
        self.mm.close()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def populate_threads(m: Mapping, threads: int) -> None:
    """MADV_POPULATE_WRITE over `threads` slices of the mapping at once (ctypes drops the GIL)."""
    step = -(-m.nbytes // threads // HUGE) * HUGE
    parts = [(m.addr + o, min(step, m.nbytes - o)) for o in range(0, m.nbytes, step)]
    workers = [threading.Thread(target=libc.madvise, args=(a, n, MADV_POPULATE_WRITE)) for a, n in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def case(name: str, nbytes: int, src: torch.Tensor, *, huge: bool, step: str, populate: bool = False,
         advise_after_touch: bool = False, populate_write: int = 0, settle: float = 0.0) -> dict:
    time.sleep(settle)  # memory freed as large blocks is reported to the host after ~2 s
    m = Mapping(nbytes, populate=populate)
    prep = m.map_s
    if huge and not advise_after_touch:
        prep += m.madvise(mmap.MADV_HUGEPAGE)
    if populate_write:
        prep += timed(lambda: populate_threads(m, populate_write))
    if advise_after_touch:
        m.t.fill_(1)
        prep += m.madvise(mmap.MADV_HUGEPAGE)
    first = timed(lambda: m.t.copy_(src) if step == "copy" else m.t.fill_(1))
    second = timed(lambda: m.t.copy_(src))
    huge_kb = anon_huge_kb(m.addr)
    m.close()
    return {"case": name, "prep_s": prep, "first_s": first, "second_s": second, "huge_mib": huge_kb / 1024}


CASES = [
    ("4k fill", dict(huge=False, step="fill")),
    ("4k fill again", dict(huge=False, step="fill")),
    ("4k copy", dict(huge=False, step="copy")),
    ("2M fill", dict(huge=True, step="fill")),
    ("2M fill again", dict(huge=True, step="fill")),
    ("2M copy", dict(huge=True, step="copy")),
    ("2M copy again", dict(huge=True, step="copy")),
    ("4k MAP_POPULATE, copy", dict(huge=False, step="copy", populate=True)),
    ("2M POPULATE_WRITE, copy", dict(huge=True, step="copy", populate_write=1)),
    ("2M POPULATE_WRITE, copy again", dict(huge=True, step="copy", populate_write=1)),
    ("4k touched, then MADV_HUGEPAGE, copy", dict(huge=True, step="copy", advise_after_touch=True)),
]

FRESH = 4.0  # seconds of settle: the previous case's freed blocks have gone back to the host
FRESH_CASES = [
    ("fresh 4k copy", dict(huge=False, step="copy", settle=FRESH)),
    ("fresh 2M copy", dict(huge=True, step="copy", settle=FRESH)),
    ("fresh 2M POPULATE_WRITE x1, copy", dict(huge=True, step="copy", populate_write=1, settle=FRESH)),
    ("fresh 2M POPULATE_WRITE x2, copy", dict(huge=True, step="copy", populate_write=2, settle=FRESH)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="only the cases after a settle (memory the host took back)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nbytes = args.mib << 20
    src = torch.ones(nbytes, dtype=torch.uint8)  # touched once: the copies' source is resident
    gb = nbytes / 1e9
    print(f"{args.mib} MiB, {torch.get_num_threads()} threads; GB/s of the timed step (prep: mmap + madvise)")
    print("| round | case | prep s | first touch s | first GB/s | second (copy) GB/s | AnonHugePages MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for name, kw in FRESH_CASES if args.fresh else CASES:
            row = case(name, nbytes, src, **kw)
            print(f"| {r} | {name} | {row['prep_s']:.3f} | {row['first_s']:.3f} | {gb / row['first_s']:.2f} | "
                  f"{gb / row['second_s']:.2f} | {row['huge_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
