"""Loading Mixtral weights from Hugging Face safetensors, or making dummy ones.

Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`,
and both expert layouts: per-expert `block_sparse_moe.experts.{e}.w1/w2/w3` (original
Mixtral checkpoints) and packed `mlp.experts.gate_up_proj` / `down_proj` (transformers 5).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from moelight.config import ModelConfig
from moelight.errors import WeightsError
from moelight.model import MixtralModel

_LEGACY_EXPERT = re.compile(r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, validated to exist."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise WeightsError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "use a Hugging Face checkpoint folder, or --load-format dummy for random weights"
    )


def check_not_truncated(path: Path) -> None:
    """Compare the header's data extent with the file size: a cut download fails here, clearly."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise WeightsError(f"{path}: truncated or not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header ({e})") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise WeightsError(
            f"{path}: truncated: header describes {8 + header_len + end} bytes, file has {size}; "
            "download the file again"
        )


def _strip_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_weights(model: MixtralModel, model_dir: Path) -> None:
    """Fill `model` (already in its target dtype) from the checkpoint, checking every shape."""
    cfg = model.config
    params = dict(model.named_parameters())
    filled: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}  # packed param -> {(expert, w1|w2|w3)}
    for path in checkpoint_files(model_dir):
        check_not_truncated(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for raw in f.keys():
                    name = _strip_prefix(raw)
                    legacy = _LEGACY_EXPERT.match(name)
                    if legacy:
                        target = _fill_legacy_expert(params, legacy, f.get_tensor(raw), cfg, path, raw)
                        expert_parts.setdefault(target, set()).add((int(legacy.group(2)), legacy.group(3)))
                        continue
                    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.experts.", ".mlp.")
                    if name not in params:
                        continue  # e.g. rotary inv_freq buffers in old checkpoints
                    _copy(params[name], f.get_tensor(raw), path, raw)
                    filled.add(name)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own types for corrupt files
            raise WeightsError(f"{path}: cannot read ({e})") from e
    for target, parts in expert_parts.items():
        want = cfg.num_experts * (1 if target.endswith("down_proj") else 2)
        if len(parts) == want:
            filled.add(target)
    if cfg.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = [n for n in params if n not in filled]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightsError(f"{model_dir}: checkpoint is missing weights for: {shown}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, path: Path, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightsError(
            f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _fill_legacy_expert(params, m: re.Match, tensor, cfg: ModelConfig, path: Path, raw: str) -> str:
    """Copy one per-expert w1/w3/w2 into the packed tensors; returns the packed name."""
    layer, expert, which = int(m.group(1)), int(m.group(2)), m.group(3)
    if expert >= cfg.num_experts:
        raise WeightsError(f"{path}: {raw} but config.json has num_local_experts={cfg.num_experts}")
    f = cfg.intermediate_size
    packed = f"layers.{layer}.mlp.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
    if packed not in params:
        raise WeightsError(f"{path}: {raw} but config.json has num_hidden_layers={cfg.num_layers}")
    target = params[packed][expert]
    if which != "w2":
        target = target[:f] if which == "w1" else target[f:]
    _copy(target, tensor, path, raw)
    return packed


def init_dummy_weights(model: MixtralModel, seed: int = 0) -> None:
    """Random weights with the scale of a trained model, for benchmarking without files."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                # uniform with std 0.02 (as HF initialises); uniform is much faster than normal
                p.uniform_(-0.0346, 0.0346, generator=gen)


def build_model(cfg: ModelConfig, dtype: torch.dtype, model_dir: Path | None, seed: int = 0) -> MixtralModel:
    """Allocate the model in `dtype` without initialising, then load or randomise weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = MixtralModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device="cpu")
    if model_dir is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
