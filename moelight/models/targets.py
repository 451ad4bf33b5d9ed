"""Where a checkpoint tensor goes: a moelight parameter and the part of it the tensor fills.

Family weight maps return `Target`s; the loader (moelight/loading/weights.py) copies, checks shapes and
counts coverage, so a checkpoint that misses part of a packed expert tensor is caught too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moelight.models.config import ModelConfig


@dataclass(frozen=True)
class Target:
    param: str  # moelight parameter name, e.g. "layers.0.mlp.gate_up_proj"
    index: tuple = ()  # the part of it this tensor fills, e.g. (expert, slice(0, f))
    transform: Callable[..., torch.Tensor] | None = None  # e.g. a transpose or split
    companion: str | None = None  # another checkpoint tensor the transform also takes (MXFP4 scales)


# per-expert tensors: Mixtral's w1/w3/w2 and Qwen/OLMoE's gate_proj/up_proj/down_proj
PER_EXPERT = re.compile(r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
GATE, UP = ("w1", "gate_proj"), ("w3", "up_proj")


def strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def expert_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """Per-expert or packed routed-expert tensors into the packed [E, 2f, h] / [E, h, f] form."""
    m = PER_EXPERT.match(name)
    if m:
        layer, e, which = int(m.group(1)), int(m.group(2)), m.group(3)
        f = cfg.intermediate_size
        if which in GATE:
            return [Target(f"layers.{layer}.mlp.gate_up_proj", (e, slice(0, f)))]
        if which in UP:
            return [Target(f"layers.{layer}.mlp.gate_up_proj", (e, slice(f, 2 * f)))]
        return [Target(f"layers.{layer}.mlp.down_proj", (e,))]
    for packed in ("gate_up_proj", "down_proj"):
        if re.fullmatch(rf"layers\.\d+\.mlp\.experts\.{packed}", name):
            return [Target(name.replace(".experts.", "."))]
    return None


def hf_style_targets(raw: str, cfg: ModelConfig) -> list[Target] | None:
    """The common case: HF names equal moelight's once `model.` is stripped, experts aside."""
    name = strip_model_prefix(raw).replace(".block_sparse_moe.", ".mlp.")  # idempotent: callers may pre-strip
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return expert_targets(name, cfg) or [Target(name)]
