"""One job per output at a time: an advisory lock beside the output (`OUTPUT.lock`), held while the job
runs. Two jobs on one output (a scheduler restarting a job that still runs, a `--resume` or `--overwrite`
beside a running one, the same file through a link) mixed, duplicated or lost results; the second is now
refused at once, before it reads or loads anything. The lock is the kernel's (flock): a job that dies
releases it, so a lock file left behind never blocks the next run.

The lock file is named from the output's real path, which a symbolic link shares and a hard link does not:
the output file itself is locked too (`hold`), when the job starts if it exists and when the job creates it
otherwise, so a second job reaching the same file under another name finds it held.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from moelight.errors import MoelightError
from workloads import OutputWriteError

try:
    import fcntl
except ImportError:  # not a POSIX host: no lock (the job runs as before)
    fcntl = None

# lock file -> the files this process holds locked for that output (the lock file first)
_held: dict[Path, list[IO]] = {}


class OutputLockedError(MoelightError):
    """Another job is writing this output."""


def lock_path(output: Path) -> Path:
    """The lock beside the output's real file (a symbolic link to it shares the lock)."""
    real = Path(os.path.realpath(Path(output).expanduser()))
    return real.with_name(real.name + ".lock")


def _refused(output: Path, holder: str, lock_name: str) -> OutputLockedError:
    return OutputLockedError(f"--output {output}: another moelight job is writing it ({holder}, {lock_name}); "
                             "wait for it to end, or name another --output")


def hold(output: Path, path: Path) -> None:
    """Lock the file at `path` (the output, or its stream) for the job holding `output`'s lock, until that
    lock is released; another job holding it (through a hard link) is refused. Nothing outside a lock."""
    files = _held.get(lock_path(output))
    if files is None or not Path(path).is_file():
        return
    identity = os.stat(path)[1:3]  # (st_ino, st_dev)
    if any(os.fstat(f.fileno())[1:3] == identity for f in files):
        return
    try:
        f = open(path, "rb")
    except OSError:  # unreadable (write-only): the lock file beside it is all there is
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise _refused(output, "the same file under another name: a hard link", Path(path).name) from None
    files.append(f)


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    path = lock_path(output)
    created = [d for d in [path.parent, *path.parent.parents] if not d.exists()]  # left as found, if empty
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise OutputWriteError(f"--output {output}: its lock file {path} could not be created ({e.strerror or e}); "
                               "make room (or fix the folder's permissions) and rerun") from None
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            raise _refused(output, f.read().strip() or "another process", path.name) from None
        # who holds it, for another job's refusal; unbuffered, so a full disk leaves close nothing to fail on
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), 0)
            os.write(f.fileno(), f"pid {os.getpid()}\n".encode())
        _held[path] = [f]
        try:
            hold(output, Path(output).expanduser())
            yield
        finally:
            for held in _held.pop(path)[1:]:
                held.close()
            with contextlib.suppress(OSError):
                path.unlink()
            for d in created:  # deepest first; a folder the job wrote into stays
                with contextlib.suppress(OSError):
                    d.rmdir()
    finally:
        f.close()  # releases the lock
