"""Where latency mode's cached experts live: the device's expert slots and the host copies they are
filled from, as 16-bit matrices or, with `--quantize`, as quantized bytes.

`DenseSlots`: a slot is one expert's gate_up [2f, h] and down [h, f] in the run's dtype, copied from
the model's (pinned) parameters. `QuantizedSlots`: a slot is one expert's codes and scales in one
byte row (runtime/expert_stacks.StackLayout), copied from a pinned host row per expert, so a fetch
moves a quarter (int4) or half (int8) of the bytes; where the fused dequant-GEMM runs (runs_fused)
the slot's codes are what the per-expert loop multiplies (`F.linear` of a QuantizedStack), else the
expert is expanded into the run's dtype in a one-expert buffer on the device when the layer uses it
(an expert's gate_up is asked for first, then its down: the per-expert loop of `moe.expert_mix`).
An expert run on the CPU is expanded there.
"""

from __future__ import annotations

import torch

from moelight.devices.device_base import Device
from moelight.models.causal_lm import MoECausalLM
from moelight.models.fused_dequant import QuantizedStack
from moelight.models.quantized_experts import held_quantized
from moelight.runtime.expert_stacks import DEQUANTIZE_SCRATCH, StackLayout, dequantize_stacks, runs_fused


def slot_bytes(model: MoECausalLM, device: Device | str = "emulated") -> tuple[int, int]:
    """(device bytes per expert slot, device bytes needed once beside the slots): quantized, a slot is
    the expert's byte row and the once-only part its expansion buffer and temporaries (none where the
    fused dequant-GEMM multiplies the codes)."""
    cfg, held = model.config, held_quantized(model)
    if held is None:
        return 3 * cfg.hidden_size * cfg.intermediate_size * model.embed_tokens.weight.element_size(), 0
    dense = StackLayout.dense(1, cfg.hidden_size, cfg.intermediate_size, model.embed_tokens.weight.dtype)
    once = 0 if runs_fused(model, device) else dense.nbytes + DEQUANTIZE_SCRATCH
    return StackLayout.quantized(1, *held).nbytes, once


class DenseSlots:
    def __init__(self, model: MoECausalLM, layers: list[int], slots: int, device: Device, pin: bool) -> None:
        cfg, dtype = model.config, model.embed_tokens.weight.dtype
        f, h = cfg.intermediate_size, cfg.hidden_size
        self.model = model
        self.gu = device.empty((slots, 2 * f, h), dtype, "expert-slots", lane="h2d")  # the copies write them
        self.dn = device.empty((slots, h, f), dtype, "expert-slots", lane="h2d")
        for t in (self.gu, self.dn):
            device.record_stream(t, "gpu")
        if pin:
            for j in layers:
                mlp = model.layers[j].mlp
                for p in (mlp.gate_up_proj, mlp.down_proj):
                    p.data = device.pin(p.data)

    def chunks(self, layer: int, e: int, slot: int, pieces: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """A fetch's copies (dst, src): one chunk, or ProMoE's three (gate, up, down)."""
        mlp = self.model.layers[layer].mlp
        gu, dn = mlp.gate_up_proj[e].detach(), mlp.down_proj[e].detach()
        dgu, ddn = self.gu[slot], self.dn[slot]
        if pieces == 3:
            half = gu.shape[0] // 2
            return [[(dgu[:half], gu[:half])], [(dgu[half:], gu[half:])], [(ddn, dn)]]
        return [[(dgu, gu), (ddn, dn)]]

    def on_device(self, slot: int, gate_up: bool) -> torch.Tensor:
        return self.gu[slot] if gate_up else self.dn[slot]

    def on_host(self, layer: int, e: int, gate_up: bool) -> torch.Tensor:
        mlp = self.model.layers[layer].mlp
        return (mlp.gate_up_proj if gate_up else mlp.down_proj)[e].detach()

    def close(self) -> None:
        self.gu = self.dn = None


class QuantizedSlots:
    def __init__(self, model: MoECausalLM, layers: list[int], slots: int, device: Device, pin: bool) -> None:
        cfg, dtype = model.config, model.embed_tokens.weight.dtype
        f, h = cfg.intermediate_size, cfg.hidden_size
        self.layout = StackLayout.quantized(1, *held_quantized(model))
        self.host: dict[int, torch.Tensor] = {}  # layer -> [E, row bytes]: each expert's byte row
        for j in layers:
            mlp = model.layers[j].mlp
            rows = torch.empty(cfg.num_experts, self.layout.nbytes, dtype=torch.uint8)
            for e in range(cfg.num_experts):
                self.layout.fill(rows[e], mlp.gate_up_proj, mlp.down_proj, e)
            self.host[j] = device.pin(rows) if pin else rows
        self.rows = device.empty((slots, self.layout.nbytes), torch.uint8, "expert-slots", lane="h2d")
        device.record_stream(self.rows, "gpu")
        self.dtype, self.fused = dtype, runs_fused(model, device)
        self.gu = self.dn = None  # the one-expert expansion buffer: none where the fused kernel runs
        if not self.fused:
            self.gu = device.empty((1, 2 * f, h), dtype, "expanded-expert")
            self.dn = device.empty((1, h, f), dtype, "expanded-expert")
        self.host_gu, self.host_dn = torch.empty(1, 2 * f, h, dtype=dtype), torch.empty(1, h, f, dtype=dtype)

    def chunks(self, layer: int, e: int, slot: int, pieces: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """One copy of the expert's byte row (ProMoE's three pieces do not apply to quantized rows)."""
        return [[(self.rows[slot], self.host[layer][e])]]

    def on_device(self, slot: int, gate_up: bool) -> torch.Tensor | QuantizedStack:
        if self.fused:  # the codes as they are, for the fused kernel
            return self.layout.quantized_stacks(self.layout.views(self.rows[slot]), self.dtype)[0 if gate_up else 1]
        if gate_up:  # an expert's first use: expand it (its down follows)
            dequantize_stacks(self.layout, self.layout.views(self.rows[slot]), self.gu, self.dn)
        return self.gu[0] if gate_up else self.dn[0]

    def on_host(self, layer: int, e: int, gate_up: bool) -> torch.Tensor:
        if gate_up:
            row = self.host[layer][e]
            dequantize_stacks(self.layout, self.layout.views(row), self.host_gu, self.host_dn)
        return self.host_gu[0] if gate_up else self.host_dn[0]

    def close(self) -> None:
        self.rows = self.gu = self.dn = None


def expert_slots(model: MoECausalLM, layers: list[int], slots: int, device: Device, pin: bool):
    cls = QuantizedSlots if held_quantized(model) is not None else DenseSlots
    return cls(model, layers, slots, device, pin)
