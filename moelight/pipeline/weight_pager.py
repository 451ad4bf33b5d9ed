"""Weight placement and paging per the policy (paper section 4.1 and appendix A.1).

- Non-expert weights (attention projections, norms, router, embeddings, LM head) and
  round(r_w * E) experts of every layer stay on the device.
- The other experts of a layer live in CPU memory as one flat buffer, cut into as many
  pages as the pass has micro-batches. A page goes CPU memory -> pinned staging buffer
  (the "pin" lane, a host memcpy) -> device (the "h2d" lane); two pinned buffers let
  page g+1 be staged while page g crosses the link.
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


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class WeightPager:
    """Owns the device copies of the weights and moves the paged experts."""

    def __init__(self, model: MoECausalLM, device: Device, r_w: float) -> None:
        cfg = model.config
        self.model, self.device = model, device
        self.n_layers, self.n_experts = cfg.num_layers, cfg.num_experts
        self.n_resident = max(0, min(cfg.num_experts, round(r_w * cfg.num_experts)))
        self.n_paged = cfg.num_experts - self.n_resident
        self.dtype = model.embed_tokens.weight.dtype
        f, h = cfg.intermediate_size, cfg.hidden_size
        self.gu_shape, self.dn_shape = (2 * f, h), (h, f)
        self.expert_elems = 3 * f * h
        self.paged_elems = self.n_paged * self.expert_elems
        self.paged_bytes = self.paged_elems * _elem(self.dtype)

        # non-expert modules: resident on the device
        for mod, tag in [(model.embed_tokens, "embed"), (model.norm, "norm"), (model.lm_head, "lm_head")]:
            device.to_device_module(mod, tag)
        for layer in model.layers:  # all but the routed experts: attention, norms, router, a shared expert
            for name, mod in layer.named_children():
                for sub in (mod.children() if name == "mlp" else (mod,)):
                    device.to_device_module(sub, "non-expert")

        self.resident_gu: list[torch.Tensor] = []
        self.resident_dn: list[torch.Tensor] = []
        self.cpu_pages: list[torch.Tensor | None] = []  # per layer: flat [paged_elems] in CPU memory
        self.sparse = [cfg.is_sparse(j) for j in range(cfg.num_layers)]  # a dense layer pages nothing
        for j, layer in enumerate(model.layers):
            r = self.n_resident
            if not self.sparse[j]:  # its dense MLP went to the device with the other non-expert modules
                self.resident_gu.append(device.empty((0, *self.gu_shape), self.dtype, "resident-experts"))
                self.resident_dn.append(device.empty((0, *self.dn_shape), self.dtype, "resident-experts"))
                self.cpu_pages.append(None)
                continue
            gu, dn = layer.mlp.gate_up_proj.detach(), layer.mlp.down_proj.detach()
            dgu = device.empty((r, *self.gu_shape), self.dtype, "resident-experts")
            ddn = device.empty((r, *self.dn_shape), self.dtype, "resident-experts")
            dgu.copy_(gu[:r])
            ddn.copy_(dn[:r])
            self.resident_gu.append(dgu)
            self.resident_dn.append(ddn)
            flat = torch.empty(self.paged_elems, dtype=self.dtype)
            stack_gu, stack_dn = self._views(flat)
            stack_gu.copy_(gu[r:])
            stack_dn.copy_(dn[r:])
            self.cpu_pages.append(flat)
        self.slots = [device.empty((self.paged_elems,), self.dtype, "paged-slot", lane="h2d") for _ in range(2)]
        for s in self.slots:
            device.record_stream(s, "gpu")
        self.slot_views = [self._views(s) for s in self.slots]
        self.pinned: list[torch.Tensor] = []

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged experts' gate/up stack [n, 2f, h] and down stack [n, h, f] in a flat buffer."""
        n_gu = self.n_paged * self.gu_shape[0] * self.gu_shape[1]
        return flat[:n_gu].view(self.n_paged, *self.gu_shape), flat[n_gu:].view(self.n_paged, *self.dn_shape)

    # ---- pages ----
    def page_range(self, page: int, n_pages: int) -> tuple[int, int]:
        per = -(-self.paged_elems // n_pages)
        return min(page * per, self.paged_elems), min((page + 1) * per, self.paged_elems)

    def ensure_pinned(self, n_pages: int) -> None:
        """Two pinned staging buffers of one page each (grown when pages get larger)."""
        need = -(-self.paged_elems // max(1, n_pages))
        if not self.pinned or self.pinned[0].numel() < need:
            self.pinned = [self.device.pinned((need,), self.dtype) for _ in range(2)]

    def page_bytes(self, page: int, n_pages: int, layer: int = 0) -> int:
        if not self.sparse[layer % self.n_layers]:
            return 0
        s, e = self.page_range(page, n_pages)
        return (e - s) * _elem(self.dtype)

    def stage(self, layer: int, page: int, n_pages: int, pin_slot: int) -> None:
        """Hop 1: CPU memory -> pinned buffer (host memcpy on the pin lane)."""
        pages = self.cpu_pages[layer % self.n_layers]
        if pages is None:
            return
        s, e = self.page_range(page, n_pages)
        self.pinned[pin_slot][: e - s].copy_(pages[s:e])

    def upload(self, page: int, n_pages: int, slot: int, pin_slot: int, layer: int = 0) -> None:
        """Hop 2: pinned buffer -> device slot (on the h2d lane)."""
        if not self.sparse[layer % self.n_layers]:
            return
        s, e = self.page_range(page, n_pages)
        self.device.copy(self.slots[slot][s:e], self.pinned[pin_slot][: e - s])

    def table(self, layer: int, slot: int) -> GroupedExperts:
        """A layer's experts on the device: its resident stack and the stacks in `slot`."""
        layer %= self.n_layers
        gus, dns = self.slot_views[slot]
        return GroupedExperts((ExpertGroup(0, self.resident_gu[layer], self.resident_dn[layer]),
                               ExpertGroup(self.n_resident, gus, dns)), self.n_experts)
