"""Weight placement and paging per the policy (paper section 4.1 and appendix A.1).

- Non-expert weights (attention projections, norms, router, embeddings, LM head) and
  round(r_w * E) experts of every layer stay on the device.
- The other experts of a layer stay in CPU memory where the model holds them (no second copy),
  read as one flat buffer of the paged layout, cut into as many pages as the pass has
  micro-batches. A page goes CPU memory -> pinned staging buffer (the "pin" lane, a host
  memcpy) -> device (the "h2d" lane); two pinned buffers let page g+1 be staged while page g
  crosses the link.
- The device holds two slots of one layer's paged experts (this layer / next layer), each laid
  out as the paged experts' stacked gate/up matrices, then their stacked down matrices; a
  layer's table (`GroupedExperts`) names its resident stack and the slot's two stacks, which the
  grouped expert kernels read (models/grouped_experts.py).
- Slots are allocated on the h2d lane, which writes them, and recorded for the compute lane,
  which reads them (DESIGN.md section 8f).

r_w is rounded to whole experts here (Mixtral: steps of 1/8); the simulator uses r_w as is.
"""

from __future__ import annotations

import torch

from moelight.devices.device_base import Device
from moelight.models.causal_lm import MoECausalLM
from moelight.models.grouped_experts import ExpertGroup, GroupedExperts
from moelight.models.quantized_experts import QuantizedExperts, held_quantized
from moelight.runtime.expert_stacks import StackLayout, dequantize_stacks, gather, runs_fused


class WeightPager:
    """Owns the device copies of the weights and moves the paged experts (as bytes: 16-bit stacks, or
    quantized ones that the device dequantizes before the layer's GEMMs, or that the fused dequant-GEMM
    multiplies as they are: `fused`, default runtime/expert_stacks.runs_fused)."""

    def __init__(self, model: MoECausalLM, device: Device, r_w: float, fused: bool | None = None) -> None:
        cfg = model.config
        self.model, self.device = model, device
        self.n_layers, self.n_experts = cfg.num_layers, cfg.num_experts
        self.n_resident = max(0, min(cfg.num_experts, round(r_w * cfg.num_experts)))
        self.n_paged = cfg.num_experts - self.n_resident
        self.dtype = model.embed_tokens.weight.dtype
        f, h = cfg.intermediate_size, cfg.hidden_size
        self.gu_shape, self.dn_shape = (2 * f, h), (h, f)
        self.sparse = [cfg.is_sparse(j) for j in range(cfg.num_layers)]  # a dense layer pages nothing
        held = held_quantized(model)
        self.quantized = held is not None
        self.fused = runs_fused(model, device.torch_device) if fused is None else fused and self.quantized
        if held is not None:
            self.resident_layout = StackLayout.quantized(self.n_resident, *held)
            self.paged_layout = StackLayout.quantized(self.n_paged, *held)
        else:
            self.resident_layout = StackLayout.dense(self.n_resident, h, f, self.dtype)
            self.paged_layout = StackLayout.dense(self.n_paged, h, f, self.dtype)
        self.paged_bytes = self.paged_layout.nbytes if self.n_paged else 0

        # non-expert modules: resident on the device
        for mod, tag in [(model.embed_tokens, "embed"), (model.norm, "norm"), (model.lm_head, "lm_head")]:
            device.to_device_module(mod, tag)
        for layer in model.layers:  # all but the routed experts: attention, norms, router, a shared expert
            for name, mod in layer.named_children():
                for sub in (mod.children() if name == "mlp" else (mod,)):
                    if not isinstance(sub, QuantizedExperts):
                        device.to_device_module(sub, "non-expert")

        self.resident: list[dict[str, torch.Tensor] | None] = []  # per layer: its resident stacks on the device
        # per layer: the paged stacks in CPU memory, as (offset in the paged layout, bytes) views of the model's
        self.cpu_pages: list[list[tuple[int, torch.Tensor]] | None] = []
        for j, layer in enumerate(model.layers):
            if not self.sparse[j]:  # its dense MLP went to the device with the other non-expert modules
                self.resident.append(None)
                self.cpu_pages.append(None)
                continue
            gu, dn = layer.mlp.gate_up_proj, layer.mlp.down_proj
            on_device = device.empty((self.resident_layout.nbytes,), torch.uint8, "resident-experts")
            staged = torch.empty(self.resident_layout.nbytes, dtype=torch.uint8)
            self.resident_layout.fill(staged, gu, dn, 0)
            with device.compute():  # written on the stream that reads it (and allocated it)
                on_device.copy_(staged)
            self.resident.append(self.resident_layout.views(on_device))
            # the paged experts stay where the model holds them (a flat copy doubled their host memory)
            self.cpu_pages.append(self.paged_layout.segments(gu, dn, self.n_resident) if self.n_paged else [])
        self.slots = [device.empty((self.paged_bytes,), torch.uint8, "paged-slot", lane="h2d") for _ in range(2)]
        for s in self.slots:
            device.record_stream(s, "gpu")
        self.slot_views = [self.paged_layout.views(s) for s in self.slots]
        self.pinned: list[torch.Tensor] = []
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None  # quantized: one layer's experts expanded
        self.dense_layer: int | None = None
        if self.quantized and not self.fused:
            e = cfg.num_experts
            self.dense = (device.empty((e, *self.gu_shape), self.dtype, "dequantized-experts"),
                          device.empty((e, *self.dn_shape), self.dtype, "dequantized-experts"))

    # ---- pages ----
    def page_range(self, page: int, n_pages: int) -> tuple[int, int]:
        """Bytes [start, end) of the paged buffer that page `page` of `n_pages` holds."""
        per = -(-self.paged_bytes // n_pages)
        return min(page * per, self.paged_bytes), min((page + 1) * per, self.paged_bytes)

    def ensure_pinned(self, n_pages: int) -> None:
        """Two pinned staging buffers of one page each (grown when pages get larger)."""
        need = -(-self.paged_bytes // max(1, n_pages))
        if not self.pinned or self.pinned[0].numel() < need:
            self.pinned = [self.device.pinned((need,), torch.uint8) for _ in range(2)]

    def page_bytes(self, page: int, n_pages: int, layer: int = 0) -> int:
        if not self.sparse[layer % self.n_layers]:
            return 0
        s, e = self.page_range(page, n_pages)
        return e - s

    def stage(self, layer: int, page: int, n_pages: int, pin_slot: int) -> None:
        """Hop 1: CPU memory -> pinned buffer (host memcpy on the pin lane)."""
        pages = self.cpu_pages[layer % self.n_layers]
        if pages is None:
            return
        s, e = self.page_range(page, n_pages)
        gather(pages, s, self.pinned[pin_slot][: e - s])

    def upload(self, page: int, n_pages: int, slot: int, pin_slot: int, layer: int = 0) -> None:
        """Hop 2: pinned buffer -> device slot (on the h2d lane)."""
        if not self.sparse[layer % self.n_layers]:
            return
        s, e = self.page_range(page, n_pages)
        self.device.copy(self.slots[slot][s:e], self.pinned[pin_slot][: e - s])

    def table(self, layer: int, slot: int) -> GroupedExperts:
        """A layer's experts on the device: its resident stack and the stacks in `slot` (quantized and
        fused: the same, as codes; else both expanded into the dense buffer by the layer's first
        micro-batch, on the compute lane after the slot's upload; a layer's experts are the same every
        pass, so the buffer is reused until the next layer needs it)."""
        layer %= self.n_layers
        views = self.slot_views[slot]
        if not self.quantized:
            res = self.resident[layer]
            return GroupedExperts((ExpertGroup(0, res["gate_up"], res["down"]),
                                   ExpertGroup(self.n_resident, views["gate_up"], views["down"])), self.n_experts)
        if self.fused:  # the fused dequant-GEMM reads the codes where they are
            res = self.resident_layout.quantized_stacks(self.resident[layer], self.dtype)
            paged = self.paged_layout.quantized_stacks(views, self.dtype)
            return GroupedExperts((ExpertGroup(0, *res), ExpertGroup(self.n_resident, *paged)), self.n_experts)
        gu, dn = self.dense
        if self.dense_layer != layer:
            r = self.n_resident
            dequantize_stacks(self.resident_layout, self.resident[layer], gu[:r], dn[:r])
            dequantize_stacks(self.paged_layout, views, gu[r:], dn[r:])
            self.dense_layer = layer
        return GroupedExperts((ExpertGroup(0, gu, dn),), self.n_experts)
