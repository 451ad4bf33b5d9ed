"""The runtime's threads under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1, the GPU matrix's race
check), made to work with more than one thread.

The sanitizer is a dispatch mode, and dispatch modes are per thread: it checks the kernels of the
thread that enabled it alone, so each device thread joins it (`sanitize_this_thread`). Its
bookkeeping (torch.cuda._sanitizer.EventHandler: stream clocks, event states, each tensor's last
accesses) is then shared by those threads without a lock: a kernel's access takes the global
sequence number after a stack walk, by which time another thread's kernel may have advanced it, so
a correctly ordered cross-stream access (a copy, then an event the reader waited for) reads as a
race. `serialize_sanitizer` makes each of its updates atomic with one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_thread_state = threading.local()
_LOCK = threading.RLock()


def _locked(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)

    return call


def serialize_sanitizer(handler) -> None:
    """One lock around every update of a sanitizer's EventHandler: its kernel-launch check (the class's
    method, looked up at each call, so a test plugin that wraps it still runs) and every method of
    its stream/event and tensor-access records, which the CUDA trace callbacks call from any thread."""
    if getattr(handler, "_moelight_serialized", False):
        return
    handler._moelight_serialized = True
    handler._handle_kernel_launch = _locked(lambda *a, **k: type(handler)._handle_kernel_launch(handler, *a, **k))
    for part in (handler.syncs, handler.tensors_accessed):
        for name in dir(type(part)):
            if not name.startswith("__") and callable(getattr(type(part), name)):
                setattr(part, name, _locked(getattr(part, name)))


def sanitize_this_thread() -> None:
    """Under TORCH_CUDA_SANITIZER, check this thread's kernels too (once per thread), with the
    sanitizer's bookkeeping serialized across threads."""
    if getattr(_thread_state, "sanitized", False):
        return
    _thread_state.sanitized = True
    from torch.cuda import _sanitizer

    if not _sanitizer.cuda_sanitizer.enabled:
        return
    serialize_sanitizer(_sanitizer.cuda_sanitizer.dispatch.event_handler)
    if threading.current_thread() is not threading.main_thread():  # the main thread enabled it
        _sanitizer.cuda_sanitizer.dispatch.__enter__()
