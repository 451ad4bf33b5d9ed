"""The real executor: launches a schedule's task graph on a device (the engine's executor).

`PipelineExecutor` implements the executor interface (runtime/executor.py), so
`Engine(model, eos, executor=PipelineExecutor(model, ...))` runs the CGOPipe runtime
(or one of the comparison schedules). Every pass builds its graph with the same
builders the simulator times, binds each task to the work of pass_tasks.py, and submits
the tasks in launch order (the launcher thread of the paper's Algorithm 1); the device's
lane workers run them.

Every tensor the pass puts on the device counts against the device's memory (the emulated
device counts the kernels' temporaries too; CUDA's allocator is capped at the capacity), so a
pass that would not fit raises DeviceOutOfMemory. The compute lane issues no host sync in a
decode pass (its inputs are uploaded from pinned memory, the experts run as grouped GEMMs);
`stats()` reports the syncs per decode step and the kernel launches per layer pass it measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moelight.devices.compute_counter import DecodeCounts
from moelight.devices.device_attention import score_budget
from moelight.devices.device_base import Device
from moelight.devices.host_buffers import HostBuffers
from moelight.devices.registry import create_device
from moelight.models.causal_lm import MoECausalLM
from moelight.pipeline.held_tensors import in_inference_mode
from moelight.pipeline.memory_plan import MemoryPlan
from moelight.pipeline.pass_tasks import DecodeTasks, PassTasks, PrefillTasks
from moelight.pipeline.schedule import (
    GraphShape,
    Schedule,
    Task,
    attention_on_gpu,
    build_decode,
    build_prefill,
)
from moelight.pipeline.weight_pager import WeightPager
from moelight.runtime.executor import Executor, MicroBatch
from moelight.runtime.expert_stacks import runs_fused
from moelight.runtime.forward import attention_extras
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.runtime.latent_kv_cache import LatentKVCache
from moelight.runtime.paged_layout import PagedLayout


class PipelineExecutor(Executor):
    """CGOPipe runtime (and the comparison schedules) over a Device. Reads block tables (prefix
    sharing): CPU attention through the paged kernels, GPU attention over the prefixes uploaded."""

    supports_paged = True

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
        max_sequences: int | None = None,
        **device_kwargs,
    ) -> None:
        """max_batch: the largest micro-batch; max_sequences: the most sequences of one decode pass
        (all its micro-batches; default max_batch). compute_in_order: run the GPU lane's tasks
        strictly in launch order. Tensor-parallel ranks need it: their layers all-reduce, and
        collectives must be issued in the same order on every rank, which ready-first picking on
        each rank alone does not guarantee. On an emulated device the capacity defaults to the
        memory plan's total; CUDA's to the GPU's free memory (device_memory caps either)."""
        self.model, self.cfg, self.schedule = model, model.config, schedule
        self.compute_in_order = compute_in_order
        self.dtype = model.embed_tokens.weight.dtype
        self.slot_base = 0  # double-buffer slot of layer 0 in the next pass
        self.first_loaded = False  # layer 0's paged experts already sit in slot_base
        build_decode(schedule, self._shape([1], [1.0], 0))  # validates the name early
        n_res = max(0, min(self.cfg.num_experts, round(r_w * self.cfg.num_experts)))
        # quantized experts: multiplied as codes by the fused dequant-GEMM, or expanded into a dense layer first
        fused = runs_fused(model, device)
        self.plan = MemoryPlan.for_model(
            model,
            n_res,
            max_prefill_tokens,
            max_prompt_len,
            max_batch,
            max_context,
            attention_on_gpu(schedule),
            max_sequences or max_batch,
            fused,
        )
        # per layer: window and sinks for the CPU's attention, read while the model is still on the host
        # (read back after the pager moved them, the copy would race their upload on another stream)
        self.host_extras = [{k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                             for k, v in attention_extras(model, j).items()} for j in range(self.cfg.num_layers)]
        owned = isinstance(device, str)
        if owned:
            capacity = device_memory or (self.plan.total if device == "emulated" else None)
            device = create_device(device, capacity_bytes=capacity, **device_kwargs)
        self.device = device
        self.score_budget = score_budget(device)  # prefill attention's share
        try:
            self.pager = WeightPager(model, device, r_w, fused)
        except BaseException:
            if owned:
                device.close()
            raise
        self.staging = HostBuffers(device)
        self.counts = DecodeCounts(device)
        self.scale = self.cfg.attention_scale
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


    def weight_task(self, t: Task) -> Callable[[], None] | None:
        """The work of a weight-paging task (None for any other task)."""
        if t.op == "w_stage":
            return lambda: self.pager.stage(t.layer, t.page, t.n_pages, t.pin_slot)
        if t.op == "w_h2d":
            return lambda: self.pager.upload(t.page, t.n_pages, t.slot, t.pin_slot, t.layer)
        return None

    def post_attention(self, j: int, x: torch.Tensor, attn: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Layer j's post-attention (decode: attention as the cache returned it, MLA's in latent space);
        a sparse layer's experts from the page table of this pass."""
        layer = self.model.layers[j]
        if decode:
            attn = layer.decode_output(attn)
        if not self.cfg.is_sparse(j):
            return layer.post_attention(x, attn)  # a dense layer: its MLP is resident on the device
        table = self.pager.table(j, (self.slot_base + j) % 2)
        return layer.post_attention(x, attn, moe=lambda h: layer.mlp.forward_with(h, table, table, F.linear))

    def _pass(self, graph: Schedule, tasks: PassTasks) -> None:
        try:
            self._run(graph, tasks.bind)
        finally:
            tasks.finish()

    # ---- prefill ----
    @torch.inference_mode()
    def prefill(
        self, cache: RaggedKVCache | LatentKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
        offsets: torch.Tensor | PagedLayout, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All layers on the device; each layer's K/V go to the CPU cache. -> logits [B, vocab] of each
        prompt's last token, or of the packed positions `rows` (prompt logprobs: the LM head's output
        for every asked row is on the device at once)."""
        tasks = PrefillTasks(self, cache, tokens, seq_lens, offsets, rows)
        T = int(seq_lens.sum())
        self._pass(build_prefill(self._shape([len(seq_lens)], [float(seq_lens.float().mean())],
                                             self.pager.paged_bytes, prompt_tokens=T)), tasks)
        return tasks.logits("logits")

    # ---- decode ----
    @torch.inference_mode()
    def decode(self, cache: RaggedKVCache | LatentKVCache, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """One token for every sequence of every micro-batch -> logits [B_i, vocab] each."""
        tasks = DecodeTasks(self, cache, micro_batches)
        graph = build_decode(self.schedule, self._shape([len(t) for t, *_ in micro_batches],
                                                        [float((pos + 1).float().mean()) for *_, pos in micro_batches],
                                                        self.pager.paged_bytes))
        with self.counts.step(self.cfg.num_layers * len(micro_batches)):
            self._pass(graph, tasks)
        return [tasks.logits(("logits", i)) for i in range(len(micro_batches))]

    def stats(self) -> dict:
        """The runtime's figures for the job's report: host syncs the compute lane issued per decode
        step and kernel launches per layer pass (one layer over one micro-batch), as measured."""
        return self.counts.stats() | {"schedule": self.schedule}

    def close(self) -> None:
        """Stop the device and drop every device tensor this executor holds (a reference kept by a
        caller, such as an old engine, must not keep them on the GPU)."""
        self.device.close()
        self.pager = None
        self.staging = None
