"""Rank 0's watch over the followers it spawned: a follower that exits with an error makes rank 0
abort the layers' communicator, so a collective waiting for the dead rank ends at once.

Why: NCCL does not notice a dead peer. Rank 0 would wait in its next all-reduce (or in
`torch.cuda.synchronize` behind it) until NCCL's watchdog ends the process after the group's
timeout, with no error naming the rank. gloo's sockets close when a peer dies, but the control
messages and the abort keep both backends on one path. Under torchrun the ranks are torchrun's
children, not ours: its agent ends the job when one of them fails.
"""

from __future__ import annotations

import threading


class RankMonitor:
    def __init__(self, processes: list, on_failure, poll_s: float = 0.2) -> None:
        """on_failure(rank) is called once, from the monitor's thread, when a follower dies."""
        self.processes, self.on_failure, self.poll_s = processes, on_failure, poll_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="moelight-rank-monitor", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.wait(self.poll_s):
            for rank, p in enumerate(self.processes, start=1):
                if p.exitcode not in (None, 0):
                    self.on_failure(rank)
                    return

    def stop(self) -> None:
        """Stop watching (before rank 0 ends the followers itself)."""
        self.stopping.set()
        self.thread.join(timeout=5)
