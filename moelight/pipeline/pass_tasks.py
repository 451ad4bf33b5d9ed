"""The work of each task of a pass: a schedule's task graph bound to the model, the page table,
the CPU KV cache and the copies between them.

Host data a pass needs on the device (token ids, rotary tables, indices) is prepared on the
launcher thread in pinned memory and uploaded by the compute lane without a host sync. Device
tensors shared between tasks are held until their last consumer has issued its use
(held_tensors.py); host buffers of copies come from the executor's pinned pool and go back when
the task that reads them is done. A copy destination on the device is allocated on the lane that
writes it and recorded for the lane that reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelight.devices.device_attention import (
    batched_decode_attention,
    device_prefill_attention,
    device_prefix_prefill_attention,
    prefix_table,
)
from moelight.devices.device_base import current_event
from moelight.pipeline.held_tensors import HeldTensors
from moelight.pipeline.schedule import Task, attention_on_gpu
from moelight.runtime.forward import KVPlace, attention_extras, decode_slots
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.runtime.latent_kv_cache import LatentKVCache
from moelight.runtime.paged_layout import PagedLayout, row_groups


def cached_slots(first: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Slots [first[b], first[b] + counts[b]) of every row b of a ragged cache, row after row."""
    starts = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts)
    return starts + torch.arange(int(counts.sum()), dtype=torch.int64)


def packed_gather_index(src: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The cache slot each row of a packed KV buffer copies. Row b holds its counts[b] cached positions
    (`src`, row after row) and one more slot, where the GPU writes the new token (it reads slot 0).
    One index, so a layer's gather is one row copy per head, not an element-wise indexed scatter on
    the step's critical path."""
    lengths = counts + 1
    index = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    index[cached_slots(torch.cumsum(lengths, 0) - lengths, counts)] = src
    return index


class PassTasks:
    """Shared plumbing of a prefill or decode pass."""

    def __init__(self, ex, cache: RaggedKVCache | LatentKVCache) -> None:
        self.ex, self.m, self.cache = ex, ex.model, cache
        self.dev, self.staging = ex.device, ex.staging
        self.held, self.out = HeldTensors(ex.device), {}

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """A launcher-side host tensor in pinned memory, for an upload without a sync."""
        buf = self.staging.take(t.shape, t.dtype)
        buf.copy_(t)
        self.out.setdefault("uploads", []).append(buf)
        return buf

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small launcher-side host tensor on the device, through a pinned buffer."""
        return self.dev.upload(self.pinned(t))

    def bind(self, t: Task) -> Callable[[], None]:
        w = self.ex.weight_task(t)
        if w is not None:
            return w
        op = getattr(self, "op_" + t.op, None)
        if op is None:
            raise ValueError(f"{type(self).__name__} has no op {t.op!r}")
        return op(t.layer, t.mb)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """D2H on the current (d2h) lane into a pinned buffer, which its consumer gives back."""
        host = self.staging.take(t.shape, t.dtype)
        self.dev.copy(host, t)
        return host

    def to_device(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        """H2D on the current (h2d) lane into a block of its own pool, read by the compute lane."""
        dst = self.dev.empty(host.shape, host.dtype, tag, lane="h2d")
        self.dev.copy(dst, host)
        self.dev.record_stream(dst, "gpu")
        self.staging.give(host, after=current_event())
        return dst

    def give(self, *hosts: torch.Tensor) -> None:
        for h in hosts:
            self.staging.give(h)

    def finish(self) -> None:
        """After the pass: the pinned uploads go back to the pool."""
        self.give(*self.out.pop("uploads", []))

    def logits(self, key) -> torch.Tensor:
        host = self.out.pop(key)
        result = host.clone()
        self.give(host)
        return result


class PrefillTasks(PassTasks):
    """All layers on the device for one packed chunk of prompts; each layer's K/V go to the CPU cache."""

    def __init__(self, ex, cache, tokens, seq_lens, place: KVPlace, rows=None) -> None:
        super().__init__(ex, cache)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(seq_lens, 0, out=cu[1:])
        positions = torch.arange(int(cu[-1]), dtype=torch.int64) - torch.repeat_interleave(cu[:-1], seq_lens)
        self.cu, self.prefix = cu, None
        if isinstance(place, PagedLayout):  # the tokens follow each row's cached positions (prefix sharing)
            cached = place.cached(len(seq_lens))
            positions += torch.repeat_interleave(cached, seq_lens)
            self.slots = place.slots(positions, torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens))
            if bool((cached > 0).any()):  # attention reads the prefixes from the CPU cache, uploaded per layer
                self.prefix = self._prefix_groups(place, cached, seq_lens, cu)
        else:
            self.slots = torch.repeat_interleave(place, seq_lens) + positions
        cos, sin = self.m.rotary(positions, ex.dtype)
        self.host = {"tokens": self.pinned(tokens), "cos": self.pinned(cos), "sin": self.pinned(sin),
                     "last": self.pinned(cu[1:] - 1 if rows is None else rows)}  # the rows the LM head sees

    def _prefix_groups(self, place: PagedLayout, cached: torch.Tensor, seq_lens: torch.Tensor, cu: torch.Tensor):
        """The rows in groups whose prefixes total at most the plan's prefix tokens (a chunk of few new
        tokens may sit on long prefixes): per group its rows' range of q, cached counts, prefix slots in
        the CPU cache and prefix_table."""
        groups = []
        counts = cached.tolist()
        for b0, b1 in row_groups(counts, self.ex.plan.prefix_tokens):
            groups.append({"q": (int(cu[b0]), int(cu[b1])), "cu": cu[b0:b1 + 1] - cu[b0], "cached": cached[b0:b1],
                           "slots": PagedLayout(place.tables[b0:b1], place.page_size).row_slots(counts[b0:b1]),
                           "table": self.pinned(prefix_table(counts[b0:b1], seq_lens[b0:b1].tolist()))})
        return groups

    def op_embed(self, j, i):
        def run():
            up = self.dev.upload
            self.held.put(("x", 0), 1, self.m.embed_tokens(up(self.host["tokens"])))
            self.out["rope"] = (up(self.host["cos"]), up(self.host["sin"]))
        return run

    def op_pre_attn(self, j, i):
        def run():
            q, entry = self.m.layers[j].attention_inputs(self.held.get(("x", j))[0], *self.out["rope"])
            self.held.put(("q", j), 1, q)
            self.held.put(("kv", j), 2, *entry)  # prefill attention and the copy to the CPU cache
        return run

    def op_kv_d2h(self, j, i):
        def run():
            self.out[("kvh", j)] = tuple(self.to_host(t) for t in self.held.get(("kv", j)))
            self.held.done(("kv", j))
        return run

    def op_kv_write(self, j, i):
        def run():
            hosts = self.out.pop(("kvh", j))
            self.cache.write(j, *hosts, self.slots)
            self.give(*hosts)
        return run

    def op_prefill_attn(self, j, i):
        def run():
            (q,), entry = self.held.get(("q", j)), self.held.get(("kv", j))
            k, v = self.m.layers[j].prefill_kv(*entry)  # MLA: K and V expanded from the latent
            if self.prefix is None:
                a = device_prefill_attention(q, k, v, self.cu, self.ex.scale, **attention_extras(self.m, j),
                                             upload=self.upload, budget=self.ex.score_budget)
            else:  # per group of rows, the prefixes' cache entries gathered from the CPU cache into pinned
                parts = []  # buffers, uploaded and used in this task
                for pre in self.prefix:
                    entries = (self.upload(t[:, pre["slots"]]).transpose(0, 1) for t in self.cache.layer(j))
                    kp, vp = (t.transpose(0, 1) for t in self.m.layers[j].prefill_kv(*entries))  # MLA: expanded
                    a0, a1 = pre["q"]
                    parts.append(device_prefix_prefill_attention(
                        q[a0:a1], k[a0:a1], v[a0:a1], kp, vp, self.dev.upload(pre["table"]), pre["cached"], pre["cu"],
                        self.ex.scale, **attention_extras(self.m, j), upload=self.upload,
                        budget=self.ex.score_budget))
                    del kp, vp
                a = parts[0] if len(parts) == 1 else torch.cat(parts)
            a = a.flatten(1)
            self.held.put(("attn", j), 1, a)
            self.held.done(("q", j))
            self.held.done(("kv", j))
        return run

    def op_post_attn(self, j, i):
        def run():
            x, a = self.held.get(("x", j))[0], self.held.get(("attn", j))[0]
            if j == self.ex.cfg.num_layers - 1:  # only the last token of each prompt feeds the LM head
                idx = self.dev.upload(self.host["last"])
                x, a = x.index_select(0, idx), a.index_select(0, idx)
            self.held.put(("x", j + 1), 1, self.ex.post_attention(j, x, a))
            self.held.done(("x", j))
            self.held.done(("attn", j))
        return run

    def op_lm_head(self, j, i):
        L = self.ex.cfg.num_layers

        def run():
            self.held.put(("logits",), 1, self.m.logits(self.held.get(("x", L))[0]))
            self.held.done(("x", L))
        return run

    def op_logits_d2h(self, j, i):
        def run():
            self.out["logits"] = self.to_host(self.held.get(("logits",))[0])
            self.held.done(("logits",))
        return run


class DecodeTasks(PassTasks):
    """One token for every sequence of every micro-batch, on any decode schedule."""

    def __init__(self, ex, cache, micro_batches) -> None:
        super().__init__(ex, cache)
        self.gpu_attention = attention_on_gpu(ex.schedule)
        self.mbs = []
        for tok, off, pos in micro_batches:
            lengths = pos + 1
            cos, sin = self.m.rotary(pos, ex.dtype)
            mb = {"tok": self.pinned(tok), "cos": self.pinned(cos), "sin": self.pinned(sin), "off": off, "pos": pos,
                  "slots": decode_slots(off, pos), "lengths": lengths}
            if self.gpu_attention:  # FlexGen: the micro-batch's KV gathered into one packed device buffer
                new_off = torch.cumsum(lengths, 0) - lengths
                src = off.row_slots(pos.tolist()) if isinstance(off, PagedLayout) else cached_slots(off, pos)
                mb["gather"] = packed_gather_index(src, pos)
                mb["max_len"] = int(lengths.max())
                mb["at"], mb["new_off"] = self.pinned(new_off + pos), self.pinned(new_off)
                mb["lengths_pinned"] = self.pinned(lengths)
            self.mbs.append(mb)

    def op_embed(self, j, i):
        mb = self.mbs[i]

        def run():
            up = self.dev.upload
            self.held.put(("x", 0, i), 1, self.m.embed_tokens(up(mb["tok"])))
            self.out[("rope", i)] = (up(mb["cos"]), up(mb["sin"]))
        return run

    def op_pre_attn(self, j, i):
        def run():
            q, entry = self.m.layers[j].attention_inputs(self.held.get(("x", j, i))[0], *self.out[("rope", i)],
                                                         decode=True)
            self.held.put(("q", j, i), 1, q)
            self.held.put(("kv", j, i), 2 if self.gpu_attention else 1, *entry)  # FlexGen: GPU attention + copy out
        return run

    def op_qkv_d2h(self, j, i):
        def run():
            (q,), entry = self.held.get(("q", j, i)), self.held.get(("kv", j, i))
            self.out[("qkvh", j, i)] = (self.to_host(q), tuple(self.to_host(t) for t in entry))
            self.held.done(("q", j, i))
            self.held.done(("kv", j, i))
        return run

    def op_cpu_attn(self, j, i):
        mb = self.mbs[i]

        def run():
            q, entry = self.out.pop(("qkvh", j, i))
            self.cache.write(j, *entry, mb["slots"])
            a = self.cache.attend(j, q, mb["off"], mb["lengths"], self.ex.scale, **self.ex.host_extras[j]).flatten(1)
            self.give(q, *entry)
            staged = self.staging.take(a.shape, a.dtype)  # the H2D source must be pinned
            staged.copy_(a)
            self.out[("ah", j, i)] = staged
        return run

    def op_attn_h2d(self, j, i):
        def run():
            self.held.put(("attn", j, i), 1, self.to_device(self.out.pop(("ah", j, i)), "attn"))
        return run

    def op_kv_h2d(self, j, i):
        mb = self.mbs[i]

        def run():
            bufs, index = [], mb["gather"]
            for cached in self.cache.layer(j):  # K and V, or MLA's latent rows: [heads, slots, width]
                host = self.staging.take((cached.shape[0], len(index), cached.shape[2]), cached.dtype)
                for h in range(cached.shape[0]):  # whole rows per head: torch's parallel row copy
                    torch.index_select(cached[h], 0, index, out=host[h])
                bufs.append(self.to_device(host, "kv-buffer"))
            self.out[("kvd", j, i)] = tuple(bufs)
        return run

    def op_gpu_attn(self, j, i):
        mb, up = self.mbs[i], self.dev.upload

        def run():
            bufs = self.out.pop(("kvd", j, i))
            packed = self.cache.like([bufs])
            (q,), entry = self.held.get(("q", j, i)), self.held.get(("kv", j, i))
            packed.write(0, *entry, up(mb["at"]))
            a = batched_decode_attention(q, *packed.key_value(0), up(mb["new_off"]), up(mb["lengths_pinned"]),
                                         mb["max_len"], self.ex.scale, **attention_extras(self.m, j)).flatten(1)
            for t in bufs:
                self.dev.free(t)
            self.held.put(("attn", j, i), 1, a)
            self.held.done(("q", j, i))
            self.held.done(("kv", j, i))
        return run

    def op_kv_d2h(self, j, i):
        def run():
            self.out[("newkv", j, i)] = tuple(self.to_host(t) for t in self.held.get(("kv", j, i)))
            self.held.done(("kv", j, i))
        return run

    def op_kv_write(self, j, i):
        mb = self.mbs[i]

        def run():
            hosts = self.out.pop(("newkv", j, i))
            self.cache.write(j, *hosts, mb["slots"])
            self.give(*hosts)
        return run

    def op_post_attn(self, j, i):
        def run():
            x, a = self.held.get(("x", j, i))[0], self.held.get(("attn", j, i))[0]
            self.held.put(("x", j + 1, i), 1, self.ex.post_attention(j, x, a, decode=True))
            self.held.done(("x", j, i))
            self.held.done(("attn", j, i))
        return run

    def op_lm_head(self, j, i):
        L = self.ex.cfg.num_layers

        def run():
            self.held.put(("logits", i), 1, self.m.logits(self.held.get(("x", L, i))[0]))
            self.held.done(("x", L, i))
        return run

    def op_logits_d2h(self, j, i):
        def run():
            self.out[("logits", i)] = self.to_host(self.held.get(("logits", i))[0])
            self.held.done(("logits", i))
        return run
