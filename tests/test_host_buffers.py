"""The pinned host buffers behind every upload and download: reused by size class, and never handed
out while a copy that reads or writes them may still run."""

from __future__ import annotations

import torch

from moelight.devices.host_buffers import HostBuffers, size_class


class _Device:
    """What the pool asks of a device: page-locked memory and whether an event's work ran."""

    def __init__(self) -> None:
        self.done: set[str] = set()

    def pinned(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def is_complete(self, ev) -> bool:
        return ev is None or ev in self.done


def test_sizes_round_up_to_powers_of_two():
    assert [size_class(n) for n in (0, 1, 256, 257, 1000, 4096, 4097)] == [256, 256, 256, 512, 1024, 4096, 8192]


def test_shapes_that_change_every_step_reuse_one_buffer():
    """A block table [B, longest] grows by a column now and then: one buffer per size class serves
    every step (three here, not fifty)."""
    pool = HostBuffers(_Device())
    for longest in range(10, 60):
        t = pool.take((8, longest), torch.int64)
        assert t.shape == (8, longest) and t.dtype == torch.int64
        t.fill_(longest)
        pool.give(t)
    assert pool.allocated == len({size_class(8 * n * 8) for n in range(10, 60)}) == 3


def test_a_buffer_whose_copy_may_still_run_is_not_handed_out():
    dev = _Device()
    pool = HostBuffers(dev)
    a = pool.take((16,), torch.float32)
    pool.give(a, after="copy")
    b = pool.take((16,), torch.float32)
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    pool.give(b)
    dev.done.add("copy")
    c, d = pool.take((16,), torch.float32), pool.take((16,), torch.float32)
    assert {c.data_ptr(), d.data_ptr()} == {a.data_ptr(), b.data_ptr()} and pool.allocated == 2
