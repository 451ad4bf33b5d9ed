"""Weight placement and paging per the policy (paper section 4.1 and appendix A.1).

- Non-expert weights (attention projections, norms, router, embeddings, LM head) and
  round(r_w * E) experts of every layer stay on the device.
- The other experts of a layer live in CPU memory as one flat buffer, cut into as many
  pages as the pass has micro-batches. A page goes CPU memory -> pinned staging buffer
  (the "pin" lane, a host memcpy) -> device (the "h2d" lane); two pinned buffers let
  page g+1 be staged while page g crosses the link.
- The device holds two slots of one layer's paged experts (this layer / next layer), and
  a page table maps expert e of a layer to a resident tensor or a view into a slot: it
  is what expert_mix indexes as gate_up_proj[e] / down_proj[e].

r_w is rounded to whole experts here (Mixtral: steps of 1/8); the simulator uses r_w as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelight.devices.device_base import Device
from moelight.models.causal_lm import MoECausalLM


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def activation_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """Live device activations per token inside one layer: hidden state and residual,
    q/k/v, attention output, and the MoE FFN's gathered tokens, gate/up and down outputs
    for its top-k experts (router math in float32)."""
    h, f, k = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.mla:  # the larger of decode's absorbed q and prefill's q; prefill's expanded K and V beside the row
        m = cfg.mla
        q = cfg.num_heads * max(m.qk_head_dim, m.cache_width)
        kv = (cfg.num_heads * (m.qk_head_dim + m.v_head_dim) + m.cache_width + 1) // 2
    return _elem(dtype) * (4 * h + 2 * q + 2 * kv + k * (2 * h + 3 * f)) + 4 * (2 * cfg.num_experts + 4 * k)


def prefill_attention_scratch(cfg, longest_prompt: int) -> int:
    """Scores of the longest prompt's causal attention (float32), the kernel's worst case."""
    return 4 * cfg.num_heads * longest_prompt * longest_prompt


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes the runtime may use (DESIGN.md section 4's GPU constraint)."""

    non_expert: int
    resident_experts: int
    paged_slots: int  # 2 x one layer's CPU-resident experts
    activations: int  # the largest pass (prefill chunk or a decode micro-batch wave)
    kv_buffers: int  # FlexGen: two micro-batches' KV of one layer

    @property
    def total(self) -> int:
        return self.non_expert + self.resident_experts + self.paged_slots + self.activations + self.kv_buffers

    @classmethod
    def for_model(
        cls,
        model: MoECausalLM,
        n_resident: int,
        max_prefill_tokens: int,
        max_prompt_len: int,
        max_batch: int,
        max_context: int,
        gpu_attention: bool,
    ) -> MemoryPlan:
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        el = _elem(dtype)
        expert = 3 * cfg.hidden_size * cfg.intermediate_size * el
        non_expert = sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if not n.endswith(("mlp.gate_up_proj", "mlp.down_proj"))
        )
        per_tok = activation_bytes_per_token(cfg, dtype)
        logits = 4 * cfg.vocab_size
        # decode: every micro-batch's hidden state lives through the pass; at most two
        # micro-batches are inside a layer at once, one in the FFN (bounded by max_batch)
        decode = max_batch * (per_tok + logits)
        prefill = (
            max_prefill_tokens * per_tok + prefill_attention_scratch(cfg, max_prompt_len) + max_batch * logits
        )
        kv = 2 * max_batch * (max_context + 1) * cfg.kv_elements_per_token * el if gpu_attention else 0
        return cls(
            non_expert,
            cfg.num_layers * n_resident * expert,
            2 * (cfg.num_experts - n_resident) * expert,
            max(decode, prefill),
            kv,
        )


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
            for k, e in enumerate(range(r, self.n_experts)):
                base = k * self.expert_elems
                flat[base : base + gu[e].numel()].copy_(gu[e].reshape(-1))
                flat[base + gu[e].numel() : base + self.expert_elems].copy_(dn[e].reshape(-1))
            self.cpu_pages.append(flat)
        self.slots = [device.empty((self.paged_elems,), self.dtype, "paged-slot") for _ in range(2)]
        self.slot_views = [self._views(s) for s in self.slots]
        self.pinned: list[torch.Tensor] = []
        self.slot_layer: dict[int, int] = {}  # slot -> layer whose pages it holds (after a pass)

    def _views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        gus, dns = [], []
        n_gu = self.gu_shape[0] * self.gu_shape[1]
        for k in range(self.n_paged):
            base = k * self.expert_elems
            gus.append(flat[base : base + n_gu].view(self.gu_shape))
            dns.append(flat[base + n_gu : base + self.expert_elems].view(self.dn_shape))
        return gus, dns

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

    def table(self, layer: int, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Page table of a layer: expert e -> its device tensor (resident or in `slot`)."""
        layer %= self.n_layers
        gus, dns = self.slot_views[slot]
        return ([*self.resident_gu[layer].unbind(0), *gus], [*self.resident_dn[layer].unbind(0), *dns])
