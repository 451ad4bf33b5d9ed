"""Latency mode's executor: the model on the device except its routed experts, which are served
from a fixed number of device expert slots (a cache fed by demand fetches and a policy's
prefetches), for small batches where each layer uses only a few experts.

Non-expert weights, the KV cache and the activations live on the device (the emulated one, or
CUDA). At each MoE layer the router runs first; the cache state (`cache_state.ExpertCache`)
turns its choices into hits and demand fetches, then plans prefetches; the copy thread
(`copy_worker.CopyWorker`) moves experts host -> slot, demands first; the layer's experts run from
the slots (in ascending order, as the plain engine sums them) once all of them have arrived.
Sequences are known by their KV-cache offset, which the engine keeps for a sequence's life.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cpu_kernels import prefill_attention
from moelight.expert_cache.cache_state import CacheStats, ExpertCache, Fetch
from moelight.expert_cache.copy_worker import CopyWorker
from moelight.expert_cache.policies import CachePolicy
from moelight.forward import attention_extras
from moelight.kv_cache import RaggedKVCache
from moelight.models.causal_lm import MoECausalLM
from moelight.pipeline.device_attention import device_decode_attention
from moelight.pipeline.device_base import Device, create_device, nbytes_of


def expert_bytes(model: MoECausalLM) -> int:
    """One routed expert's weights (gate, up and down) in the model's dtype."""
    c = model.config
    return 3 * c.hidden_size * c.intermediate_size * model.embed_tokens.weight.element_size()


def non_expert_bytes(model: MoECausalLM) -> int:
    return sum(nbytes_of(p) for n, p in model.named_parameters()
               if not n.endswith(("mlp.gate_up_proj", "mlp.down_proj")))


class ExpertCacheExecutor:
    def __init__(self, model: MoECausalLM, slots: int, policy: CachePolicy, device: str | Device = "emulated",
                 prefetch_per_layer: int = 0, device_memory: int | None = None, **device_kwargs) -> None:
        cfg = self.cfg = model.config
        self.model = model
        self.moe_layers = [j for j in range(cfg.num_layers) if cfg.is_sparse(j)]
        self.moe_index = {j: i for i, j in enumerate(self.moe_layers)}
        self.E = cfg.num_experts
        self.cache = ExpertCache(len(self.moe_layers), self.E, slots, policy,
                                 prefetch_per_layer if policy.predicts else 0)
        if isinstance(device, str):
            need = non_expert_bytes(model) + slots * expert_bytes(model)
            device = create_device(device, capacity_bytes=device_memory or 2 * need, **device_kwargs)
        self.device = device
        for mod in (model.embed_tokens, model.norm, model.lm_head):
            device.to_device_module(mod, "non-expert")
        for layer in model.layers:  # all but the routed experts, as the CGOPipe pager places them
            for name, mod in layer.named_children():
                for sub in (mod.children() if name == "mlp" else (mod,)):
                    device.to_device_module(sub, "non-expert")
        f, h = cfg.intermediate_size, cfg.hidden_size
        self.slot_gu = device.empty((slots, 2 * f, h), model.embed_tokens.weight.dtype, "expert-slots")
        self.slot_dn = device.empty((slots, h, f), model.embed_tokens.weight.dtype, "expert-slots")
        self.worker = CopyWorker(device, self._pairs, expert_bytes(model))
        self.scale = cfg.head_dim**-0.5
        self._kv_src: RaggedKVCache | None = None
        self._kv: tuple[list, list] | None = None

    @property
    def stats(self) -> CacheStats:
        self.cache.stats.fetched_bytes = float(self.worker.copied_bytes)
        return self.cache.stats

    # ---- the cache ----
    def _pairs(self, f: Fetch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layer, e = divmod(f.key, self.E)
        mlp = self.model.layers[self.moe_layers[layer]].mlp
        return [(self.slot_gu[f.slot], mlp.gate_up_proj[e].detach()), (self.slot_dn[f.slot], mlp.down_proj[e].detach())]

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

        def run(h: torch.Tensor) -> torch.Tensor:
            weights, experts = mlp.route(h)
            ex = experts.cpu().numpy()
            counts = {s: np.bincount(ex[rows].reshape(-1), minlength=E) for s, rows in seq_rows}
            for e in np.flatnonzero(sum(counts.values())):  # prefetched, still on its way: late
                key = i * E + int(e)
                if self.cache.cached(key) and self.cache.unused_prefetch[key] and self.worker.pending(key):
                    self.cache.stats.prefetch_late += 1
            needed, demand = self.cache.access(i, counts)
            self._issue(demand)
            self._issue(self.cache.plan_prefetch(i))
            gu, dn, used = [None] * E, [None] * E, []
            for e in needed:
                key = i * E + e
                self.worker.wait(key)
                s = int(self.cache.slot_of[key])
                gu[e], dn[e] = self.slot_gu[s], self.slot_dn[s]
                used.append(s)
            out = mlp.forward_with(h, gu, dn, F.linear, routing=(weights, experts))
            self.worker.used(used)
            return out

        return run

    def release_sequence(self, seq: int) -> None:
        """The engine finished the sequence at this KV offset: its activation record goes."""
        self.cache.release(seq)

    # ---- KV cache on the device ----
    def _kv_of(self, cache: RaggedKVCache) -> tuple[list, list]:
        """The engine's cache, on the device: counted where the device is emulated (the engine's
        tensors are already in this memory), a device copy of its layout on CUDA."""
        if cache is not self._kv_src:
            if self._kv is not None:
                for t in (*self._kv[0], *self._kv[1]):
                    self.device.free(t)
            if self.device.kind == "emulated":
                self._kv = ([self.device.adopt(t, "kv") for t in cache.k],
                            [self.device.adopt(t, "kv") for t in cache.v])
            else:
                self._kv = ([self.device.empty(t.shape, t.dtype, "kv") for t in cache.k],
                            [self.device.empty(t.shape, t.dtype, "kv") for t in cache.v])
            self._kv_src = cache
        return self._kv

    def _write_kv(self, kv, j: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kv[0][j].index_copy_(1, slots, k.transpose(0, 1))
        kv[1][j].index_copy_(1, slots, v.transpose(0, 1))

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = t.to("cpu")
        self.device.host_wait(host)
        return host

    # ---- passes ----
    @torch.inference_mode()
    def prefill(self, cache: RaggedKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        m, dev, L = self.model, self.device.torch_device, self.cfg.num_layers
        kv = self._kv_of(cache)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(seq_lens, 0, out=cu[1:])
        positions = torch.arange(int(cu[-1]), dtype=torch.int64) - torch.repeat_interleave(cu[:-1], seq_lens)
        slots = (torch.repeat_interleave(offsets, seq_lens) + positions).to(dev)
        last = cu[1:] - 1
        seqs = [int(o) for o in offsets]
        for s in seqs:
            self.cache.policy.begin(s)
        every = [(s, slice(int(a), int(b))) for s, a, b in zip(seqs, cu[:-1], cu[1:], strict=True)]
        only_last = [(s, slice(i, i + 1)) for i, s in enumerate(seqs)]
        x = m.embed_tokens(tokens.to(dev))
        cos, sin = (r.to(dev) for r in m.rotary(positions, x.dtype))
        cu_dev = cu.to(dev)
        for j, layer in enumerate(m.layers):
            q, k, v = layer.pre_attention(x, cos, sin)
            self._write_kv(kv, j, k, v, slots)
            a = prefill_attention(q, k, v, cu_dev, self.scale, **attention_extras(m, j)).flatten(1)
            rows = every
            if j == L - 1:  # only the last token of each prompt feeds the LM head
                x, a, rows = x[last.to(dev)], a[last.to(dev)], only_last
            x = layer.post_attention(x, a, moe=self._moe(j, rows))
        return self._to_host(m.logits(x))

    @torch.inference_mode()
    def decode(self, cache: RaggedKVCache, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        m, dev = self.model, self.device.torch_device
        kv = self._kv_of(cache)
        outs = []
        for tok, off, pos in micro_batches:
            lengths = pos + 1
            slots = (off + pos).to(dev)
            rows = [(int(s), slice(i, i + 1)) for i, s in enumerate(off)]
            x = m.embed_tokens(tok.to(dev))
            cos, sin = (r.to(dev) for r in m.rotary(pos, x.dtype))
            for j, layer in enumerate(m.layers):
                q, k, v = layer.pre_attention(x, cos, sin)
                self._write_kv(kv, j, k, v, slots)
                a = device_decode_attention(q, kv[0][j], kv[1][j], off, lengths, self.scale,
                                            **attention_extras(m, j)).flatten(1)
                x = layer.post_attention(x, a, moe=self._moe(j, rows))
            outs.append(self._to_host(m.logits(x)))
        return outs

    def close(self) -> None:
        self.worker.close()
        self.device.close()
