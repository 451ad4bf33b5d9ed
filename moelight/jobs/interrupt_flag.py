"""Ctrl-C as a flag the job's loop reads between batches. Ray Data's iterator can swallow a
KeyboardInterrupt raised while the driver waits inside it (and then run the job to its end), so a
Ray job takes the first SIGINT as a request to stop after the batch in hand; a second one raises
at once, as usual."""

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

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
