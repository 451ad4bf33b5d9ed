"""Ctrl-C and SIGTERM, the ways a job is stopped. SIGTERM (`timeout`, a batch scheduler, `docker
stop`) is taken as Ctrl-C (`sigterm_as_interrupt`): the job stops the same way, its finished
results on disk and its report saved, where Python's default would end the process at once with
neither.

Ctrl-C as a flag the job's loop reads between batches: Ray Data's iterator can swallow a
KeyboardInterrupt raised while the driver waits inside it (and then run the job to its end), so a
Ray job takes the first SIGINT (or SIGTERM) as a request to stop after the batch in hand; a second
one raises at once, as usual."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
    """An Event set by the first SIGINT while the block runs (only in the main thread: elsewhere
    signals cannot be caught, and the Event stays clear)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_sigint(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {s: signal.signal(s, on_sigint) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: every handler of Ctrl-C handles it."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[dict]:
    """While the block runs (main thread only), SIGTERM and SIGHUP (the terminal closed) raise Terminated;
    the dict's "exit" is the code a command exits with: 128 + the signal, 130 for Ctrl-C."""
    seen = {"terminated": False, "exit": 130}
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def on_signal(signum, frame) -> None:
        seen.update(terminated=True, exit=128 + signum)
        raise Terminated

    stops = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {s: signal.signal(s, on_signal) for s in stops}
    try:
        yield seen
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
