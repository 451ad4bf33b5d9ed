"""Loading weights from Hugging Face safetensors, or making dummy ones, for every family.

Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`. Each
family's weight map (`tensor_targets` in moelight/models/<family>.py) says where a tensor goes,
packed experts included (per-expert `experts.{e}.w1/w3/w2` or `gate_proj/up_proj/down_proj`,
transformers 5's packed `gate_up_proj` / `down_proj`, DBRX's stacked `w1/v1/w2`). Every element
of every parameter must be filled exactly once; the first one left empty is named.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from moelight.errors import WeightsError, broken_download_link
from moelight.loading.dummy_values import uniform_levels_
from moelight.loading.int_checkpoints import dequantized, quantized_modules, read_module
from moelight.models import family
from moelight.models.causal_lm import MoECausalLM
from moelight.models.config import ModelConfig
from moelight.models.quantized_experts import (
    QuantizedExperts,
    hold_experts_quantized,
    quantized_experts_of,
    routed_expert_param,
)
from moelight.models.targets import Target

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # codes that mean nothing without their scale
_EMBED, _LM_HEAD = "embed_tokens.weight", "lm_head.weight"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, validated to exist."""
    index = model_dir / "model.safetensors.index.json"
    check_link(index)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            check_link(f)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    check_link(single)
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    for f in found:
        check_link(f)
    if found:
        return found
    bins = sorted(p.name for p in model_dir.glob("*.bin") if p.name.startswith("pytorch_model"))
    if bins:
        raise WeightsError(
            f"{model_dir}: holds {bins[0]}{' and more' if len(bins) > 1 else ''}, PyTorch pickles, which moelight "
            "does not read; convert them to safetensors (in Python: AutoModelForCausalLM.from_pretrained(folder)"
            ".save_pretrained(new_folder), which writes model.safetensors), or --load-format dummy for random weights"
        )
    raise WeightsError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "use a Hugging Face checkpoint folder, or --load-format dummy for random weights"
    )


def check_link(path: Path) -> None:
    """A link whose file is gone is what an interrupted Hugging Face download leaves in snapshots/<hash>/
    (the blob is still `.incomplete`): said as such, not as a missing or unreadable file."""
    broken = broken_download_link(path)
    if broken:
        raise WeightsError(broken)


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


def load_weights(model: MoECausalLM, model_dir: Path) -> None:
    """Fill `model` (already in its target dtype) from the checkpoint, checking every shape. Quantized
    experts (models/quantized_experts.py) are filled as the parameter they stand for."""
    params = fillable_parameters(model)
    fill_parameters(model.config, model_dir, {n: p.numel() for n, p in params.items()}, params.__getitem__)


def fill_parameters(cfg: ModelConfig, model_dir: Path, numels: dict[str, int],
                    dest: Callable[[str], torch.Tensor], on_filled: Callable[[str], None] | None = None) -> None:
    """Copy every checkpoint tensor into `dest(parameter name)` (the parameter itself, or a staging
    tensor of its shape), checking shapes and that each of the `numels` elements is filled;
    `on_filled(name)` runs the moment a parameter's last element has arrived."""
    targets_of = family(cfg.model_type).tensor_targets
    filled: dict[str, int] = {}  # elements copied into each parameter
    with ExitStack() as stack:
        handles = {}  # tensor name -> (open file, path): a companion may live in another shard
        for path in checkpoint_files(model_dir):
            check_not_truncated(path)
            f = stack.enter_context(_open(path))
            handles.update({raw: (f, path) for raw in f.keys()})
        modules = _quantized_modules(cfg, handles, model_dir)  # GPTQ / AWQ / compressed-tensors layers
        parts = {part for found in modules.values() for part in found.values()}
        names = [n for n in handles if n not in parts] + list(modules)
        # a tied model may store its one matrix as lm_head.weight only: transformers ties it both ways
        lm_head_only = cfg.tie_word_embeddings and not any(
            t.param == _EMBED for raw in names for t in targets_of(raw, cfg) or ())
        for raw in names:
            path = handles[raw][1] if raw in handles else handles[next(iter(modules[raw].values()))][1]
            for t in targets_of(raw, cfg) or ():
                if lm_head_only and t.param == _LM_HEAD:
                    t = replace(t, param=_EMBED)
                if t.param not in numels:
                    _unknown(t.param, raw, path, cfg, lambda raw=raw: _read(*handles[raw], raw))
                    continue
                extra = ()
                if t.companion is not None:
                    if t.companion not in handles:
                        raise WeightsError(f"{path}: {raw} needs {t.companion}, which the checkpoint lacks (a "
                                           "module kept in float is listed in quantization_config."
                                           "modules_to_not_convert)")
                    extra = (_read(*handles[t.companion], t.companion),)
                target = dest(t.param)
                if raw in modules:  # kept quantized where the experts are held so, else dequantised
                    s = cfg.checkpoint_scheme
                    try:
                        piece = read_module(s, {p: _read(*handles[n], n) for p, n in modules[raw].items()})
                        tensor = piece if isinstance(target, QuantizedExperts) else dequantized(piece)
                    except (RuntimeError, ValueError) as e:  # shapes that do not unpack as config.json says
                        raise WeightsError(f"{path}: {raw}'s tensors ({', '.join(modules[raw].values())}) do not "
                                           f"fit config.json's {s.bits}-bit {s.method} with group {s.group} "
                                           f"({str(e).splitlines()[0]})") from None
                else:
                    tensor = _read(*handles[raw], raw)
                filled[t.param] = filled.get(t.param, 0) + _copy(target, t, tensor, path, raw, extra)
                if on_filled is not None and filled[t.param] == numels[t.param]:
                    on_filled(t.param)
    if cfg.tie_word_embeddings:
        filled[_LM_HEAD] = numels[_LM_HEAD]
    missing = [n for n, k in numels.items() if filled.get(n, 0) < k]
    if missing:
        shown = "; ".join(missing_name(n, cfg, model_dir, handles) for n in missing[:8])
        more = f"; and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise WeightsError(f"{model_dir}: checkpoint is missing weights for: {shown}{more}")


def missing_name(param: str, cfg: ModelConfig, model_dir: Path, held: dict) -> str:
    """A parameter the checkpoint did not fill, by the checkpoint's name for it: the index's name and the
    shard it assigns the tensor to where the index lists one; else the family's plain name for a weight or
    bias (`model.` + moelight's name); else moelight's own name (packed experts)."""
    targets_of = family(cfg.model_type).tensor_targets
    index = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    for raw, shard in weight_map.items():
        if raw not in held and any(t.param == param for t in targets_of(raw, cfg) or ()):
            return f"{raw} (the index puts it in {shard}, which does not hold it)"
    raw = param if param.startswith("lm_head.") else "model." + param  # the head at the top level
    if param.endswith((".weight", ".bias")) and targets_of(raw, cfg) == [Target(param)]:
        return raw
    if re.match(r"layers\.\d+\.mlp\.(gate_up_proj|down_proj)", param):
        return f"{param} (one or more routed experts' tensors of layer {param.split('.')[1]})"
    return param


def _quantized_modules(cfg: ModelConfig, handles: dict, model_dir: Path) -> dict[str, dict[str, str]]:
    if cfg.checkpoint_scheme is None:
        return {}
    return quantized_modules(handles, cfg.checkpoint_scheme, str(model_dir), cfg.listed_float)


def fillable_parameters(model: MoECausalLM) -> dict:
    """Parameter name -> what the checkpoint fills: the parameters, with each QuantizedExperts in place
    of its codes and scales."""
    quantized = quantized_experts_of(model)
    params = {n: p for n, p in model.named_parameters() if n.rpartition(".")[0] not in quantized}
    return params | quantized


def safetensors_names(path: Path) -> set[str]:
    """The tensor names of one safetensors file (its header only)."""
    with _open(path) as f:
        return set(f.keys())


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own types for corrupt files
        raise WeightsError(f"{path}: cannot read ({e})") from e


def _read(f, path: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise WeightsError(f"{path}: cannot read {name} ({e})") from e


def _unknown(param: str, raw: str, path: Path, cfg: ModelConfig, read: Callable[[], torch.Tensor]) -> None:
    """A tensor the config's model has no place for is an error inside a layer (transformers reports it
    UNEXPECTED; skipping it would change the outputs silently): an extra layer or expert, or a tensor of a
    feature config.json turns off, e.g. attention biases. An all-zero bias changes nothing (some GPTQ
    exports write them) and is skipped, as are names outside the layers (e.g. another model's heads)."""
    parts = param.split(".")
    if parts[0] != "layers" or not parts[1].isdigit():
        return
    if int(parts[1]) >= cfg.num_layers:
        raise WeightsError(f"{path}: {raw} but config.json has num_hidden_layers={cfg.num_layers}")
    if param.endswith(".bias") and not bool(read().any()):
        return
    hint = (" (an attention bias: config.json's attention_bias says whether the model has them)"
            if re.search(r"\.self_attn\.[qkvo]_proj\.bias$", param) else "")
    raise WeightsError(f"{path}: tensor {raw} has no place in the model config.json describes{hint}; make "
                       "config.json match the checkpoint, or remove the tensor")


def _copy(param: torch.Tensor, t: Target, tensor: torch.Tensor, path: Path, name: str, extra: tuple = ()) -> int:
    if t.index and isinstance(t.index[0], int) and t.index[0] >= param.shape[0]:
        raise WeightsError(f"{path}: {name} but config.json has num_local_experts={param.shape[0]} "
                           "(the number of experts)")
    target = param[t.index]  # index (): all of it (a QuantizedExperts gives a view that quantizes on copy)
    if t.transform is not None:
        try:
            tensor = t.transform(tensor, *extra)
        except (RuntimeError, ValueError) as e:  # a reshape / split that the config's shape cannot take
            raise WeightsError(f"{path}: tensor {name} of shape {tuple(tensor.shape)} does not fit "
                               f"config.json's shape ({e})") from None
    if isinstance(tensor, torch.Tensor) and tensor.dtype in _FP8 and isinstance(target, torch.Tensor):
        raise WeightsError(f"{path}: tensor {name} is stored in {tensor.dtype} without its scale (listed as "
                           "kept in float in quantization_config, or its scale tensor is missing)")
    if tuple(target.shape) != tuple(tensor.shape):
        raise WeightsError(
            f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(target.shape)}"
        )
    with torch.no_grad():
        try:
            target.copy_(tensor)
        except ValueError as e:  # a quantized piece in another format than the experts are held in
            raise WeightsError(f"{path}: tensor {name}: {e}") from None
    return target.numel()


def init_dummy_weights(model: MoECausalLM, seed: int = 0) -> None:
    """Random weights with the scale of a trained model, for benchmarking without files."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in fillable_parameters(model).items():
        dummy_fill(name, p, gen)


@torch.no_grad()
def dummy_fill(name: str, t: torch.Tensor | QuantizedExperts, gen: torch.Generator) -> None:
    """One parameter's dummy values (experts held quantized: random codes); filling the parameters in
    model order with one generator gives the same weights whether they land in a model or, one at a
    time, in a shard's staging."""
    if isinstance(t, QuantizedExperts):
        t.fill_dummy(gen)
    elif name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.endswith(".bias"):
        t.zero_()
    elif routed_expert_param(name) and t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous():
        uniform_levels_(t, 0.0346, gen)  # the bulk of a dense MoE's weights: drawn 4 to a draw
    else:
        # uniform with std 0.02 (as HF initialises); uniform is much faster than normal
        t.uniform_(-0.0346, 0.0346, generator=gen)


def empty_model(cfg: ModelConfig, dtype: torch.dtype) -> MoECausalLM:
    """The model's parameters allocated in `dtype` on the CPU, uninitialised (no init pass); routed
    experts in `cfg.expert_format` when it has one."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = MoECausalLM(cfg)
            if cfg.expert_format is not None:
                hold_experts_quantized(model, cfg.expert_format)
    finally:
        torch.set_default_dtype(previous)
    # to_empty's empty_like on meta tensors runs torch's Python decompositions (sympy and all, ~1 s of
    # every job's start); empty with the same shape and dtype is what it computes
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))


def build_model(cfg: ModelConfig, dtype: torch.dtype, model_dir: Path | None, seed: int = 0) -> MoECausalLM:
    """Allocate the model in `dtype` without initialising, then load or randomise weights."""
    model = empty_model(cfg, dtype)
    if model_dir is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
