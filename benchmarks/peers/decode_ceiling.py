"""The bytes one batch-1 decode token reads, and so the bandwidth-bound ceiling of quantized experts'
speed-up over bf16, for a Mixtral-shaped model (GQA attention, top-k routed SwiGLU experts).

Why: with attention, the router, the embeddings and the LM head kept in 16 bits (issue #34), only the
routed experts shrink, so int4 cannot beat bf16 by more than (bf16 bytes) / (int4 bytes) a token when
both read their weights at the same rate. The parts counted are each layer's q/k/v/o projections and
router, the top-k experts' gate_up and down matrices (in the run's format, scales and additive terms
included, as models/expert_format.py counts them), the LM head and one embedding row. The KV cache
(a few MB at a short context) and the norms are left out.

`shape_config` writes a preset's config.json with fewer layers: a model folder for `--load-format dummy`
that keeps a large model's per-layer shape on a host that cannot hold all of its layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from hrm.model_presets import PRESET_CONFIGS
from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.presets import preset_config
from moelight.models.config import ModelConfig
from moelight.models.expert_format import quantize_format

BF16 = 2  # bytes per 16-bit weight


def shape_config(preset: str, layers: int | None, folder: Path) -> Path:
    """`folder` holding `preset`'s config.json, with num_hidden_layers = `layers` (None: the preset's)."""
    cfg = dict(PRESET_CONFIGS[preset])
    if layers is not None:
        if cfg.get("model_type") != "mixtral":
            raise ValueError(f"{preset}: --layers rewrites Mixtral-shaped presets only")
        cfg["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return folder


def token_bytes(cfg: ModelConfig, quantize: str | None) -> dict[str, int]:
    """Weight bytes a batch-1 decode token reads, by part; `quantize` None (bf16), 'int8' or 'int4'."""
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attention = BF16 * h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    router = BF16 * cfg.num_experts * h
    if quantize is None:
        expert = BF16 * 3 * h * f
    else:
        form = quantize_format(quantize, (h, f))
        expert = form.matrix_bytes(2 * f, h) + form.matrix_bytes(h, f)
    return {"attention": cfg.num_layers * attention, "router": cfg.num_layers * router,
            "experts": cfg.num_layers * cfg.top_k * expert, "lm_head": BF16 * cfg.vocab_size * h,
            "embedding": BF16 * h}


def ceiling(cfg: ModelConfig, quantize: str | None, baseline: str | None = None) -> float:
    """`baseline`'s bytes a token (None: bf16) over `quantize`'s: the most its decode can gain over the
    baseline's when both read at one bandwidth."""
    return sum(token_bytes(cfg, baseline).values()) / sum(token_bytes(cfg, quantize).values())


def model_config(model: str) -> ModelConfig:
    """A preset's config, or a model folder's (its config.json)."""
    if Path(model).is_dir():
        return config_from_hf_dict(json.loads((Path(model) / "config.json").read_text()), where=model)
    return preset_config(model)
