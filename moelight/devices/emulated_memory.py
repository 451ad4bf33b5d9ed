"""The emulated device's memory: every tensor on the device counted against one capacity, and a
per-lane caching allocator as unforgiving as CUDA's.

- Blocks are storages: weights placed on the device, pool blocks from `empty`, and every tensor
  the compute lane's kernels allocate (temporaries included, registered by the counting mode),
  each counted from its allocation until its storage dies (or, for a pool block, until freed).
- `empty` takes a block from its lane's pool: a freed block of the same size is handed out at
  once and poisoned (bytes 0xff: NaN in every float type), as CUDA's allocator reuses a block on
  its stream without waiting for other streams. A block released while work recorded on another
  lane (`record_stream`) has not run stays out of the pool until it has.
- `free` of a compute tensor poisons it at once (or once its recorded uses have run): a late
  reader sees NaN, as it would read another tensor's data on a GPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelight.devices.compute_counter import uncounted
from moelight.devices.device_base import DeviceOutOfMemory

POISON = 0xFF  # every byte: a NaN in float32, bfloat16 and float16


def poison_storage(t: torch.Tensor) -> None:
    """Overwrite a tensor's whole storage with the poison pattern (a freed block)."""
    s = t.untyped_storage()
    if s.nbytes():
        with uncounted(), torch.inference_mode():
            torch.tensor([], dtype=torch.uint8).set_(s).fill_(POISON)


def poison(t: torch.Tensor) -> None:
    """Overwrite a tensor's elements (a copy's destination, perhaps a view): NaN, or -1 for integers."""
    with uncounted(), torch.inference_mode():
        t.fill_(float("nan") if t.is_floating_point() else -1)


@dataclass
class Block:
    nbytes: int
    tag: str
    lane: str  # the pool (allocation lane) of an `empty` block; "" for other device tensors
    alloc_position: int = -1  # latest launched task of `lane` when allocated (stream-order checks)
    buffer: torch.Tensor | None = None  # a pool block's own bytes (uint8), kept for reuse
    recorded: set[str] = field(default_factory=set)  # lanes that used it (record_stream)
    busy_until: dict[str, int] = field(default_factory=dict)  # lane -> its task that must run first
    live: bool = True


class DeviceMemory:
    """Capacity, use and peak of the emulated device, by storage."""

    def __init__(self, capacity: int, lane_positions: Callable[[], tuple[dict, dict]]) -> None:
        """lane_positions() -> (latest launched, latest done) task position per lane."""
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0
        self.lock = threading.RLock()
        self.blocks: dict[int, Block] = {}  # storage data_ptr -> its block
        self.pools: dict[tuple[str, int], list[Block]] = {}  # (lane, nbytes) -> free blocks, newest last
        self.waiting: list[tuple[Block, torch.Tensor | None]] = []  # released, uses on other lanes pending
        self.lane_positions = lane_positions
        self.on_new_storage: Callable[[torch.Tensor], None] | None = None  # a storage (re)allocated: the race check

    # ---- counting ----
    def _charge(self, nbytes: int, tag: str) -> None:
        if self.used + nbytes > self.capacity:
            self._drop_cached()
        if self.used + nbytes > self.capacity:
            raise DeviceOutOfMemory(
                f"device memory exceeded allocating {nbytes} B for {tag or 'a tensor'}: {self.used} B in use "
                f"of {self.capacity} B (every tensor on the device counts, kernels' temporaries included)")
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def track(self, t: torch.Tensor, tag: str) -> Block | None:
        """Count the storage of `t` from now until it dies (no-op if it is counted already)."""
        s = t.untyped_storage()
        key, n = s.data_ptr(), s.nbytes()
        with self.lock:
            if n == 0 or key in self.blocks:
                return self.blocks.get(key)
            self._charge(n, tag)
            block = self.blocks[key] = Block(n, tag, "")
        if self.on_new_storage is not None:
            self.on_new_storage(t)
        weakref.finalize(s, self._untrack, key, block)
        return block

    def _untrack(self, key: int, block: Block) -> None:
        with self.lock:
            if self.blocks.get(key) is block:
                del self.blocks[key]
            if block.live:
                block.live = False
                self.used -= block.nbytes

    def block_of(self, t: torch.Tensor) -> Block | None:
        return self.blocks.get(t.untyped_storage().data_ptr())

    # ---- the per-lane pools ----
    def empty(self, shape, dtype: torch.dtype, tag: str, lane: str) -> torch.Tensor:
        numel = int(torch.Size(shape).numel())
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self.lock:
            self._settle()
            pool = self.pools.get((lane, nbytes))
            if pool:
                block = pool.pop()
                with uncounted(), torch.inference_mode():
                    block.buffer.fill_(POISON)
            else:
                self._charge(nbytes, tag)
                block = Block(nbytes, tag, lane, buffer=torch.empty(max(nbytes, 1), dtype=torch.uint8))
                self.blocks[block.buffer.untyped_storage().data_ptr()] = block
            block.tag, block.live, block.recorded = tag, True, set()
            block.alloc_position = self.lane_positions()[0].get(lane, -1)
            if self.on_new_storage is not None:
                self.on_new_storage(block.buffer)
        return block.buffer[:nbytes].view(dtype).view(shape)

    def release(self, t: torch.Tensor) -> None:
        """The last use of `t` is issued: a pool block goes back to its pool (after its recorded uses
        on other lanes have run), any other device tensor is poisoned (then)."""
        with self.lock:
            block = self.block_of(t)
            if block is None or not block.live:
                return
            launched, _ = self.lane_positions()
            block.busy_until = {lane: launched.get(lane, -1) for lane in block.recorded if lane != block.lane}
            if block.buffer is not None:
                block.live = False
            self.waiting.append((block, None if block.buffer is not None else t))
            self._settle()

    def _settle(self) -> None:
        """Put back / poison the released blocks whose recorded uses have run."""
        _, done = self.lane_positions()
        keep = []
        for block, t in self.waiting:
            if any(done.get(lane, -1) < pos for lane, pos in block.busy_until.items()):
                keep.append((block, t))
            elif block.buffer is not None:
                self.pools.setdefault((block.lane, block.nbytes), []).append(block)
            else:
                poison_storage(t)
        self.waiting = keep

    def settle(self) -> None:
        with self.lock:
            self._settle()

    def _drop_cached(self) -> None:
        """Give the pools' free blocks back (CUDA's allocator frees its cache before failing)."""
        self._settle()
        for pool in self.pools.values():
            for block in pool:
                self.blocks.pop(block.buffer.untyped_storage().data_ptr(), None)
                self.used -= block.nbytes
        self.pools = {}

    def clear(self) -> None:
        """The device is closed: let go of every block it keeps (its pools' buffers included)."""
        with self.lock:
            self.pools, self.waiting = {}, []
            for block in self.blocks.values():
                block.buffer = None
