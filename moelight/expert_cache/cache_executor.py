"""Latency mode's executor: the model on the device except its routed experts, which are served
from a fixed number of device expert slots (a cache fed by demand fetches and a policy's
prefetches), for small batches where each layer uses only a few experts.

Non-expert weights, the KV cache and the activations live on the device (the emulated one, or
CUDA). At each MoE layer the router runs first; the cache state (`cache_state.ExpertCache`)
turns its choices into hits and demand fetches, then plans prefetches; the copy thread
(`copy_worker.CopyWorker`) moves experts host -> slot, demands first; the layer's experts run from
the slots (in ascending order, as the plain engine sums them) once all of them have arrived.
Sequences are known by their KV-cache offset, which the engine keeps for a sequence's life.

The routing comes to the host once per MoE layer pass (the cache decides from it: the one host
sync of a layer pass, inherent to a demand-fed cache); the expert kernels take their counts from
that host copy rather than reading the device's again. Compute waits for an expert's copy on the
device (`wait_event`), not on the host. Host copies of the experts are pinned once at load
(`pin_experts`, where host memory allows), so copies need no staging.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

from cpu_kernels.varlen_attention import varlen_attention
from moelight.devices.compute_counter import DecodeCounts
from moelight.devices.device_attention import batched_decode_attention, device_prefill_attention, score_budget
from moelight.devices.device_base import Device, nbytes_of
from moelight.devices.host_buffers import HostBuffers
from moelight.devices.registry import create_device
from moelight.expert_cache.cache_policy import UNBOUNDED, CachePolicy
from moelight.expert_cache.cache_state import CacheStats, ExpertCache, Fetch
from moelight.expert_cache.copy_worker import CopyWorker
from moelight.expert_cache.expert_slots import expert_slots, slot_bytes
from moelight.expert_cache.slot_tables import SlotTable, StreamTable
from moelight.models.causal_lm import MoECausalLM
from moelight.models.moe import expert_output
from moelight.models.quantized_experts import QuantizedExperts, routed_expert_param
from moelight.runtime.executor import Executor, MicroBatch
from moelight.runtime.forward import attention_extras, decode_slots
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.runtime.latent_kv_cache import LatentKVCache
from moelight.runtime.paged_layout import PagedLayout


def kv_bytes(model: MoECausalLM, tokens: int) -> int:
    """The KV cache of `tokens` slots on the device."""
    c = model.config
    return c.num_layers * c.kv_elements_per_token * tokens * model.embed_tokens.weight.element_size()


def _total(counts: dict, experts: int) -> list[int]:
    """Tokens per expert over the sequences of a layer pass (host data)."""
    return [int(n) for n in sum(counts.values(), np.zeros(experts, dtype=np.int64))]


def non_expert_bytes(model: MoECausalLM) -> int:
    return sum(nbytes_of(p) for n, p in model.named_parameters()
               if not routed_expert_param(n))


class ExpertCacheExecutor(Executor):
    """Latency mode's runtime: the KV cache and a cache of experts on the device. Reads block tables
    (prefix sharing) through its own copy of the engine's KV pages."""

    supports_paged = True

    def __init__(self, model: MoECausalLM, slots: int, policy: CachePolicy, device: str | Device = "emulated",
                 prefetch_per_layer: int = 0, prefetch_given: bool = False, device_memory: int | None = None,
                 cpu_max_tokens: int = 0,
                 max_tokens: int = 4096, pin_experts: bool = True, **device_kwargs) -> None:
        """cpu_max_tokens: with a policy that offloads, a missed expert with at most this many tokens
        runs on the CPU next to its host copy (CoServe's K*n + B placement, from the HRM).
        max_tokens: the KV-cache slots the engine's cache may hold (an emulated device's default
        capacity holds them; a CUDA device's is the GPU's free memory). pin_experts: page-lock the
        host copies of the experts (the caller knows whether host memory allows it)."""
        cfg = self.cfg = model.config
        self.model = model
        self.moe_layers = [j for j in range(cfg.num_layers) if cfg.is_sparse(j)]
        self.moe_index = {j: i for i, j in enumerate(self.moe_layers)}
        self.E = cfg.num_experts
        self.cache = ExpertCache(len(self.moe_layers), self.E, slots, policy,
                                 prefetch_per_layer if policy.predicts else 0,
                                 cpu_max_tokens=cpu_max_tokens if policy.cpu_offload else 0,
                                 prefetch_given=prefetch_given)
        self.stream_slots = [slots, slots + 1] if policy.stream_prefill else []  # DuoServe's prefill buffers
        slots += len(self.stream_slots)
        if isinstance(device, str):
            per_slot, once = slot_bytes(model, device)
            need = non_expert_bytes(model) + slots * per_slot + once + kv_bytes(model, max_tokens)
            capacity = device_memory or (2 * need if device == "emulated" else None)  # activations: < need
            device = create_device(device, capacity_bytes=capacity, **device_kwargs)
        self.device = device
        self.score_budget = score_budget(device)  # prefill attention's share
        # what an expert run on the CPU needs besides its weights (GPT-OSS's biases), kept on the host
        self._host_terms = {j: _host_terms(model.layers[j].mlp) for j in self.moe_layers}
        for mod in (model.embed_tokens, model.norm, model.lm_head):
            device.to_device_module(mod, "non-expert")
        for layer in model.layers:  # all but the routed experts, as the CGOPipe pager places them
            for name, mod in layer.named_children():
                for sub in (mod.children() if name == "mlp" else (mod,)):
                    if not isinstance(sub, QuantizedExperts):
                        device.to_device_module(sub, "non-expert")
        self.slots = expert_slots(model, self.moe_layers, slots, device, pin_experts)  # 16-bit or quantized
        self.worker = CopyWorker(device, self._chunks)
        self.scale = cfg.attention_scale
        self._kv_src: RaggedKVCache | LatentKVCache | None = None
        self._kv: RaggedKVCache | LatentKVCache | None = None
        self._prefill = False
        self.stream_count = itertools.count()  # StreamTable's copies, in issue order
        self.counts = DecodeCounts(device)
        self.host = HostBuffers(device)  # the pinned sources of every upload, reused from pass to pass
        self._lent: list[torch.Tensor] = []  # handed out in the pass under way

    @property
    def cache_stats(self) -> CacheStats:
        self.cache.stats.fetched_bytes = float(self.worker.copied_bytes)
        return self.cache.stats

    def stats(self) -> dict:
        """The cache's figures for the job's report (hits, prefetches, bytes moved, its size and policy)
        and the runtime's (host syncs per decode step, kernel launches per layer pass, as measured)."""
        return self.cache_stats.to_dict() | {"slots": self.cache.slots, "policy": self.cache.policy.name,
                                             "prefetch_per_layer": self.cache.budget if self.cache.budget < UNBOUNDED
                                             else None} | self.counts.stats()

    # ---- the cache ----
    def _chunks(self, f: Fetch) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """A fetch's copies: one chunk, or ProMoE's three (gate, up, down), each a list of pairs."""
        layer, e = divmod(f.source if f.source >= 0 else f.key, self.E)
        return self.slots.chunks(self.moe_layers[layer], e, f.slot, self.cache.policy.copy_chunks)

    def _issue(self, fetches: list[Fetch]) -> None:
        for key in self.cache.evicted_now:
            if self.worker.cancel(key):
                self.cache.stats.cancelled += 1
        self.worker.submit(fetches)

    def _moe(self, j: int, seq_rows: list[tuple[int, slice]]):
        """Layer j's FFN over the cache (None for a dense layer, whose MLP is resident)."""
        if not self.cfg.is_sparse(j):
            return None
        mlp, i, E = self.model.layers[j].mlp, self.moe_index[j], self.E
        policy = self.cache.policy

        def run(h: torch.Tensor) -> torch.Tensor:
            weights, experts = mlp.route(h)
            ex = self.device.to_host(experts).numpy()  # the layer's one host sync: the cache decides from it
            counts = {s: np.bincount(ex[rows].reshape(-1), minlength=E) for s, rows in seq_rows}
            if policy.wants_hidden:
                policy.observe_hidden(i, self.device.to_host(h.float()).numpy())
            if self._prefill and policy.stream_prefill:
                return self._streamed(mlp, i, h, weights, experts, counts)
            for e in np.flatnonzero(sum(counts.values())):  # prefetched, still on its way: late
                key = i * E + int(e)
                if self.cache.cached(key) and self.cache.unused_prefetch[key] and self.worker.pending(key):
                    self.cache.stats.prefetch_late += 1
            needed, demand = self.cache.access(i, counts)
            self._issue(demand)
            for e in needed:
                self.worker.promote(i * E + e)
            on_cpu = list(self.cache.cpu_now)
            self._issue(self.cache.plan_prefetch(i))
            on_device = [e for e in needed if e not in on_cpu]
            if policy.reorder:  # ProMoE: what has arrived first, what is still coming last
                on_device.sort(key=lambda e: (self.worker.pending(i * E + e), e))
            ready = self._on_cpu(j, h, weights, ex, on_cpu) if on_cpu else None
            table = SlotTable(self, i, on_device)
            out = mlp.forward_with(h, table.gate_up, table.down, F.linear, routing=(weights, experts),
                                   compute_order=on_cpu + on_device, counts=_total(counts, E), ready=ready)
            self.worker.used(table.slots)
            return out

        return run

    def _on_cpu(self, j: int, h: torch.Tensor, weights: torch.Tensor, ex: np.ndarray, on_cpu: list[int]) -> dict:
        """The experts that run next to their host copies (CoServe): the layer's input and routing
        weights come back in one read (the layer's second and last sync), each expert's weighted rows
        go up from page-locked memory as `expert_mix`'s ready pieces."""
        back = self.device.to_host(torch.cat([h.double(), weights.double()], 1))  # exact for both dtypes
        x, w = back[:, : h.shape[1]].to(h.dtype), back[:, h.shape[1] :].to(weights.dtype).reshape(-1, 1)
        activation, gate_up_bias, down_bias = self._host_terms[j]
        flat, k, ready = ex.reshape(-1), ex.shape[1], {}
        for e in on_cpu:
            pairs = torch.from_numpy(np.flatnonzero(flat == e))  # in token order, as expert_mix sorts them
            if len(pairs) == 0:
                continue
            rows = pairs // k
            y = expert_output(x.index_select(0, rows), w.index_select(0, pairs), self.slots.on_host(j, e, True),
                              self.slots.on_host(j, e, False), F.linear, activation,
                              None if gate_up_bias is None else gate_up_bias[e],
                              None if down_bias is None else down_bias[e])
            ready[e] = (self._upload(rows), self._upload(y))
        return ready

    def _streamed(self, mlp, i: int, h, weights, experts, counts) -> torch.Tensor:
        """DuoServe's prefill: the layer's experts stream through two slots of their own, in
        order, outside the cache (which the prefill neither reads nor disturbs)."""
        self.cache.policy.observe(i, counts)
        needed = [int(e) for e in np.flatnonzero(sum(counts.values()))]
        self.cache.stats.streamed += len(needed)
        table = StreamTable(self, i, needed)
        out = mlp.forward_with(h, table.gate_up, table.down, F.linear, routing=(weights, experts),
                               counts=_total(counts, self.E))
        self.worker.used(self.stream_slots)
        return out

    def release_sequence(self, seq: int) -> None:
        """The engine finished the sequence it knows by `seq` (its KV offset, or its key when paged): its
        activation record goes."""
        self.cache.release(seq)

    @torch.inference_mode()  # the device's copy was made inside a pass: an inference tensor
    def copy_pages(self, cache, copies: list[tuple[int, int]], page_size: int) -> None:
        """Copy-on-write in the engine's cache and in the device's copy of it (the one attention reads)."""
        cache.copy_pages(copies, page_size)
        kv = self._kv_of(cache)
        if kv.layer(0)[0].data_ptr() != cache.layer(0)[0].data_ptr():  # CUDA: a copy of its own (emulated: the same)
            with self.device.compute():
                kv.copy_pages(copies, page_size)

    # ---- KV cache on the device ----
    def _kv_of(self, cache: RaggedKVCache | LatentKVCache) -> RaggedKVCache | LatentKVCache:
        """The engine's cache, on the device: counted where the device is emulated (the engine's
        tensors are already in this memory), a device copy of its layout on CUDA."""
        if cache is not self._kv_src:
            if self._kv is not None:
                for j in range(self.cfg.num_layers):
                    for t in self._kv.layer(j):
                        self.device.free(t)
            if self.device.kind == "emulated":
                place = lambda t: self.device.adopt(t, "kv")  # noqa: E731
            else:
                place = lambda t: self.device.empty(t.shape, t.dtype, "kv")  # noqa: E731
            self._kv = cache.like([tuple(place(t) for t in cache.layer(j)) for j in range(self.cfg.num_layers)])
            self._kv_src = cache
        return self._kv

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device through a pooled pinned buffer: page-locking memory for each
        copy (cudaHostAlloc) costs more than the copy of these small tensors."""
        buf = self.host.take(t.shape, t.dtype)
        buf.copy_(t)
        self._lent.append(buf)
        return self.device.upload(buf)

    def _new_pass(self) -> None:
        """The previous pass's pinned sources go back to the pool: its results were read back on the
        host, so every copy it queued has run."""
        for buf in self._lent:
            self.host.give(buf)
        self._lent.clear()

    # ---- passes ----
    @torch.inference_mode()
    def prefill(self, cache: RaggedKVCache | LatentKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
                offsets: torch.Tensor | PagedLayout, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each prompt's last token, or of the packed positions `rows` (prompt logprobs). Paged
        (prefix sharing): the tokens follow each row's cached positions, and attention reads the
        device's cache through the block tables."""
        m, L = self.model, self.cfg.num_layers
        self._prefill = True
        self._new_pass()
        kv = self._kv_of(cache)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(seq_lens, 0, out=cu[1:])
        positions = torch.arange(int(cu[-1]), dtype=torch.int64) - torch.repeat_interleave(cu[:-1], seq_lens)
        paged = isinstance(offsets, PagedLayout)
        if paged:
            cached = offsets.cached(len(seq_lens))
            positions += torch.repeat_interleave(cached, seq_lens)
            slots = offsets.slots(positions, torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens))
            seqs = offsets.keys.tolist()
            paged = bool((cached > 0).any())  # attention reads the cache only where a prefix is there
        else:
            slots = torch.repeat_interleave(offsets, seq_lens) + positions
            seqs = [int(o) for o in offsets]
        for s in seqs:
            self.cache.policy.begin(s)
        every = [(s, slice(int(a), int(b))) for s, a, b in zip(seqs, cu[:-1], cu[1:], strict=True)]
        last = cu[1:] - 1 if rows is None else rows
        picked = torch.bincount(torch.bucketize(last, cu[1:], right=True), minlength=len(seqs))  # rows per prompt
        only_last = [(s, slice(a, a + n)) for s, a, n in zip(seqs, (torch.cumsum(picked, 0) - picked).tolist(),
                                                             picked.tolist(), strict=True)]
        cos, sin = m.rotary(positions, m.embed_tokens.weight.dtype)
        with self.device.compute():
            slots, last = self._upload(slots), self._upload(last)
            table = self._upload(offsets.tables) if paged else None
            x = m.embed_tokens(self._upload(tokens))
            cos, sin = self._upload(cos), self._upload(sin)
            for j, layer in enumerate(m.layers):
                q, entry = layer.attention_inputs(x, cos, sin)
                kv.write(j, *entry, slots)
                if paged and isinstance(kv, LatentKVCache):  # the prefixes' rows expanded beside the new ones
                    a = kv.prefix_attend(j, q, layer.prefill_kv, offsets, seq_lens, cu, self.scale, upload=self._upload)
                elif paged:  # K and V through the block tables
                    a = varlen_attention(q, *kv.key_value(j), cached, cu, self.scale, block_table=table,
                                         page_size=offsets.page_size, upload=self._upload, budget=self.score_budget,
                                         **attention_extras(m, j))
                else:
                    a = device_prefill_attention(q, *layer.prefill_kv(*entry), cu, self.scale, **attention_extras(m, j),
                                                 upload=self._upload, budget=self.score_budget)
                a = a.flatten(1)
                routed = every
                if j == L - 1:  # only the last token of each prompt (or the asked rows) feeds the LM head
                    x, a, routed = x.index_select(0, last), a.index_select(0, last), only_last
                x = layer.post_attention(x, a, moe=self._moe(j, routed))
            return self.device.to_host(m.logits(x))

    @torch.inference_mode()
    def decode(self, cache: RaggedKVCache | LatentKVCache, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        m = self.model
        self._prefill = False
        self._new_pass()
        kv = self._kv_of(cache)
        outs = []
        host = []
        for tok, off, pos in micro_batches:
            longest = int(pos.max()) + 1
            if isinstance(off, PagedLayout):  # attention gathers through each row's slots
                keys, where = off.keys.tolist(), off.slot_table((pos + 1).tolist(), longest)
            else:
                keys, where = off.tolist(), off
            host.append((tok, where, decode_slots(off, pos), pos + 1, longest,
                         *m.rotary(pos, m.embed_tokens.weight.dtype),
                         [(s, slice(i, i + 1)) for i, s in enumerate(keys)]))
        with self.counts.step(self.cfg.num_layers * len(micro_batches)), self.device.compute():
            # the host data is prepared above: reading it is no sync
            for tok, off, slots, lengths, longest, cos, sin, rows in host:
                slots, off_d, len_d = (self._upload(t) for t in (slots, off, lengths))
                x = m.embed_tokens(self._upload(tok))
                cos, sin = self._upload(cos), self._upload(sin)
                for j, layer in enumerate(m.layers):
                    q, entry = layer.attention_inputs(x, cos, sin, decode=True)
                    kv.write(j, *entry, slots)
                    a = batched_decode_attention(q, *kv.key_value(j), off_d, len_d, longest,
                                                 self.scale, **attention_extras(m, j)).flatten(1)
                    x = layer.post_attention(x, layer.decode_output(a), moe=self._moe(j, rows))
                outs.append(self.device.to_host(m.logits(x)))
        return outs

    def close(self) -> None:
        """Stop the copy thread after its copy under way, wait for the device, and drop the slots."""
        try:
            self.worker.close()
            self.device.synchronize()
        finally:
            self.device.close()
            self.slots.close()
            self._kv = self._kv_src = None


def _host_terms(mlp) -> tuple:
    """The block's expert activation and biases, the biases copied to the host (before they move)."""
    activation, gate_up_bias, down_bias = mlp.expert_terms()
    return activation, *(None if b is None else b.detach().cpu().clone() for b in (gate_up_bias, down_bias))
