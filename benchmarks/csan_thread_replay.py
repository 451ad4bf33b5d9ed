"""Replay, on the CPU, how torch's CUDA sanitizer keeps its records when several threads launch
kernels (as the runtime's lane threads do under TORCH_CUDA_SANITIZER=1): every read below is ordered
after its write (the reader's stream waits for an event recorded after the copy), so every report
is false. Without a lock some are reported; with moelight's (devices/cuda_sanitizer.py), none.

    python benchmarks/csan_thread_replay.py [--reads 3000]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.cuda._sanitizer import EventHandler  # noqa: E402

from moelight.devices.cuda_sanitizer import serialize_sanitizer  # noqa: E402

COPY, COMPUTE, OTHER = 11, 22, 33  # stream ids: the copy lane's, the compute lane's, a third lane's


def replay(reads: int, serialized: bool) -> int:
    h = EventHandler()
    if serialized:
        serialize_sanitizer(h)
    for s in (COPY, COMPUTE, OTHER):
        h._handle_stream_creation(s)
    issued = [threading.Event() for _ in range(reads)]
    false = []

    def copier() -> None:
        for i in range(reads):
            h._handle_kernel_launch(COPY, set(), {10**6 + i}, set(), "aten::copy_", {10**6 + i: []})
            h.syncs.create_event(5 * 10**6 + i)
            h.syncs.record_state(5 * 10**6 + i, COPY)
            issued[i].set()

    def compute() -> None:
        for i in range(reads):
            h._handle_kernel_launch(COMPUTE, {1}, set(), set(), "aten::add", {1: []})
            issued[i].wait()
            h.syncs.stream_wait_for_event(COMPUTE, 5 * 10**6 + i)
            if h._handle_kernel_launch(COMPUTE, {10**6 + i}, set(), set(), "aten::mm", {10**6 + i: []}):
                false.append(i)

    def other_lane() -> None:
        for _ in range(2 * reads):
            h._handle_kernel_launch(OTHER, {2}, set(), set(), "aten::copy_", {2: []})

    threads = [threading.Thread(target=f) for f in (copier, compute, other_lane)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(false)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=3000)
    args = ap.parse_args()
    sys.setswitchinterval(1e-6)  # switch threads often, as busy lane threads do
    for serialized in (False, True):
        n = replay(args.reads, serialized)
        print(f"{'serialized' if serialized else 'unlocked  '}: {n} false race reports of {args.reads} ordered reads")


if __name__ == "__main__":
    main()
