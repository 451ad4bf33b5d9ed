"""moelight.runtime.host_memory: huge-page-backed host tensors behave like torch.empty and free their mapping."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from moelight.models.config import ModelConfig
from moelight.runtime import host_memory
from moelight.runtime.host_memory import HUGE_PAGE, empty_huge
from moelight.runtime.kv_cache import RaggedKVCache

LINUX_THP = sys.platform.startswith("linux") and host_memory.huge_pages_available()


def _mapping_of(addr: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping that holds `addr`, or None."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                return fields
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields if inside else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_large_tensor_is_aligned_usable_and_shaped(dtype):
    shape = (3, 1000, 1000)
    t = empty_huge(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    t.fill_(2)
    assert bool((t == 2).all())
    if LINUX_THP:
        assert t.data_ptr() % HUGE_PAGE == 0


def test_small_tensor_is_plain_torch_empty():
    t = empty_huge((16, 16), torch.float32)
    assert t.shape == (16, 16) and t.untyped_storage().nbytes() == 16 * 16 * 4


def test_zero_sized_tensor():
    assert empty_huge((0, 128), torch.bfloat16).shape == (0, 128)


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux transparent huge pages")
def test_mapping_is_advised_for_huge_pages():
    t = empty_huge((4 * HUGE_PAGE // 4,), torch.float32)
    flags = _mapping_of(t.data_ptr())["VmFlags"].split()
    assert "hg" in flags  # MADV_HUGEPAGE took effect on this mapping


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux transparent huge pages")
def test_views_keep_the_mapping_and_the_last_one_frees_it():
    t = empty_huge((2, HUGE_PAGE), torch.uint8)
    addr = t.data_ptr()
    view = t[1]
    view.fill_(7)
    del t
    gc.collect()
    assert int(view.sum()) == 7 * HUGE_PAGE  # still mapped through the view
    del view
    gc.collect()
    assert _mapping_of(addr) is None  # unmapped with the last view


def test_falls_back_when_the_os_has_no_huge_pages(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_available", lambda: False)
    t = empty_huge((4, HUGE_PAGE), torch.uint8)
    assert t.shape == (4, HUGE_PAGE)
    t.fill_(1)
    assert int(t.sum()) == 4 * HUGE_PAGE


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux transparent huge pages")
def test_refused_advice_still_gives_a_working_tensor(monkeypatch):
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 4242)  # not an advice: madvise fails with EINVAL
    t = empty_huge((2, HUGE_PAGE), torch.uint8)
    t.fill_(3)
    assert int(t.sum()) == 6 * HUGE_PAGE


def test_kv_cache_lives_on_huge_page_mappings():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=2, top_k=1)
    cache = RaggedKVCache.pool(cfg, 20_000, torch.float32)  # 2 heads x 20000 x 16 x 4 B = 2.5 MiB per tensor
    for t in cache.k + cache.v:
        assert t.shape == (2, 20_000, 16)
        if LINUX_THP:
            assert t.data_ptr() % HUGE_PAGE == 0
