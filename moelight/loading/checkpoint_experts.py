"""What a quantized checkpoint holds for its routed experts, read from the tensor names alone (no data).

config.json says how the checkpoint quantizes; it does not say which modules it quantized. Quantizers
leave modules in float (HF's `modules_to_not_convert`, compressed-tensors' `ignore`, or a layer simply
stored unquantized), and transformers and vLLM load those as plain weights. The expert format is chosen
from what is stored (loading/expert_storage.py): experts all in float are plain 16-bit experts, all
quantized are held as shipped, and a mix is held only where every expert is dequantised at load.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moelight.loading.int_checkpoints import quantized_modules
from moelight.loading.weights import checkpoint_files, safetensors_names
from moelight.models import family
from moelight.models.config import ModelConfig


def with_expert_storage(cfg: ModelConfig, model_dir: Path) -> ModelConfig:
    """`cfg` with one routed-expert tensor the checkpoint stores in float and one it stores quantized
    (each '' if none); unchanged for a folder with no weights (a config for dummy weights)."""
    if cfg.checkpoint_scheme is None and not cfg.fp8_block:
        return cfg  # GPT-OSS's MXFP4 experts: the family's own weight map reads them
    if not any(model_dir.glob("*.safetensors")):
        return cfg
    names = set()
    for path in checkpoint_files(model_dir):
        names |= safetensors_names(path)
    if cfg.checkpoint_scheme is not None:
        modules = quantized_modules(names, cfg.checkpoint_scheme, str(model_dir), cfg.listed_float)
        parts = {p for found in modules.values() for p in found.values()}
        quantized = set(modules)
        plain = {n for n in names if n not in parts}
    else:  # DeepSeek's FP8: a weight is e4m3 beside its weight_scale_inv, unless listed as kept in float
        quantized = {n for n in names if f"{n}_scale_inv" in names and not cfg.listed_float(n.removesuffix(".weight"))}
        plain = names - quantized
    routed = {f"layers.{j}.mlp.{p}" for j in range(cfg.num_layers) if cfg.is_sparse(j)
              for p in ("gate_up_proj", "down_proj")}
    targets_of = family(cfg.model_type).tensor_targets
    found = {"float": "", "quantized": ""}
    for kind, group in (("quantized", quantized), ("float", plain)):
        for name in sorted(group):
            if any(t.param in routed for t in targets_of(name, cfg) or ()):
                found[kind] = name
                break
    return replace(cfg, float_expert=found["float"], quantized_expert=found["quantized"])
