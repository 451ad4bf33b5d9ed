"""Which form a run holds its routed experts in, decided before anything is loaded.

- `--quantize int8|int4`: round-to-nearest at load (each checkpoint tensor quantized as it is read,
  dummy weights drawn as codes), so the 16-bit experts are never in memory at once.
- A checkpoint that ships quantized experts (GPT-OSS's MXFP4, DeepSeek-V3's FP8 blocks, GPTQ / AWQ /
  compressed-tensors int4, int8 and FP8) keeps them as shipped: on the CPU in bfloat16, where the
  fused kernel multiplies them directly, and on GPUs in a 16-bit dtype, which page them so and
  expands them before its GEMMs (act-order GPTQ aside: loading/int_checkpoints.py).
- Experts the checkpoint stores in float (modules_to_not_convert, loading/checkpoint_experts.py) are
  plain experts; a mix of float and quantized ones is held only where all are dequantised at load.
- Otherwise (float32 runs, checked bit for bit against transformers; groups along K that a
  tensor-parallel rank's columns would split) the experts are dequantised into the run's dtype at load.
A tensor-parallel rank holds its part of the codes and scales (parallel/sharding.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moelight.errors import ConfigError
from moelight.loading.int_checkpoints import expert_format_of
from moelight.models.config import ModelConfig
from moelight.models.expert_format import ExpertFormat, quantize_format, rank_widths

# the checkpoint formats the kernel reads as shipped, and their group along K (FP8: its block's columns)
_SHIPPED = {"mxfp4": ("mxfp4", 32), "fp8": ("fp8", 128)}


def choose_expert_format(cfg: ModelConfig, dtype: torch.dtype, device: str, method: str,
                         group: int = 128, ranks: int = 1, given: str = "") -> ExpertFormat | None:
    """The run's expert format, None for the run's dtype. `method`: --quantize ('none', 'int8', 'int4');
    `ranks`: tensor-parallel ranks (a group along the down projection's K must fit in one rank's columns,
    or the experts are dequantised at load); `given`: the --quantize value as written, for messages."""
    widths = rank_widths(cfg.hidden_size, cfg.intermediate_size, ranks)
    if method != "none":
        given = given or method
        if cfg.checkpoint_quant and not cfg.experts_all_float:
            raise ConfigError(f"--quantize {given}: this checkpoint's experts are already {cfg.checkpoint_quant}-"
                              "quantized; leave --quantize out to run them as shipped")
        try:
            return quantize_format(method, widths, group)
        except ValueError as e:
            raise ConfigError(f"--quantize {given}: {e}") from None
    on_cpu = device == "cpu" and dtype == torch.bfloat16  # the fused kernel multiplies the codes
    on_gpu = device != "cpu" and dtype in (torch.bfloat16, torch.float16)  # paged as shipped
    if not (on_cpu or on_gpu) or cfg.experts_all_float:
        return None  # dequantised at load, or stored in float
    form = _as_shipped(cfg, widths)
    if form is not None and cfg.float_expert:
        raise ConfigError(f"{cfg.float_expert} is stored in float and {cfg.quantized_expert} {cfg.checkpoint_quant}-"
                          f"quantized: a {str(dtype).removeprefix('torch.')} run holds all routed experts in one "
                          "format; run with --dtype float32 (every expert dequantised at load), or use a checkpoint "
                          "that quantizes all routed experts or none")
    return form


def _as_shipped(cfg: ModelConfig, widths: tuple[int, ...]) -> ExpertFormat | None:
    if cfg.checkpoint_scheme is not None:
        return expert_format_of(cfg.checkpoint_scheme, widths)
    if cfg.checkpoint_quant in _SHIPPED:
        fmt, g = _SHIPPED[cfg.checkpoint_quant]
        if fmt == "fp8":  # a scale per block of columns (each row of a block repeats it)
            g = int(cfg.fp8_block[1])
        if g % 32 == 0 and all(w % g == 0 for w in widths):  # the kernel's strips are 32 columns wide
            return ExpertFormat(fmt, g, origin=f"checkpoint {cfg.checkpoint_quant}")
    return None  # dequantised at load


def with_expert_format(cfg: ModelConfig, dtype: torch.dtype, device: str, method: str,
                       group: int = 128, ranks: int = 1, given: str = "") -> ModelConfig:
    return replace(cfg, expert_format=choose_expert_format(cfg, dtype, device, method, group, ranks, given))
