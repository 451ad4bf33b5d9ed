"""Large, long-lived host tensors on transparent huge pages (2 MiB) where Linux offers them.

Why: decode attention streams the whole KV cache every step. With 4 KiB pages every
4 KiB of each K/V stream costs a TLB miss and a restart of the hardware prefetcher; on
2 MiB pages the same kernel ran ~10% faster from DRAM on this project's machine when its
memory bandwidth was high, 3-5% when low, while a plain streaming read gained nothing
(BENCHMARKS.md §2). With THP in `madvise` mode (common default) memory is only promoted when
asked, so we ask: a private anonymous mapping, aligned to 2 MiB, with MADV_HUGEPAGE.
Elsewhere (no THP, not Linux, small tensors) this is plain `torch.empty`.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_pages_available() -> bool:
    """True when this OS lets a mapping ask for transparent huge pages."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype, *, min_bytes: int = HUGE_PAGE) -> torch.Tensor:
    """Uninitialised (zero-filled) CPU tensor like `torch.empty(shape, dtype=dtype)`, backed by
    a 2 MiB-aligned mapping advised for huge pages when it is at least `min_bytes` long (one under a
    huge page, with a smaller `min_bytes`, still gets a whole one).

    The tensor owns the mapping: it is unmapped when the last view of the tensor is freed.
    Pages are still populated on first touch, as with `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < max(min_bytes, 1) or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    length = max(nbytes, HUGE_PAGE) + HUGE_PAGE  # room to start on a 2 MiB boundary, and a whole page
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as any view lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, length - start)
    except OSError:  # THP disabled in this kernel: ordinary pages, still correct
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_copy(t: torch.Tensor | None, *, min_bytes: int = HUGE_PAGE) -> torch.Tensor | None:
    """A weight moved onto huge pages (`empty_huge`), for the tensors a decode step streams whole every
    step: at one row a step is bound by reading the weights, and one core of this project's AMX host read
    a 65 MB weight at ~6 GB/s from 4 KiB pages against 13 GB/s from 2 MiB pages. The tensor itself
    when it is small, not a plain contiguous CPU tensor, or huge pages are unavailable."""
    if (t is None or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous()
            or t.numel() * t.element_size() < max(min_bytes, 1) or not huge_pages_available()):
        return t
    out = empty_huge(tuple(t.shape), t.dtype, min_bytes=min_bytes)
    out.copy_(t)
    return out


def release_free_heap() -> bool:
    """Hand the pages glibc's allocator holds free back to the OS (malloc_trim(0)); False where there is no
    glibc. Why: a weight of a few to 32 MiB freed while packing (the loader's bf16 copy once packed) is a hole in
    the heap that glibc keeps resident, and packing frees one per matmul: Qwen3-30B-A3B's 48 layers left ~3.4
    GiB of them, more than the run's activations ever reuse (benchmarks/results/memory_check.md)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if not _trim:
        return False
    _trim(0)
    return True


_trim = None  # glibc's malloc_trim, looked up once (False where there is none)


PAGE = mmap.PAGESIZE


def release_pages(address: int, nbytes: int) -> bool:
    """Hand back to the OS the whole pages inside [address, address + nbytes) of memory this process owns and
    will not read again (madvise MADV_DONTNEED: they read as zeros afterwards); False where it cannot (no libc
    madvise). Why: a loaded array consumed piece by piece (runtime/expert_sources.py) stops holding memory as it
    goes, not only when the whole array is freed."""
    global _madvise
    start, stop = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if stop <= start:
        return True
    if _madvise is None:
        try:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    return _madvise(start, stop - start, mmap.MADV_DONTNEED) == 0


_madvise = None  # libc's madvise, looked up once (False where there is none)
