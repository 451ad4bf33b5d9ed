"""The real executor: launches a schedule's task graph on a device (the engine's executor).

`PipelineExecutor` implements the executor interface (runtime/executor.py), so
`Engine(model, eos, executor=PipelineExecutor(model, ...))` runs the CGOPipe runtime
(or one of the comparison schedules). Every pass builds its graph with the same
builders the simulator times, binds each task to a closure over the model, the page
table and the CPU KV cache, and submits the tasks in launch order (the launcher thread
of the paper's Algorithm 1); the device's lane workers run them.

Device-memory use is accounted task by task: resident weights, the two paged-weight
slots, activations (released by their last consumer) and per-kernel scratch; with the
emulated device a pass that would exceed the planned budget raises DeviceOutOfMemory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cpu_kernels import prefill_attention
from moelight.devices.device_base import Device
from moelight.devices.registry import create_device
from moelight.models.causal_lm import MoECausalLM
from moelight.pipeline.held_tensors import HeldTensors, in_inference_mode
from moelight.pipeline.schedule import (
    GraphShape,
    Schedule,
    Task,
    attention_on_gpu,
    build_decode,
    build_prefill,
)
from moelight.pipeline.weight_pager import (
    MemoryPlan,
    WeightPager,
    activation_bytes_per_token,
    prefill_attention_scratch,
)
from moelight.runtime.executor import Executor, MicroBatch
from moelight.runtime.forward import attention_extras
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.runtime.latent_kv_cache import LatentKVCache


class PipelineExecutor(Executor):
    """CGOPipe runtime (and the comparison schedules) over a Device."""

    def __init__(
        self,
        model: MoECausalLM,
        schedule: str = "cgopipe",
        device: str | Device = "emulated",
        r_w: float = 0.0,
        device_memory: int | None = None,
        max_prefill_tokens: int = 4096,
        max_prompt_len: int = 512,
        max_batch: int = 256,
        max_context: int = 2048,
        compute_in_order: bool = False,
        **device_kwargs,
    ) -> None:
        """compute_in_order: run the GPU lane's tasks strictly in launch order. Tensor-parallel
        ranks need it: their layers all-reduce, and collectives must be issued in the same order
        on every rank, which ready-first picking on each rank alone does not guarantee."""
        self.model, self.cfg, self.schedule = model, model.config, schedule
        self.compute_in_order = compute_in_order
        self.dtype = model.embed_tokens.weight.dtype
        self.slot_base = 0  # double-buffer slot of layer 0 in the next pass
        self.first_loaded = False  # layer 0's paged experts already sit in slot_base
        build_decode(schedule, self._shape([1], [1.0], 0))  # validates the name early
        n_res = max(0, min(self.cfg.num_experts, round(r_w * self.cfg.num_experts)))
        self.plan = MemoryPlan.for_model(
            model,
            n_res,
            max_prefill_tokens,
            max_prompt_len,
            max_batch,
            max_context,
            attention_on_gpu(schedule),
        )
        owned = isinstance(device, str)
        if owned:
            device = create_device(device, capacity_bytes=device_memory or self.plan.total, **device_kwargs)
        self.device = device
        try:
            self.pager = WeightPager(model, device, r_w)
        except BaseException:
            if owned:
                device.close()
            raise
        self.scale = self.cfg.attention_scale
        # per layer: window and sinks for the CPU's attention (the sinks copied back to the host once)
        self.host_extras = [{k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                             for k, v in attention_extras(model, j).items()} for j in range(self.cfg.num_layers)]
        self.last_pass: tuple[Schedule, list] | None = None  # graph and events of the last pass (timings)

    @classmethod
    def from_policy(
        cls,
        model: MoECausalLM,
        policy,
        schedule: str = "cgopipe",
        device: str | Device = "emulated",
        **kwargs,
    ) -> PipelineExecutor:
        """Executor for an optimizer Policy: its r_w, and its micro-batch size as the largest wave."""
        kwargs.setdefault("max_batch", policy.micro_batch_size)
        return cls(model, schedule, device, r_w=policy.r_w, **kwargs)

    # ---- graph plumbing ----
    def _shape(self, mb_tokens, mb_context, paged_bytes, prompt_tokens: int = 0) -> GraphShape:
        c = self.cfg
        el = torch.empty((), dtype=self.dtype).element_size()
        q, entry, attn = c.decode_widths()
        return GraphShape(
            c.num_layers,
            tuple(mb_tokens),
            tuple(mb_context),
            (q + entry) * el,
            attn * el,
            c.kv_elements_per_token * el,
            4 * c.vocab_size,
            paged_bytes,
            self.slot_base,
            self.first_loaded,
            True,
            prompt_tokens,
        )

    def _run(self, graph: Schedule, bind: Callable[[Task], Callable[[], None]]) -> None:
        n_pages = [t.n_pages for t in graph.tasks if t.op == "w_stage"]
        if n_pages:
            self.pager.ensure_pinned(min(n_pages))  # the largest page of the pass
        events, last_compute = [], None
        for t in graph.tasks:
            nbytes = t.nbytes
            if t.op == "w_h2d" or (t.op == "w_stage" and not self.pager.sparse[t.layer % self.cfg.num_layers]):
                nbytes = self.pager.page_bytes(t.page, t.n_pages, t.layer)  # 0 for a dense layer
            deps = [events[d] for d in t.deps]
            if self.compute_in_order and t.lane == "gpu" and last_compute is not None:
                deps.append(last_compute)
            events.append(self.device.submit(t.lane, in_inference_mode(bind(t)), deps, nbytes, t.name))
            if t.lane == "gpu":
                last_compute = events[-1]
        try:
            self.device.synchronize()
        except BaseException:
            self.first_loaded = False  # slot contents unknown after a failed pass
            raise
        self.last_pass = (graph, events)
        if self.pager.n_paged and graph.shape.prefetch_next:
            self.slot_base = (self.slot_base + self.cfg.num_layers) % 2
            self.first_loaded = True

    def _weights(self, t: Task) -> Callable[[], None] | None:
        if t.op == "w_stage":
            return lambda: self.pager.stage(t.layer, t.page, t.n_pages, t.pin_slot)
        if t.op == "w_h2d":
            return lambda: self.pager.upload(t.page, t.n_pages, t.slot, t.pin_slot, t.layer)
        return None

    def _moe(self, j: int):
        if not self.cfg.is_sparse(j):
            return None  # a dense layer: its MLP is resident on the device
        layer = self.model.layers[j]
        gu, dn = self.pager.table(j, (self.slot_base + j) % 2)
        return lambda h: layer.mlp.forward_with(h, gu, dn, F.linear)

    def _post(self, j: int, x: torch.Tensor, attn: torch.Tensor, decode: bool = False) -> torch.Tensor:
        scratch = self.device.reserve(
            x.shape[0] * activation_bytes_per_token(self.cfg, self.dtype), "moe-scratch"
        )
        try:
            layer = self.model.layers[j]
            return layer.post_attention(x, layer.decode_output(attn) if decode else attn, moe=self._moe(j))
        finally:
            self.device.release(scratch)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = self.device.pinned(t.shape, t.dtype)
        self.device.copy(host, t)
        return host

    def _to_device(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        dev = self.device.empty(t.shape, t.dtype, tag)
        self.device.copy(dev, t)
        return dev

    # ---- prefill ----
    @torch.inference_mode()
    def prefill(
        self, cache: RaggedKVCache | LatentKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """All layers on the device; each layer's K/V go to the CPU cache. -> logits [B, vocab]."""
        m, dev = self.model, self.device.torch_device
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(seq_lens, 0, out=cu[1:])
        positions = torch.arange(int(cu[-1]), dtype=torch.int64) - torch.repeat_interleave(cu[:-1], seq_lens)
        slots = torch.repeat_interleave(offsets, seq_lens) + positions
        last = cu[1:] - 1
        T, L = int(cu[-1]), self.cfg.num_layers
        graph = build_prefill(
            self._shape(
                [len(seq_lens)], [float(seq_lens.float().mean())], self.pager.paged_bytes, prompt_tokens=T
            )
        )
        held, out = HeldTensors(self.device), {}
        longest = int(seq_lens.max())

        def bind(t: Task) -> Callable[[], None]:
            w = self._weights(t)
            if w is not None:
                return w
            j, op = t.layer, t.op
            if op == "embed":

                def run():
                    x = m.embed_tokens(tokens.to(dev))
                    held.put(("x", 0), 1, x)
                    out["cos"], out["sin"] = (r.to(dev) for r in m.rotary(positions, x.dtype))
            elif op == "pre_attn":

                def run():
                    q, entry = m.layers[j].attention_inputs(held.get(("x", j))[0], out["cos"], out["sin"])
                    held.put(("q", j), 1, q)
                    held.put(("kv", j), 2, *entry)  # prefill attention and the copy to the CPU cache
            elif op == "kv_d2h":

                def run():
                    out[("kvh", j)] = tuple(self._to_host(t) for t in held.get(("kv", j)))
                    held.done(("kv", j))
            elif op == "kv_write":

                def run():
                    cache.write(j, *out.pop(("kvh", j)), slots)
            elif op == "prefill_attn":

                def run():
                    h = self.device.reserve(prefill_attention_scratch(self.cfg, longest), "attn-scratch")
                    try:
                        (q,), entry = held.get(("q", j)), held.get(("kv", j))
                        k, v = m.layers[j].prefill_kv(*entry)
                        a = prefill_attention(q, k, v, cu.to(dev), self.scale, **attention_extras(m, j)).flatten(1)
                    finally:
                        self.device.release(h)
                    held.put(("attn", j), 1, a)
                    held.done(("q", j))
                    held.done(("kv", j))
            elif op == "post_attn":

                def run():
                    x, a = held.get(("x", j))[0], held.get(("attn", j))[0]
                    if j == L - 1:
                        idx = last.to(dev)
                        x, a = x[idx], a[idx]
                    held.put(("x", j + 1), 1, self._post(j, x, a))
                    held.done(("x", j))
                    held.done(("attn", j))
            elif op == "lm_head":

                def run():
                    held.put(("logits",), 1, m.logits(held.get(("x", L))[0]))
                    held.done(("x", L))
            elif op == "logits_d2h":

                def run():
                    out["logits"] = self._to_host(held.get(("logits",))[0])
                    held.done(("logits",))
            else:
                raise ValueError(f"prefill has no op {op!r}")
            return run

        self._run(graph, bind)
        return out["logits"]

    # ---- decode ----
    @torch.inference_mode()
    def decode(self, cache: RaggedKVCache | LatentKVCache, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """One token for every sequence of every micro-batch -> logits [B_i, vocab] each."""
        m, dev, L = self.model, self.device.torch_device, self.cfg.num_layers
        mbs = [(tok, off, pos, off + pos, pos + 1) for tok, off, pos in micro_batches]
        graph = build_decode(
            self.schedule,
            self._shape(
                [len(t) for t, *_ in mbs],
                [float(ln.float().mean()) for *_, ln in mbs],
                self.pager.paged_bytes,
            ),
        )
        held, out = HeldTensors(self.device), {}

        def bind(t: Task) -> Callable[[], None]:
            w = self._weights(t)
            if w is not None:
                return w
            j, i, op = t.layer, t.mb, t.op
            tok, off, pos, slots, lengths = mbs[i] if i >= 0 else (None,) * 5
            if op == "embed":

                def run():
                    x = m.embed_tokens(tok.to(dev))
                    held.put(("x", 0, i), 1, x)
                    out[("rope", i)] = tuple(r.to(dev) for r in m.rotary(pos, x.dtype))
            elif op == "pre_attn":

                def run():
                    q, entry = m.layers[j].attention_inputs(held.get(("x", j, i))[0], *out[("rope", i)], decode=True)
                    users = 2 if attention_on_gpu(self.schedule) else 1  # FlexGen: GPU attention + copy out
                    held.put(("q", j, i), 1, q)
                    held.put(("kv", j, i), users, *entry)
            elif op == "qkv_d2h":

                def run():
                    (q,), entry = held.get(("q", j, i)), held.get(("kv", j, i))
                    out[("qkvh", j, i)] = (self._to_host(q), tuple(self._to_host(t) for t in entry))
                    held.done(("q", j, i))
                    held.done(("kv", j, i))
            elif op == "cpu_attn":

                def run():
                    q, entry = out.pop(("qkvh", j, i))
                    cache.write(j, *entry, slots)
                    out[("ah", j, i)] = cache.attend(j, q, off, lengths, self.scale, **self.host_extras[j]).flatten(1)
            elif op == "attn_h2d":

                def run():
                    held.put(("attn", j, i), 1, self._to_device(out.pop(("ah", j, i)), "attn"))
            elif op == "kv_h2d":

                def run():
                    new_off = torch.cumsum(lengths, 0) - lengths
                    src = torch.cat(
                        [torch.arange(o, o + p) for o, p in zip(off.tolist(), pos.tolist(), strict=True)]
                    )
                    dst = torch.cat(
                        [torch.arange(o, o + p) for o, p in zip(new_off.tolist(), pos.tolist(), strict=True)]
                    )
                    bufs = []
                    for cached in cache.layer(j):  # K and V, or MLA's latent rows: [heads, slots, width]
                        shape = (cached.shape[0], int(lengths.sum()), cached.shape[2])
                        d = self.device.empty(shape, self.dtype, "kv-buffer")
                        host = self.device.pinned(shape, self.dtype)
                        host[:, dst] = cached[:, src]
                        self.device.copy(d, host)
                        bufs.append(d)
                    out[("kvd", j, i)] = (cache.like([tuple(bufs)]), new_off)
            elif op == "gpu_attn":

                def run():
                    packed, new_off = out.pop(("kvd", j, i))
                    (q,), entry = held.get(("q", j, i)), held.get(("kv", j, i))
                    packed.write(0, *entry, (new_off + pos).to(dev))
                    a = packed.attend(0, q, new_off, lengths, self.scale, **attention_extras(m, j)).flatten(1)
                    for t in packed.layer(0):
                        self.device.free(t)
                    held.put(("attn", j, i), 1, a)
                    held.done(("q", j, i))
                    held.done(("kv", j, i))
            elif op == "kv_d2h":

                def run():
                    out[("newkv", j, i)] = tuple(self._to_host(t) for t in held.get(("kv", j, i)))
                    held.done(("kv", j, i))
            elif op == "kv_write":

                def run():
                    cache.write(j, *out.pop(("newkv", j, i)), slots)
            elif op == "post_attn":

                def run():
                    x, a = held.get(("x", j, i))[0], held.get(("attn", j, i))[0]
                    held.put(("x", j + 1, i), 1, self._post(j, x, a, decode=True))
                    held.done(("x", j, i))
                    held.done(("attn", j, i))
            elif op == "lm_head":

                def run():
                    held.put(("logits", i), 1, m.logits(held.get(("x", L, i))[0]))
                    held.done(("x", L, i))
            elif op == "logits_d2h":

                def run():
                    out[("logits", i)] = self._to_host(held.get(("logits", i))[0])
                    held.done(("logits", i))
            else:
                raise ValueError(f"decode has no op {op!r}")
            return run

        self._run(graph, bind)
        return [out[("logits", i)] for i in range(len(mbs))]

    def close(self) -> None:
        self.device.close()
