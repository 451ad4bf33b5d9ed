"""One job per output at a time: an advisory lock beside the output (`OUTPUT.lock`), held while the job
runs. Two jobs on one output (a scheduler restarting a job that still runs, a `--resume` or `--overwrite`
beside a running one, the same file through a link) mixed, duplicated or lost results; the second is now
refused at once, before it reads or loads anything. The lock is the kernel's (flock): a job that dies
releases it, so a lock file left behind never blocks the next run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from moelight.errors import MoelightError

try:
    import fcntl
except ImportError:  # not a POSIX host: no lock (the job runs as before)
    fcntl = None


class OutputLockedError(MoelightError):
    """Another job is writing this output."""


def lock_path(output: Path) -> Path:
    """The lock beside the output's real file (a link to it shares the lock)."""
    real = Path(os.path.realpath(Path(output).expanduser()))
    return real.with_name(real.name + ".lock")


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    path = lock_path(output)
    created = [d for d in [path.parent, *path.parent.parents] if not d.exists()]  # left as found, if empty
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise OutputLockedError(f"--output {output}: another moelight job is writing it ({holder}, "
                                    f"{path.name}); wait for it to end, or name another --output") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
            for d in created:  # deepest first; a folder the job wrote into stays
                with contextlib.suppress(OSError):
                    d.rmdir()
    finally:
        f.close()  # releases the lock
